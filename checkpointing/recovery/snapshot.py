"""One rank's in-memory snapshot of the training state, its wire format, and which peers hold copies of it.

    snap = MemorySnapshot(step, rank, world, files, metadata, table, owners, trainer_state)
    blob = snap.to_bytes()                               # for a peer's memory (replication)
    snap = MemorySnapshot.from_bytes(blob, "replica of rank 1")  # checked; stored bytes never run code
    peers = replica_peers(rank, world_size, replicas=1, node_ids=["a", "a", "b", "b"])

A snapshot holds the same files a durable checkpoint of the step holds (checkpoint
format 3: stock DCP shard files and DCP ``.metadata``, see docs/checkpoint-format.md),
in host memory: this rank's shard files, the coordinator's DCP metadata (the same
bytes on every rank) and the table of every rank's files of the step (name, size,
crc32c), agreed by all ranks when the snapshot was made. The table is what a
restore checks every byte against, as the manifest is for a durable checkpoint.

:class:`MemoryStorage` is a :class:`checkpointing.storage.base.Storage` whose objects
are ``bytes`` in this process (or callables that produce them): the durable
writer (:class:`checkpointing.dcp.writer.EtrainWriter`) writes a snapshot's files
into one, and the durable reader (:class:`checkpointing.dcp.reader.EtrainReader`)
reads a restore's files from one, so both tiers share one writer, one reader,
one format and one resharding path.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..dcp.format import CorruptCheckpointError
from ..dcp.reader import check_locations, load_metadata
from ..manifest import CRC_RE, METADATA_NAME, SHARD_RE, FileEntry, checksum, step_dir
from ..storage.base import Storage, confine

MAGIC = b"ETRAIN-MEMORY-SNAPSHOT\n"
WIRE_VERSION = 2
_FRAME = struct.Struct("<QI")  # the header's length and crc32c
MAX_HEADER_BYTES = 16 << 20

Source = bytes | Callable[[], bytes]
# (metadata crc32c, file sizes) of the snapshots whose DCP metadata was read and checked against their table.
_CHECKED: dict[tuple, None] = {}


def step_rel(step: int) -> str:
    """Where a snapshot's files sit in its MemoryStorage: ``memory/step_<NNNNNNNNN>`` (the checkpoints' naming)."""
    return f"memory/{step_dir(step)}"


class MemoryStorage(Storage):
    """Objects in this process's memory: ``{key: bytes or a callable returning bytes}``.

    Writes copy the given buffers into one ``bytes`` (the snapshot's copy of the
    state) and return its crc32c, as :meth:`Storage.put_parts` does; reads call a
    callable source when asked (a file fetched from another holder). Nothing goes
    to fsspec's process-wide ``memory://`` store."""

    def __init__(self, objects: Mapping[str, Source] | None = None, region=None):
        super().__init__("memory://etrain-memory-tier", concurrency=2)
        self.objects: dict[str, Source] = dict(objects or {})
        self._objects_lock = threading.Lock()
        self.region = region  # a memory file the writes go to (checkpointing.recovery.local_copy.Region)

    def put_parts(self, rel: str, parts: list, *, exclusive: bool = False) -> str:
        data = self.region.put(parts) if self.region is not None else None
        if data is None:  # no region, or it is full
            data = b"".join(memoryview(p).cast("B") for p in parts)
        self._store(rel, data, exclusive)
        return checksum(data)

    def put_patched(self, rel: str, size: int, patches: list) -> str:
        """A file laid out in the region before, with ``patches`` written over it (``Region.put_patched``):
        stored as the region's view of it, and its crc32c. OSError when the region will not take it."""
        data = self.region.put_patched(size, patches) if self.region is not None else None
        if data is None:
            raise OSError(f"{rel}: the memory file it was laid out in would not take it")
        self._store(rel, data, True)
        return checksum(data)

    def put_many(self, items: list, *, exclusive: bool = False) -> None:
        for rel, data in items:
            self._store(rel, bytes(data), exclusive)

    def _store(self, rel: str, data: bytes, exclusive: bool) -> None:
        confine(rel)
        with self._objects_lock:
            if exclusive and rel in self.objects:
                raise FileExistsError(rel)
            self.objects[rel] = data

    def get_many(self, rels: Iterable[str]) -> dict[str, bytes | bytearray | memoryview]:
        """The objects ``rels``; callable sources (files fetched from other holders) called together, so that
        their fetches overlap rather than follow one another."""
        srcs = {}
        for rel in dict.fromkeys(rels):
            with self._objects_lock:
                srcs[rel] = self.objects.get(rel)
            if srcs[rel] is None:
                raise FileNotFoundError(rel)
        fetch = [rel for rel, src in srcs.items() if callable(src)]
        if len(fetch) > 1:
            calls = [srcs[rel] for rel in fetch]
            with ThreadPoolExecutor(min(len(fetch), 8), thread_name_prefix="etrain-memfetch") as pool:
                srcs.update(zip(fetch, list(pool.map(lambda call: call(), calls))))
        out = {}
        for rel, src in srcs.items():
            data = src() if callable(src) else src
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise CorruptCheckpointError(f"the source of {rel} gave a {type(data).__name__}, not bytes")
            out[rel] = data  # a view is read in place (the reader only copies out of it)
        return out

    def list_dir(self, rel: str = "") -> dict[str, int | None]:
        head = f"{rel.rstrip('/')}/" if rel else ""
        out: dict[str, int | None] = {}
        with self._objects_lock:
            items = list(self.objects.items())
        for key, src in items:
            if key.startswith(head):
                name, _, rest = key[len(head):].partition("/")
                out[name] = None if rest else (len(src) if isinstance(src, (bytes, bytearray)) else 0)
        return out

    def delete_tree(self, rel: str) -> None:
        with self._objects_lock:
            for key in [k for k in self.objects if k == rel or k.startswith(f"{rel}/")]:
                del self.objects[key]

    def abort_stale_uploads(self, rel: str, older_than_s: float) -> int:
        return 0


@dataclass
class MemorySnapshot:
    """One rank's copy of step ``step``: its own shard files, and what a restore needs to check them and
    the other ranks' files. ``agreed``: every rank of the group holds its files of this step complete
    (see :class:`checkpointing.recovery.tier.MemoryTier`); a snapshot that is not agreed is never used."""

    step: int
    rank: int
    world_size: int
    files: dict[str, bytes | memoryview]  # this rank's shard files (views of the received bytes in a copy)
    metadata: bytes  # the DCP metadata of the step (pickled, as stock DCP writes it)
    table: dict[str, FileEntry]  # every rank's shard files of the step
    owners: dict[str, int]  # which rank wrote each file of the table
    trainer_state: dict = field(default_factory=dict)  # JSON: step, samples consumed, ...
    agreed: bool = False

    @property
    def nbytes(self) -> int:
        """Host bytes this snapshot holds."""
        return sum(len(b) for b in self.files.values()) + len(self.metadata)

    def file_table(self) -> dict[str, FileEntry]:
        """Every file of the step, the DCP metadata included: what a restore's reader checks bytes against."""
        md = FileEntry(METADATA_NAME, len(self.metadata), checksum(self.metadata))
        return {**self.table, METADATA_NAME: md}

    def names(self) -> set[str]:
        """The files a restore can take from this snapshot: its own shards and the metadata."""
        return {*self.files, METADATA_NAME}

    def sources(self) -> dict[str, bytes | memoryview]:
        return {**self.files, METADATA_NAME: self.metadata}

    def verify(self, where: str = "", *, crc: bool = True) -> None:
        """Each file of this snapshot has the size and (``crc``) crc32c the agreed table lists;
        CorruptCheckpointError naming the file otherwise."""
        where = where or f"the memory snapshot of rank {self.rank} at step {self.step}"
        for name, data in self.files.items():
            want = self.table.get(name)
            if want is None:
                raise CorruptCheckpointError(f"{where}: {name} is not a file of step {self.step}")
            if len(data) != want.size or (crc and checksum(data) != want.crc32c):
                raise CorruptCheckpointError(f"{where}: {name} fails its checksum or size (crc32c {checksum(data)}, "
                                             f"{len(data)} bytes; agreed {want.crc32c}, {want.size} bytes)")

    # --- the wire format -----------------------------------------------------------

    def to_bytes(self) -> bytes:
        """``MAGIC``, the length and crc32c of a JSON header, the header, then the metadata and this rank's
        files in the header's order. No pickle: the receiver parses data, never code."""
        return b"".join(self.wire_parts())

    def wire_parts(self) -> list:
        """:meth:`to_bytes` in pieces, not joined: the frame, header and metadata, then each own file (sorted
        by name) as it is held (the copies to peers send them so: raw, no second copy of the state)."""
        own = sorted(self.files)
        header = {"version": WIRE_VERSION, "step": self.step, "rank": self.rank, "world_size": self.world_size,
                  "agreed": self.agreed, "trainer_state": self.trainer_state,
                  "metadata": [len(self.metadata), checksum(self.metadata)],
                  "table": [[e.path, e.size, e.crc32c, self.owners[e.path]] for e in self.table.values()],
                  "own": own}
        head = json.dumps(header, sort_keys=True).encode()
        return [b"".join([MAGIC, _FRAME.pack(len(head), int(checksum(head), 16)), head, self.metadata]),
                *(self.files[n] for n in own)]

    def own_sizes(self, rank: int) -> list[int]:
        """The sizes of ``rank``'s files of this step by the agreed table, in :meth:`wire_parts`' order."""
        return [self.table[p].size for p in sorted(p for p, o in self.owners.items() if o == rank)]

    def wire_bound(self, rank: int) -> int:
        """The most bytes :meth:`to_bytes` of ``rank``'s snapshot of this step can take, by this snapshot's
        agreed table and metadata: what a receiver allocates at most for a copy announced by ``rank``."""
        files = sum(e.size for p, e in self.table.items() if self.owners.get(p) == rank)
        return len(MAGIC) + _FRAME.size + MAX_HEADER_BYTES + len(self.metadata) + files

    def check_same_step(self, other: MemorySnapshot, where: str) -> None:
        """``other`` (a copy received from a peer) is of this snapshot's agreed step: the same step, world
        size, file table, owners and DCP metadata; CorruptCheckpointError naming the first difference."""
        mine, theirs = self.file_table(), other.file_table()
        files = [p for p in sorted(mine.keys() | theirs.keys())
                 if mine.get(p) != theirs.get(p) or self.owners.get(p) != other.owners.get(p)]
        diff = ("its step" if other.step != self.step else "the world size" if other.world_size != self.world_size
                else "whether it is agreed" if other.agreed != self.agreed
                else f"{files[0]} (size, crc32c or owner)" if files else "")
        if diff:
            raise CorruptCheckpointError(f"{where} disagrees with this rank's snapshot of step {self.step} on {diff} "
                                         f"(its step {other.step}, world {other.world_size}); it is not kept")

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview, where: str = "a memory snapshot", *,
                   verify: bool = True) -> MemorySnapshot:
        """A snapshot from :meth:`to_bytes`' bytes, checked: the header's checksum and schema (the trainer
        state's too, :func:`check_trainer_state`), every file against the table (``verify``: its crc32c
        too; a copy mapped from its sender's memory is checked so on restore, as every file a restore
        reads is), and the DCP metadata through the restricted unpickler, its items inside the table's
        files. CorruptCheckpointError naming what is wrong otherwise, never another error."""
        view = memoryview(blob).cast("B")
        start = len(MAGIC) + _FRAME.size
        if len(view) < start or bytes(view[: len(MAGIC)]) != MAGIC:
            raise CorruptCheckpointError(f"{where} is not a memory snapshot")
        n, crc = _FRAME.unpack_from(view, len(MAGIC))
        if n > min(MAX_HEADER_BYTES, len(view) - start):
            raise CorruptCheckpointError(f"{where} announces a header of {n} bytes; it has {len(view) - start} "
                                         f"bytes after its frame (at most {MAX_HEADER_BYTES})")
        head = bytes(view[start : start + n])
        if int(checksum(head), 16) != crc:
            raise CorruptCheckpointError(f"{where}: its header fails its checksum")
        try:
            h = json.loads(head)
            snap, sizes, md_crc = cls._from_header(h)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where} has an invalid header ({str(e)[:120]})") from None
        pos = start + n
        if len(view) != pos + sum(sizes):
            raise CorruptCheckpointError(f"{where} has {len(view) - pos} bytes of files, its header says {sum(sizes)}")
        snap.metadata = bytes(view[pos : pos + sizes[0]])
        pos += sizes[0]
        if checksum(snap.metadata) != md_crc:
            raise CorruptCheckpointError(f"{where}: its DCP metadata fails its checksum")
        for name, size in zip(h["own"], sizes[1:]):
            snap.files[name] = view[pos : pos + size]  # no copy: the files stay in the received buffer
            pos += size
        snap.verify(where, crc=verify)
        # The metadata and the files' sizes repeat from one snapshot to the next while the layout holds:
        # checked once per (metadata, sizes), the crc32c of every byte above each time.
        shape = (checksum(snap.metadata), tuple(sorted((e.path, e.size) for e in snap.table.values())))
        if shape not in _CHECKED:
            check_locations(load_metadata(snap.metadata, f"{where}: {METADATA_NAME}"), snap.file_table(), where)
            _CHECKED[shape] = None
            while len(_CHECKED) > 8:
                del _CHECKED[next(iter(_CHECKED))]
        return snap

    @classmethod
    def _from_header(cls, h) -> tuple[MemorySnapshot, list[int], str]:
        """The snapshot a header describes (no files yet), the sizes of its metadata and own files, and
        its metadata's crc32c; ValueError (or TypeError, KeyError) naming what is wrong."""
        if not isinstance(h, dict) or set(h) != _HEADER_KEYS:
            keys = sorted(map(str, h)) if isinstance(h, dict) else type(h).__name__
            raise ValueError(f"its fields are {str(keys)[:80]}, not {sorted(_HEADER_KEYS)}")
        if type(h["version"]) is not int or h["version"] != WIRE_VERSION:
            raise ValueError(f"version {str(h['version'])[:20]} is not {WIRE_VERSION}")
        if not isinstance(h["agreed"], bool):
            raise TypeError("agreed is not true or false")
        md = h["metadata"]
        if not isinstance(md, list) or len(md) != 2 or not _is_crc(md[1]):
            raise ValueError("metadata is not [size, crc32c]")
        if not isinstance(h["table"], list):
            raise TypeError("table is not a list")
        world, rank, step = _count(h["world_size"]), _count(h["rank"]), _count(h["step"])
        table, owners = {}, {}
        for row in h["table"]:
            if not isinstance(row, list) or len(row) != 4:
                raise ValueError(f"{str(row)[:60]} is not [path, size, crc32c, owner]")
            path, size, crc, owner = row
            if not isinstance(path, str) or not SHARD_RE.fullmatch(path) or not _is_crc(crc) or path in table:
                raise ValueError(f"{str(path)[:60]!r} is not a shard file name, or its crc32c is not 8 hex digits")
            table[path] = FileEntry(path, _count(size), crc)
            owners[path] = _count(owner)
        own = h["own"]
        if (not isinstance(own, list) or not all(isinstance(p, str) and owners.get(p) == rank for p in own)
                or len(set(own)) != len(own)):
            raise ValueError(f"its own files are not files of its table that rank {rank} wrote")
        if rank >= world or any(o >= world for o in owners.values()):
            raise ValueError(f"rank {rank} or a file's owner is outside world {world}")
        state = check_trainer_state(h["trainer_state"], step)
        snap = cls(step, rank, world, {}, b"", table, owners, state, h["agreed"])
        return snap, [_count(md[0]), *(table[p].size for p in own)], md[1]


_HEADER_KEYS = {"version", "step", "rank", "world_size", "agreed", "trainer_state", "metadata", "table", "own"}


_COUNT_MAX = 1 << 62


def _count(v) -> int:
    if type(v) is not int or not 0 <= v < _COUNT_MAX:
        raise ValueError(f"{str(v)[:20]!r} is not a count")
    return v


def _is_crc(v) -> bool:
    return isinstance(v, str) and bool(CRC_RE.fullmatch(v))


# --- the trainer state a snapshot carries ------------------------------------------------

_TEXT_MAX = 4096
_RANGES_MAX = 65536


def check_trainer_state(state, step: int, where: str = "trainer_state", *, required: bool = False) -> dict:
    """``state`` (the trainer state of a snapshot of ``step``, JSON) if it has the schema a restore
    applies: ``step`` (equal to ``step``) and ``samples_consumed``, counts; ``epoch``, a count;
    ``corpus_digest`` and ``weights_from``, strings; ``history_row``, a list of up to 16 numbers or
    nulls; ``skipped_ranges``, [start, end) count pairs; ``verified``, ``{"step", "checks"}``; any other
    key a finite number, string, bool or null. ``required``: ``step`` and ``samples_consumed`` must be
    there (a restore needs them). ValueError or TypeError naming the key otherwise."""
    if not isinstance(state, dict):
        raise TypeError(f"{where} is a {type(state).__name__}, not a table")
    if required:
        missing = [k for k in ("step", "samples_consumed") if k not in state]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}")
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"{where} has a key that is not a string")
        if key in ("step", "samples_consumed", "epoch"):
            ok = type(value) is int and 0 <= value < _COUNT_MAX
        elif key in ("corpus_digest", "weights_from"):
            ok = isinstance(value, str) and len(value) <= _TEXT_MAX
        elif key == "skipped_ranges":  # [health]: sample ranges [start, end) never trained on
            ok = isinstance(value, list) and len(value) <= _RANGES_MAX and all(
                isinstance(r, list) and len(r) == 2 and all(type(v) is int and 0 <= v < _COUNT_MAX for v in r)
                for r in value)
        elif key == "verified":  # [health]: the check this step passed
            ok = (isinstance(value, dict) and set(value) <= {"step", "checks"} and type(value.get("step")) is int
                  and isinstance(value.get("checks", []), list) and len(value.get("checks", [])) <= 16
                  and all(isinstance(c, str) and len(c) <= 64 for c in value.get("checks", [])))
        elif key == "history_row":
            ok = isinstance(value, list) and len(value) <= 16 and all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in value)
        else:
            ok = (value is None or isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value))
                  or (isinstance(value, str) and len(value) <= _TEXT_MAX))
        if not ok:
            raise ValueError(f"{where}.{key[:40]} has the wrong type or size ({str(value)[:40]!r})")
    if "step" in state and state["step"] != step:
        raise ValueError(f"{where}.step is {state['step']} but the snapshot is of step {step}")
    return state


# --- where copies go -------------------------------------------------------------------


def replica_peers(rank: int, world_size: int, replicas: int = 1, node_ids: list | None = None) -> list[int]:
    """The ranks that hold copies of ``rank``'s files: the next ranks after it (mod ``world_size``), those on
    another node than ``rank``'s first when ``node_ids`` (one per rank) says where each rank runs, so one
    node's loss does not take a rank and its copies together. At most ``world_size - 1``."""
    if node_ids is not None and len(node_ids) != world_size:
        raise ValueError(f"node_ids has {len(node_ids)} entries for {world_size} ranks; give one per rank")
    order = [(rank + k) % world_size for k in range(1, world_size)]
    if node_ids is not None:
        order = ([r for r in order if node_ids[r] != node_ids[rank]]
                 + [r for r in order if node_ids[r] == node_ids[rank]])
    return order[: max(0, replicas)]
