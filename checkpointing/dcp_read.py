"""The reading half of etrain's DCP storage layer: ``StorageReader`` over :class:`checkpointing.storage.Storage`.

    reader = EtrainReader(storage, "run/checkpoints/step_000000100", manifest.file_table())
    reader.read_metadata()                          # checked before DCP sees it (CorruptCheckpointError)
    dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner())

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

import io
import math
import pickle
import warnings

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from .dcp_io import CorruptCheckpointError, ItemLocation
from .manifest import METADATA_RE, FileEntry, checksum
from .storage import MiB, Storage

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
