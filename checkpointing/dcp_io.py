"""DCP ``StorageWriter`` / ``StorageReader`` over :class:`checkpointing.storage.Storage`.

The writer splits saving in two. ``write_data`` (inside ``dcp.save``) lays
the items this rank writes out into files of ~32 MiB and answers DCP at once
with where every item will live. A file is a list of byte views: host tensors
are not copied (a sync save keeps training waiting until they are written; an
async save writes from its own snapshot, which nothing touches until the save
ends); only device or non-contiguous tensors are copied into reused host
buffers. :meth:`EtrainWriter.upload` (no collectives) waits for the files,
several in flight, each checksummed as it is written. Tensors are stored as
raw bytes (no pickling), so a reader can slice any sub-block of a saved shard,
which is what resharding needs.

Every file of a save attempt is named by that attempt (:func:`file_name`:
the epoch, the rank, the file's number and a random token per rank and
attempt) and created exclusively, so no save ever writes into a file of
another save, committed or not. The DCP metadata is written by the manager at
commit (``.metadata``, the name stock DCP readers look for).

The reader fetches whole files, checks each against the manifest's size and
crc32c before any byte is used, and copies the requested sub-blocks into the
destination tensors (DTensor shards included). A mismatch raises
:class:`CorruptCheckpointError` naming the file; DCP turns an error on any
rank into an error on every rank, so all ranks fall back together.

Stored bytes are data, never code: the DCP metadata (a pickle, as stock DCP
writes it) is read with a restricted unpickler that knows only DCP's metadata
classes (:func:`load_metadata`), every item location in it is checked against
the manifest, and non-tensor items are loaded with ``torch.load(...,
weights_only=True)``. Anything else makes the checkpoint corrupt.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import re
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future as TorchFuture

from .errors import CheckpointError
from .manifest import FILE_SIZE, METADATA_RE, FileEntry, checksum
from .storage import MiB, Storage

_ALIGN = 64


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated or fails its checksum."""


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved item lives: a byte range of one file, and how to read it back."""

    path: str
    offset: int
    length: int
    dtype: str | None = None  # tensors: "float32", ...
    shape: tuple[int, ...] | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class StagingPool:
    """Host buffers kept from one save to the next, for tensors that must be copied to host.

    Touching fresh memory costs page faults on every save; a reused buffer is
    already mapped. The pool holds at most what the last save staged
    (``held_bytes``): nothing when every tensor saved is a contiguous host tensor.
    """

    def __init__(self):
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int, pin: bool) -> torch.Tensor:
        best = None
        for i, t in enumerate(self._free):
            if t.numel() >= nbytes and (best is None or t.numel() < self._free[best].numel()):
                best = i
        if best is not None:
            return self._free.pop(best)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def give(self, buffers: list[torch.Tensor]) -> None:
        self._free = [b._base if b._base is not None else b for b in buffers]

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() for t in self._free)


_ZEROS = bytes(_ALIGN)


@dataclass
class _StagedFile:
    path: str
    parts: list  # byte views written in order: items, and the zeros that pad each to 64 bytes
    size: int
    keep: list  # the tensors and host buffers the views point into, alive until the upload ends


def _host_bytes(t: torch.Tensor) -> memoryview | None:
    """A zero-copy byte view of a contiguous host tensor; None when it must be copied first."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    try:
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError, ValueError):
        return None


class PlannedItems:
    """Finds the items of a plan DCP made earlier in a state dict of the same layout, by the paths
    its planner flattened them from: what DCP's planner would resolve, without flattening the
    state again or going through autograd for each shard (a ``planner`` for ``write_data``)."""

    def __init__(self, paths: dict[str, tuple], state_dict: dict):
        self.paths = paths
        self.state_dict = state_dict

    @staticmethod
    def paths_of(plan: SavePlan, planner, state_dict: dict) -> dict[str, tuple] | None:
        """Each item's path in ``state_dict``, checked against what ``planner`` (a DefaultSavePlanner
        that planned it) resolved; None when some item is not a plain lookup (e.g. a ShardedTensor)."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed.tensor import DTensor

        mappings, flat = getattr(planner, "mappings", None), getattr(planner, "state_dict", None)
        if not getattr(planner, "flatten_state_dict", False) or mappings is None or flat is None:
            return None
        paths = {}
        for item in plan.items:
            fqn = item.index.fqn
            path = mappings.get(fqn)
            try:
                obj = _lookup(state_dict, path)
            except (KeyError, IndexError, TypeError):
                return None
            if obj is not flat.get(fqn):
                return None
            if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and (
                    isinstance(obj, ShardedTensor) or hasattr(obj, "__get_tensor_shard__")):
                return None
            paths[fqn] = path
        return paths

    def resolve_data(self, item):
        from torch.distributed.tensor import DTensor

        obj = _lookup(self.state_dict, self.paths[item.index.fqn])
        if item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(obj, buf)
            return buf
        return obj._local_tensor if isinstance(obj, DTensor) else obj


def _lookup(state_dict, path):
    obj = state_dict
    for k in path:
        obj = obj[k]
    return obj


def file_prefix(epoch: int) -> str:
    """What every file name of a save by ``epoch`` starts with ("" at epoch 0, "e<epoch>" after).

    The epoch says which group wrote a file (a writer of an old epoch may live
    on, cut off or paused, and save the same step again; the fence refuses its
    commit). What keeps its uploads off every other save's files is the token
    of :func:`file_name`, unique to each rank's attempt.
    """
    return f"e{epoch}" if epoch else ""


_NAME_RE = re.compile(r"^(?P<head>.*__\d+_\d+)\.(?P<token>[0-9a-f]{8})\.distcp$")


def file_name(prefix: str, k: int, token: str) -> str:
    """The name of file ``k`` of a rank whose plan prefix is ``prefix`` (``e<epoch>__<rank>_``), in the
    save attempt whose token (random, per rank and attempt) is ``token``."""
    return f"{prefix}{k}.{token}.distcp"


def _retoken(path: str, tokens: dict[str, str]) -> str:
    m = _NAME_RE.match(path)
    if m is None or m["token"] not in tokens:
        raise CheckpointError(f"cannot rename {path!r} for a new save attempt")
    return f"{m['head']}.{tokens[m['token']]}.distcp"


def same_results(a: list[WriteResult], b: list[WriteResult]) -> bool:
    """Whether two saves laid their items out the same way, whatever their file tokens."""
    def key(r: WriteResult):
        loc = r.storage_data
        head = _NAME_RE.match(loc.path)
        return r.index, r.size_in_bytes, head["head"] if head else loc.path, loc.offset, loc.length, loc.dtype, \
            loc.shape
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


def retoken_metadata(metadata: Metadata, tokens: dict[str, str]) -> Metadata:
    """``metadata`` with every item's file renamed from an old attempt's token to the new one's."""
    storage = {idx: dataclasses.replace(loc, path=_retoken(loc.path, tokens))
               for idx, loc in metadata.storage_data.items()}
    return dataclasses.replace(metadata, storage_data=storage)


class EtrainWriter(StorageWriter):
    """Lays files out in ``write_data``; :meth:`upload` (later, in the thread
    that runs the save) waits for the files and sends the DCP metadata. One
    instance per save.

    The state handed to ``dcp.save`` is read until :meth:`upload` returns (or
    :meth:`abort` does): the caller must not change it before then. The
    manager saves either synchronously (training waits) or from its own
    snapshot (async), so that holds.

    ``overlap=True`` starts each file's upload as soon as it is laid out,
    while DCP finishes its collectives; otherwise :meth:`upload` starts them.
    Upload threads never run collectives.

    Every file name carries the save's ``epoch`` and this attempt's ``token``
    (see :func:`file_name`); every file is created exclusively.
    """

    def __init__(self, storage: Storage, step_rel: str, *, file_size: int = FILE_SIZE,
                 pool: StagingPool | None = None, overlap: bool = False, executor: ThreadPoolExecutor | None = None,
                 epoch: int = 0, token: str = ""):
        super().__init__()
        self.storage = storage
        self.step_rel = step_rel
        self.epoch = epoch
        self.token = token or uuid.uuid4().hex[:8]
        self.file_size = file_size
        self.pool = pool
        self.overlap = overlap
        self.is_coordinator = False
        self.staged: list[_StagedFile] = []
        self.metadata: Metadata | None = None  # the coordinator's, once dcp.save finished
        self.written: list[str] = []  # names of every file this writer started to write
        self.plan: SavePlan | None = None  # the final local plan write_data was given
        self.results: list[WriteResult] = []  # and what it answered
        self.staged_bytes = 0  # host memory this save copied into (device or non-contiguous tensors)
        self._buffers: list[torch.Tensor] = []
        self._uploads: list[Future] = []
        self._futures: list[Future] = []  # every upload this writer submitted, the metadata's included
        # Upload threads: the caller's (kept from one save to the next: starting
        # threads costs milliseconds each on a busy host), else made here.
        self._executor = executor
        self._own_executor = executor is None
        self.timings: dict[str, float] = {}  # monotonic times of write_data's start and end

    def reset(self, checkpoint_id=None) -> None:
        self.staged, self.metadata, self.staged_bytes, self._buffers = [], None, 0, []

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Each rank's files get a distinct prefix, so no two ranks write the same object.
        return [dataclasses.replace(p, storage_data=f"{file_prefix(self.epoch)}__{i}_") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        self.timings["write_data"] = time.monotonic()
        self.plan = plan
        prefix = plan.storage_data
        # Resolve and size every item, then lay the items out in files of ~file_size.
        items = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                items.append((item, raw, len(raw)))
            else:
                t = data.detach()
                items.append((item, t, t.numel() * t.element_size()))
        files = _split(items, self.file_size, upload_threads(self.storage))
        results = []
        if self._executor is None:
            self._executor = ThreadPoolExecutor(upload_threads(self.storage), thread_name_prefix="etrain-up")
        for k, group in enumerate(files):
            if not group:
                continue
            name = file_name(prefix, k, self.token)
            staged = self._lay_out(name, group)
            off = 0
            for item, data, n in group:
                if isinstance(data, bytes):
                    loc = ItemLocation(name, off, n)
                else:
                    loc = ItemLocation(name, off, n, _dtype_name(data.dtype), tuple(data.shape))
                results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=loc))
                off += _padded(n)
            self.staged.append(staged)
            if self.overlap:
                self._uploads.append(self._submit(self._upload_file, staged))
        self.results = results
        self.timings["write_data_end"] = time.monotonic()
        fut: TorchFuture = TorchFuture()
        fut.set_result(results)
        return fut

    def _lay_out(self, name: str, group: list) -> _StagedFile:
        """One file as byte views: host tensors as they are, the others copied into one host buffer."""
        views: list = []
        copies = []  # (index in views, tensor) of items that need a copy to host
        keep: list = []
        for _, data, n in group:
            if isinstance(data, bytes):
                views.append(memoryview(data))
            elif n:
                view = _host_bytes(data)
                if view is None:
                    copies.append((len(views), data))
                keep.append(data)
                views.append(view)
            else:
                views.append(memoryview(b""))
            if _padded(n) > n:
                views.append(memoryview(_ZEROS)[: _padded(n) - n])
        if copies:
            total = sum(t.numel() * t.element_size() for _, t in copies)
            cuda = torch.cuda.is_available()
            buf = self.pool.take(total, cuda) if self.pool else torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
            self._buffers.append(buf)
            self.staged_bytes += total
            keep.append(buf)
            off = 0
            from_device = False
            for i, t in copies:
                n = t.numel() * t.element_size()
                src = t if t.is_contiguous() else t.contiguous()
                from_device |= src.device.type == "cuda"
                dst = buf[off : off + n]
                dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=src.device.type == "cuda")
                views[i] = memoryview(dst.numpy())
                off += n
            if from_device:
                torch.cuda.synchronize()  # the upload thread reads this buffer next
        return _StagedFile(name, views, sum(len(v) for v in views), keep)

    def _submit(self, fn, *args) -> Future:
        fut = self._executor.submit(fn, *args)
        self._futures.append(fut)
        return fut

    def _upload_file(self, f: _StagedFile) -> FileEntry:
        self.written.append(f.path)
        crc = self.storage.put_parts(f"{self.step_rel}/{f.path}", f.parts, exclusive=True)
        return FileEntry(f.path, f.size, crc)

    def remove_files(self) -> None:
        """Delete the files this writer wrote (after :meth:`abort`): a failed save leaves nothing.
        Their names are this attempt's own, so nothing of another save is touched."""
        for name in self.written:
            try:
                self.storage.delete_tree(f"{self.step_rel}/{name}")
            except Exception:  # retention removes what is left of an uncommitted step
                pass
        self.written = []

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Runs on the coordinator while every rank waits for the result: only
        # collect here; pickling waits for upload(), beside the file writes.
        storage_md = {}
        for per_rank in results:
            for wr in per_rank:
                storage_md[wr.index] = wr.storage_data
        metadata.storage_data = storage_md
        # A copy: with plan caching DCP hands the same Metadata object to the next save.
        self.metadata = dataclasses.replace(metadata, storage_data=storage_md)

    def upload(self) -> list[FileEntry]:
        """Wait for this rank's file uploads; raises the first failure. (The coordinator's DCP
        metadata is written by the manager at commit.)"""
        try:
            if not self.overlap:
                self._uploads = [self._submit(self._upload_file, f) for f in self.staged]
            entries = [f.result() for f in self._uploads]
        finally:
            self.abort()
        return entries

    def abort(self) -> None:
        """Cancel the uploads not started and wait for the others: after this no thread reads the state."""
        if self._executor is None:
            return
        if self._own_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)
            return
        for f in self._futures:
            f.cancel()
        wait_all(self._futures)

    def release(self) -> None:
        """Drop the views of the state; hand the host buffers back (to the pool, for the next save)."""
        if self.pool is not None and self._buffers:
            self.pool.give(self._buffers)
        self.staged = []
        self._buffers = []
        self.staged_bytes = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _split(items: list, file_size: int, threads: int) -> list[list]:
    """Items (in order) into files of about equal size, at most ~``file_size`` each; more than one
    file makes a multiple of ``threads``, so every upload thread gets the same work. Each item
    goes to the file its middle byte falls in."""
    total = sum(_padded(n) for *_, n in items)
    count = max(1, -(-total // file_size))
    if count > 1:
        count = -(-count // threads) * threads
    files: list[list] = [[] for _ in range(count)]
    pos = 0
    for entry in items:
        n = _padded(entry[2])
        files[min(count - 1, (pos + n // 2) * count // max(total, 1))].append(entry)
        pos += n
    return files


def upload_threads(storage: Storage) -> int:
    """How many files one rank writes at once."""
    return storage.concurrency if not storage.is_local else max(1, storage.concurrency // 2)


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "checkpointing.dcp_io": {"ItemLocation"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any global outside DCP's metadata classes, torch's
    dtypes and a few plain containers is refused before it is looked up."""

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def load_metadata(blob: bytes, where: str) -> Metadata:
    """DCP metadata from ``blob`` through the restricted unpickler; CorruptCheckpointError otherwise."""
    try:
        md = _MetadataUnpickler(io.BytesIO(blob)).load()
    except Exception as e:  # UnpicklingError, EOFError, a refused global, a constructor's TypeError, ...
        raise CorruptCheckpointError(f"{where} is not valid DCP metadata ({str(e)[:120]})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) or not isinstance(
            md.storage_data, dict):
        raise CorruptCheckpointError(f"{where} is not valid DCP metadata (a {type(md).__name__})")
    return md


def _check_location(loc, files: dict[str, FileEntry], where: str) -> None:
    """An item's location is a byte range of a listed file, with a real dtype and a matching shape."""
    if not isinstance(loc, ItemLocation):
        raise CorruptCheckpointError(f"{where}: an item location is a {type(loc).__name__}, not an etrain one")
    entry = files.get(loc.path) if isinstance(loc.path, str) else None
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (loc.offset, loc.length))
    if entry is None or not ints or loc.offset + loc.length > entry.size:
        raise CorruptCheckpointError(f"{where}: an item lies outside the files the manifest lists "
                                     f"({str(loc.path)[:60]!r} at {loc.offset!r:.20}+{loc.length!r:.20})")
    if loc.dtype is None:
        return
    dtype = getattr(torch, loc.dtype, None) if isinstance(loc.dtype, str) else None
    shape_ok = isinstance(loc.shape, tuple) and all(isinstance(d, int) and d >= 0 for d in loc.shape)
    if not isinstance(dtype, torch.dtype) or not shape_ok or \
            math.prod(loc.shape) * dtype.itemsize != loc.length:
        raise CorruptCheckpointError(f"{where}: an item has an invalid dtype or shape "
                                     f"({str(loc.dtype)[:20]!r}, {str(loc.shape)[:40]})")


class EtrainReader(StorageReader):
    """Reads a committed checkpoint, verifying each file before use."""

    def __init__(self, storage: Storage, step_rel: str, files: dict[str, FileEntry], *,
                 max_batch_bytes: int = 1024 * MiB):
        super().__init__()
        self.storage = storage
        self.step_rel = step_rel
        self.files = files
        self.max_batch_bytes = max_batch_bytes
        self.storage_data: dict[MetadataIndex, ItemLocation] = {}
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}

    def _fetch(self, paths: list[str]) -> dict[str, bytes]:
        for p in paths:
            if p not in self.files:
                raise CorruptCheckpointError(f"{self.step_rel}/{p} is not listed in the manifest")
        try:
            blobs = self.storage.get_many([f"{self.step_rel}/{p}" for p in paths])
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{e.args[0] if e.args else 'a file'} is missing") from None
        out = {}
        for p in paths:
            data, want = blobs[f"{self.step_rel}/{p}"], self.files[p]
            if len(data) != want.size:
                raise CorruptCheckpointError(
                    f"{self.step_rel}/{p} has {len(data)} bytes, the manifest says {want.size} (truncated?)")
            got = checksum(data)
            if got != want.crc32c:
                raise CorruptCheckpointError(
                    f"{self.step_rel}/{p} fails its checksum (crc32c {got}, manifest {want.crc32c})")
            out[p] = data
        return out

    def read_metadata(self) -> Metadata:
        """The checked DCP metadata (read once; DCP asks again for what a caller checked first)."""
        if self._metadata is None:
            self._metadata = self._read_metadata()
        return self._metadata

    def _read_metadata(self) -> Metadata:
        names = [p for p in self.files if METADATA_RE.match(p)]
        if len(names) != 1:
            raise CorruptCheckpointError(f"{self.step_rel}: the manifest lists {len(names)} DCP metadata files, "
                                         "not one")
        where = f"{self.step_rel}/{names[0]}"
        md = load_metadata(self._fetch(names)[names[0]], where)
        for loc in md.storage_data.values():
            _check_location(loc, self.files, where)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].path, []).append(req)
        batch: list[str] = []
        size = 0
        for path in sorted(per_file):
            batch.append(path)
            size += self.files[path].size if path in self.files else 0
            if size >= self.max_batch_bytes:
                self._apply(self._fetch(batch), per_file, planner)
                batch, size = [], 0
        if batch:
            self._apply(self._fetch(batch), per_file, planner)
        fut: TorchFuture = TorchFuture()
        fut.set_result(None)
        return fut

    def _apply(self, blobs: dict[str, bytes], per_file: dict[str, list], planner: LoadPlanner) -> None:
        for path, data in blobs.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffer: we only copy out of it
                whole = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
            for req in per_file[path]:
                loc = self.storage_data[req.storage_index]
                raw = whole[loc.offset : loc.offset + loc.length]
                if req.type == LoadItemType.BYTE_IO:
                    blob = raw.numpy().tobytes()
                    try:  # data, never code: only what the weights-only unpickler accepts
                        torch.load(io.BytesIO(blob), weights_only=True)
                    except Exception as e:
                        raise CorruptCheckpointError(f"{self.step_rel}/{path}: {req.storage_index.fqn} is not "
                                                     f"plain data ({str(e)[:120]})") from None
                    planner.load_bytes(req, io.BytesIO(blob))
                    continue
                dtype = getattr(torch, loc.dtype)
                src = raw.view(dtype).view(loc.shape) if loc.length else torch.empty(loc.shape, dtype=dtype)
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    src = src.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise CorruptCheckpointError(
                        f"{self.step_rel}/{path}: {req.storage_index.fqn} has shape {tuple(src.size())}, "
                        f"expected {tuple(target.size())}")
                target.copy_(src)
                planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor items are loaded with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
