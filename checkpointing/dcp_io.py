"""DCP ``StorageWriter`` / ``StorageReader`` over :class:`checkpointing.storage.Storage`.

The writer splits saving in two. ``write_data`` (inside ``dcp.save``, which
blocks training) only *stages*: it copies each tensor this rank writes into
host buffers laid out as the files that will be uploaded, and answers DCP at
once with where every item will live. :meth:`EtrainWriter.upload` (run later,
usually in a background thread, with no collectives) checksums and uploads
those buffers, several files and parts in flight. Tensors are stored as raw
bytes (no pickling), so a reader can slice any sub-block of a saved shard,
which is what resharding needs.

The reader fetches whole files, checks each against the manifest's size and
crc32c before any byte is used, and copies the requested sub-blocks into the
destination tensors (DTensor shards included). A mismatch raises
:class:`CorruptCheckpointError` naming the file; DCP turns an error on any
rank into an error on every rank, so all ranks fall back together.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from torch.futures import Future
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from .errors import CheckpointError
from .manifest import METADATA_NAME, FileEntry, checksum
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


@dataclass
class _StagedFile:
    path: str
    buffer: torch.Tensor  # uint8, host memory

    @property
    def view(self) -> memoryview:
        return memoryview(self.buffer.numpy())


class EtrainWriter(StorageWriter):
    """Stages in ``write_data``; uploads in :meth:`upload`. One instance per save."""

    def __init__(self, storage: Storage, step_rel: str, *, file_size: int = 256 * MiB):
        super().__init__()
        self.storage = storage
        self.step_rel = step_rel
        self.file_size = file_size
        self.is_coordinator = False
        self.staged: list[_StagedFile] = []
        self.metadata_blob: bytes | None = None
        self.staged_bytes = 0

    def reset(self, checkpoint_id=None) -> None:
        self.staged, self.metadata_blob, self.staged_bytes = [], None, 0

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Each rank's files get a distinct prefix, so no two ranks write the same object.
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
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
        files: list[list] = [[]]
        sizes = [0]
        for entry in items:
            if sizes[-1] and sizes[-1] + entry[2] > self.file_size:
                files.append([])
                sizes.append(0)
            files[-1].append(entry)
            sizes[-1] += -(-entry[2] // _ALIGN) * _ALIGN
        results = []
        pin = torch.cuda.is_available()
        copied_from_device = False
        for k, group in enumerate(files):
            if not group:
                continue
            name = f"{prefix}{k}.distcp"
            total = sum(-(-n // _ALIGN) * _ALIGN for _, _, n in group)
            buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
            off = 0
            for item, data, n in group:
                dst = buf[off : off + n]
                if isinstance(data, bytes):
                    if n:
                        dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                    loc = ItemLocation(name, off, n)
                else:
                    src = data if data.is_contiguous() else data.contiguous()
                    if n:
                        dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=src.device.type == "cuda")
                    copied_from_device |= src.device.type == "cuda"
                    loc = ItemLocation(name, off, n, _dtype_name(data.dtype), tuple(data.shape))
                results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=loc))
                off += -(-n // _ALIGN) * _ALIGN
            self.staged.append(_StagedFile(name, buf))
            self.staged_bytes += total
        if copied_from_device:
            torch.cuda.synchronize()
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md = {}
        for per_rank in results:
            for wr in per_rank:
                storage_md[wr.index] = wr.storage_data
        metadata.storage_data = storage_md
        self.metadata_blob = pickle.dumps(metadata)

    def upload(self) -> list[FileEntry]:
        """Checksum and upload this rank's staged files (and the metadata, on the coordinator)."""
        blobs: list[tuple[str, memoryview | bytes]] = [(f.path, f.view) for f in self.staged]
        if self.is_coordinator:
            if self.metadata_blob is None:
                raise CheckpointError("the DCP metadata was never produced; dcp.save did not finish")
            blobs.append((METADATA_NAME, self.metadata_blob))
        entries = [FileEntry(path, len(data), checksum(data)) for path, data in blobs]
        self.storage.put_many([(f"{self.step_rel}/{path}", data) for path, data in blobs])
        return entries

    def release(self) -> None:
        """Drop the staging buffers."""
        self.staged = []
        self.staged_bytes = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


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
        blob = self._fetch([METADATA_NAME])[METADATA_NAME]
        return pickle.loads(blob)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
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
        fut: Future = Future()
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
                    planner.load_bytes(req, io.BytesIO(raw.numpy().tobytes()))
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
