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

:class:`MemoryStorage` is a :class:`checkpointing.storage.Storage` whose objects
are ``bytes`` in this process (or callables that produce them): the durable
writer (:class:`checkpointing.dcp_io.EtrainWriter`) writes a snapshot's files
into one, and the durable reader (:class:`checkpointing.dcp_read.EtrainReader`)
reads a restore's files from one, so both tiers share one writer, one reader,
one format and one resharding path.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from .dcp_format import CorruptCheckpointError
from .dcp_read import check_locations, load_metadata
from .manifest import METADATA_NAME, SHARD_RE, FileEntry, checksum, step_dir
from .storage import Storage, confine

MAGIC = b"ETRAIN-MEMORY-SNAPSHOT\n"
WIRE_VERSION = 1
_LEN = struct.Struct("<Q")

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

    def __init__(self, objects: Mapping[str, Source] | None = None):
        super().__init__("memory://etrain-memory-tier", concurrency=2)
        self.objects: dict[str, Source] = dict(objects or {})
        self._objects_lock = threading.Lock()

    def put_parts(self, rel: str, parts: list, *, exclusive: bool = False) -> str:
        data = b"".join(memoryview(p).cast("B") for p in parts)
        self._store(rel, data, exclusive)
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
        out = {}
        for rel in dict.fromkeys(rels):
            with self._objects_lock:
                src = self.objects.get(rel)
            if src is None:
                raise FileNotFoundError(rel)
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
    (see :class:`checkpointing.memory_tier.MemoryTier`); a snapshot that is not agreed is never used."""

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

    def verify(self, where: str = "") -> None:
        """Each file of this snapshot has the size and crc32c the agreed table lists; CorruptCheckpointError
        naming the file otherwise."""
        where = where or f"the memory snapshot of rank {self.rank} at step {self.step}"
        for name, data in self.files.items():
            want = self.table.get(name)
            if want is None:
                raise CorruptCheckpointError(f"{where}: {name} is not a file of step {self.step}")
            if len(data) != want.size or checksum(data) != want.crc32c:
                raise CorruptCheckpointError(f"{where}: {name} fails its checksum or size (crc32c {checksum(data)}, "
                                             f"{len(data)} bytes; agreed {want.crc32c}, {want.size} bytes)")

    # --- the wire format -----------------------------------------------------------

    def to_bytes(self) -> bytes:
        """``MAGIC``, the length of a JSON header, the header, then the metadata and this rank's files in
        the header's order. No pickle: the receiver parses data, never code."""
        own = sorted(self.files)
        header = {"version": WIRE_VERSION, "step": self.step, "rank": self.rank, "world_size": self.world_size,
                  "agreed": self.agreed, "trainer_state": self.trainer_state,
                  "metadata": [len(self.metadata), checksum(self.metadata)],
                  "table": [[e.path, e.size, e.crc32c, self.owners[e.path]] for e in self.table.values()],
                  "own": own}
        head = json.dumps(header, sort_keys=True).encode()
        return b"".join([MAGIC, _LEN.pack(len(head)), head, self.metadata, *(self.files[n] for n in own)])

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray, where: str = "a memory snapshot") -> MemorySnapshot:
        """A snapshot from :meth:`to_bytes`' bytes, checked: the header's schema, every file against the
        table, and the DCP metadata through the restricted unpickler, its items inside the table's
        files. CorruptCheckpointError naming what is wrong otherwise."""
        view = memoryview(blob)
        start = len(MAGIC) + _LEN.size
        if bytes(view[: len(MAGIC)]) != MAGIC or len(view) < start:
            raise CorruptCheckpointError(f"{where} is not a memory snapshot")
        (n,) = _LEN.unpack_from(view, len(MAGIC))
        try:
            h = json.loads(bytes(view[start : start + n]))
            snap, sizes = cls._from_header(h)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where} has an invalid header ({str(e)[:120]})") from None
        pos = start + n
        if len(view) != pos + sum(sizes):
            raise CorruptCheckpointError(f"{where} has {len(view) - pos} bytes of files, its header says {sum(sizes)}")
        snap.metadata = bytes(view[pos : pos + sizes[0]])
        pos += sizes[0]
        if checksum(snap.metadata) != h["metadata"][1]:
            raise CorruptCheckpointError(f"{where}: its DCP metadata fails its checksum")
        for name, size in zip(h["own"], sizes[1:]):
            snap.files[name] = view[pos : pos + size]  # no copy: the files stay in the received buffer
            pos += size
        snap.verify(where)
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
    def _from_header(cls, h) -> tuple[MemorySnapshot, list[int]]:
        def nat(v) -> int:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{str(v)[:20]!r} is not a count")
            return v

        if not isinstance(h, dict) or h.get("version") != WIRE_VERSION:
            raise ValueError(f"version {str(h.get('version') if isinstance(h, dict) else h)[:20]} is not {WIRE_VERSION}")
        if not isinstance(h["trainer_state"], dict) or not isinstance(h["agreed"], bool):
            raise ValueError("trainer_state or agreed has the wrong type")
        table, owners = {}, {}
        for path, size, crc, owner in h["table"]:
            if not isinstance(path, str) or not SHARD_RE.fullmatch(path) or not isinstance(crc, str):
                raise ValueError(f"{str(path)[:60]!r} is not a shard file name")
            table[path] = FileEntry(path, nat(size), crc)
            owners[path] = nat(owner)
        own = h["own"]
        if not isinstance(own, list) or any(p not in table for p in own) or len(set(own)) != len(own):
            raise ValueError("its own files are not files of its table")
        world, rank = nat(h["world_size"]), nat(h["rank"])
        if rank >= world or any(o >= world for o in owners.values()):
            raise ValueError(f"rank {rank} or a file's owner is outside world {world}")
        snap = cls(nat(h["step"]), rank, world, {}, b"", table, owners, h["trainer_state"], h["agreed"])
        return snap, [nat(h["metadata"][0]), *(table[p].size for p in own)]


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
