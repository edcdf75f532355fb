"""The writing half of etrain's DCP storage layer: ``StorageWriter`` over :class:`checkpointing.storage.base.Storage`.

    writer = EtrainWriter(storage, "run/checkpoints/step_000000100", token="5f1c2a9e", overlap=True)
    dcp.save(state_dict, storage_writer=writer)     # lays files out; uploads start at once
    entries = writer.upload()                       # waits for this rank's files (FileEntry each)

The writer splits saving in two. ``write_data`` (inside ``dcp.save``) lays
the items this rank writes out into files of ~32 MiB and answers DCP at once
with where every item will live. A file is a list of byte views: host tensors
are not copied (a sync save keeps training waiting until they are written; an
async save writes from its own snapshot, which nothing touches until the save
ends); only device or non-contiguous tensors are copied into reused host
buffers. :meth:`EtrainWriter.upload` (no collectives) waits for the files,
several in flight, each checksummed as it is written. Items are stored the
way stock DCP stores them (:mod:`checkpointing.dcp.format`): a tensor is the
``torch.save`` archive of that tensor, whose bytes etrain writes straight from
the tensor's memory between an envelope made once per dtype and shape, so
stock DCP readers load the checkpoint, and etrain's reader slices any
sub-block of a saved shard in place, which is what resharding needs.

Every file of a save attempt is named by that attempt (:func:`file_name`:
the epoch, the rank, the file's number and a random token per rank and
attempt) and created exclusively, so no save ever writes into a file of
another save, committed or not. The DCP metadata is written by the manager at
commit (``.metadata``, the name stock DCP readers look for). The reading half
is :mod:`checkpointing.dcp.reader`.
"""

from __future__ import annotations

import dataclasses
import io
import re
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future as TorchFuture

from .format import CorruptCheckpointError, StorageInfo, envelope  # noqa: F401  (CorruptCheckpointError: re-exported)
from ..errors import CheckpointError
from ..manifest import FILE_SIZE, FileEntry
from ..storage.base import Storage

_ALIGN = 64


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved item lived in checkpoint formats 1 and 2 (raw tensor bytes): a byte range of one
    file, and how to read it back. Kept so that their DCP metadata still unpickles; never written."""

    path: str
    offset: int
    length: int
    dtype: str | None = None  # tensors: "float32", ...
    shape: tuple[int, ...] | None = None


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
    slots: list = dataclasses.field(default_factory=list)  # (index in parts or None, item, data) per item


def host_bytes(t: torch.Tensor) -> memoryview | None:
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
                obj = lookup(state_dict, path)
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

        obj = lookup(self.state_dict, self.paths[item.index.fqn])
        if item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(obj, buf)
            return buf
        return obj._local_tensor if isinstance(obj, DTensor) else obj


def lookup(state_dict, path):
    """The item at ``path`` (a sequence of keys) in a nested state dict."""
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
        head = _NAME_RE.match(loc.relative_path)
        return r.index, r.size_in_bytes, head["head"] if head else loc.relative_path, loc.offset, loc.length
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


def retoken_metadata(metadata: Metadata, tokens: dict[str, str]) -> Metadata:
    """``metadata`` with every item's file renamed from an old attempt's token to the new one's."""
    storage = {idx: dataclasses.replace(loc, relative_path=_retoken(loc.relative_path, tokens))
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
        # Resolve and size every item, then lay the items out in files of ~file_size. A tensor
        # goes between the envelope that makes it the torch.save archive stock DCP reads.
        items = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                items.append((item, raw, len(raw)))
            else:
                t = data.detach()
                items.append((item, t, envelope(t.dtype, tuple(t.shape)).size(t.numel() * t.element_size())))
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
            for item, _, n in group:
                results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=StorageInfo(name, off, n)))
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
        slots = []
        for item, data, n in group:
            if isinstance(data, bytes):
                slots.append((len(views), item, data))
                views.append(memoryview(data))
            else:
                env = envelope(data.dtype, tuple(data.shape))
                views.append(memoryview(env.prefix))
                slots.append((len(views) if data.numel() else None, item, data))
                if data.numel():
                    view = host_bytes(data)
                    if view is None:
                        copies.append((len(views), data))
                    keep.append(data)
                    views.append(view)
                views.append(memoryview(env.suffix))
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
        return _StagedFile(name, views, sum(len(v) for v in views), keep, slots)

    def _submit(self, fn, *args) -> Future:
        fut = self._executor.submit(fn, *args)
        self._futures.append(fut)
        return fut

    def _upload_file(self, f: _StagedFile) -> FileEntry:
        self.written.append(f.path)
        crc = self.storage.put_parts(f"{self.step_rel}/{f.path}", f.parts, exclusive=True)
        return FileEntry(f.path, f.size, crc)

    def remove_files(self, others: Iterable[str] = ()) -> None:
        """Delete the files this writer wrote (after :meth:`abort`), and ``others`` of the same attempt
        in its step directory (the coordinator's view of the other ranks' files and the metadata): a
        failed save leaves nothing. Their names are this attempt's own, so nothing of another save is
        touched."""
        for name in [*self.written, *others]:
            try:
                self.storage.delete_tree(f"{self.step_rel}/{name}")
            except Exception:  # retention removes what is left of an uncommitted step
                pass
        self.written = []

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Runs on the coordinator while every rank waits for the result: only
        # collect here; the manager pickles and writes the metadata at commit.
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
