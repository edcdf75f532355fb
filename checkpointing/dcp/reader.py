"""The reading half of etrain's DCP storage layer: ``StorageReader`` over :class:`checkpointing.storage.base.Storage`.

    reader = EtrainReader(storage, "run/checkpoints/step_000000100", manifest.file_table())
    reader.read_metadata()                          # checked before DCP sees it (CorruptCheckpointError)
    dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner())

The reader fetches whole files, checks each against the manifest's size and
crc32c before any byte is used, and copies the requested sub-blocks into the
destination tensors (DTensor shards included). Items are located the way
stock DCP locates them (``_StorageInfo``, format 3, see
:mod:`checkpointing.dcp.format`); the raw items of formats 1 and 2
(``ItemLocation``) are read as well. A mismatch raises
:class:`CorruptCheckpointError` naming the file; DCP turns an error on any
rank into an error on every rank, so all ranks fall back together.

Stored bytes are data, never code: the DCP metadata (a pickle, as stock DCP
writes it) is read with a restricted unpickler that knows only DCP's metadata
classes (:func:`load_metadata`), every item location in it is checked against
the manifest, and non-tensor items are loaded with ``torch.load(...,
weights_only=True)``. Anything else makes the checkpoint corrupt. The metadata
file is at most :data:`MAX_METADATA_BYTES` and holds one pickle and nothing
after it. ``etrain ckpt verify`` and ``etrain ckpt adopt`` apply the same
checks (:func:`verify_files`, :func:`check_items`): what they accept, a load
accepts.
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

from .format import CorruptCheckpointError, StorageInfo, chunk_of, item_tensor
from .writer import ItemLocation
from ..errors import CheckpointError, StorageError
from ..manifest import METADATA_RE, SHARD_RE, FileEntry, checksum
from ..storage.base import MiB, Storage

# DCP metadata is a few MiB for the largest models (about 200 bytes a chunk); never read a bigger one.
MAX_METADATA_BYTES = 256 * MiB

# Exactly what DCP metadata pickles name: stock DCP's metadata classes and item location
# (``_StorageInfo``), etrain's item location of formats 1 and 2, torch.Size, the layout
# (strided) and, from stock writers, the checkpoint directory as a PosixPath. Dtypes too.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # formats 1 and 2 pickled it under the module it was defined in then; the class lives in .writer now
    "checkpointing.dcp_io": {"ItemLocation"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any global outside DCP's metadata classes, torch's
    dtypes and a few plain containers is refused before it is looked up."""

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return ItemLocation if module == "checkpointing.dcp_io" else super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def load_metadata(blob: bytes, where: str) -> Metadata:
    """DCP metadata from ``blob`` (one pickle, nothing after it, at most :data:`MAX_METADATA_BYTES`)
    through the restricted unpickler; CorruptCheckpointError otherwise."""
    check_metadata_size(len(blob), where)
    stream = io.BytesIO(blob)
    try:
        md = _MetadataUnpickler(stream).load()
    except Exception as e:  # UnpicklingError, EOFError, a refused global, a constructor's TypeError, ...
        raise CorruptCheckpointError(f"{where} is not valid DCP metadata ({str(e)[:120]})") from None
    if stream.tell() != len(blob):
        raise CorruptCheckpointError(f"{where} is not valid DCP metadata ({len(blob) - stream.tell()} bytes after "
                                     "its end)")
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) or not isinstance(
            md.storage_data, dict):
        raise CorruptCheckpointError(f"{where} is not valid DCP metadata (a {type(md).__name__})")
    return md


def check_metadata_size(size: int, where: str) -> None:
    """CorruptCheckpointError when a DCP metadata file of ``size`` bytes is larger than any is
    (:data:`MAX_METADATA_BYTES`): checked before it is read."""
    if size > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{where} is {size} bytes; DCP metadata is at most {MAX_METADATA_BYTES} "
                                     f"({MAX_METADATA_BYTES // MiB} MiB), so this is not one")


def check_locations(md: Metadata, files: dict[str, FileEntry], where: str) -> None:
    """Every item of ``md`` lies in a listed file (:func:`check_location`); every chunk the metadata
    describes has an item."""
    for index, loc in md.storage_data.items():
        check_location(md, index, loc, files, where)
    for fqn, entry in md.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        wanted = [MetadataIndex(fqn)] if chunks is None else [MetadataIndex(fqn, c.offsets) for c in chunks]
        for index in wanted:
            if index not in md.storage_data:
                raise CorruptCheckpointError(f"{where}: {str(fqn)[:80]!r} has no stored item "
                                             f"{'' if index.offset is None else tuple(index.offset)}")


def check_location(md: Metadata, index, loc, files: dict[str, FileEntry], where: str) -> None:
    """An item's location is a byte range of a listed shard file, long enough for what the metadata
    says it holds; a format-2 location also has a real dtype and a shape that matches its length."""
    path = item_path(loc)
    if path is None:
        raise CorruptCheckpointError(f"{where}: an item location is a {type(loc).__name__}, not a DCP one")
    entry = files.get(path) if isinstance(path, str) and SHARD_RE.fullmatch(path) else None
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (loc.offset, loc.length))
    if entry is None or not ints or loc.offset + loc.length > entry.size:
        raise CorruptCheckpointError(f"{where}: an item lies outside the files of the checkpoint "
                                     f"({str(path)[:60]!r} at {loc.offset!r:.20}+{loc.length!r:.20})")
    if isinstance(loc, StorageInfo):
        if loc.transform_descriptors:
            raise CorruptCheckpointError(f"{where}: {str(getattr(index, 'fqn', '?'))[:80]!r} is stored through "
                                         f"stream transforms {str(loc.transform_descriptors)[:60]}, which etrain "
                                         "does not read (save without DCP extensions)")
        chunk = chunk_of(md, index)
        if chunk is not None and loc.length < math.prod(chunk[1]) * chunk[0].itemsize:
            raise CorruptCheckpointError(f"{where}: {index.fqn[:80]!r} is stored in {loc.length} bytes, too few "
                                         f"for {chunk[0]} {chunk[1]}")
        return
    if loc.dtype is None:
        return
    dtype = getattr(torch, loc.dtype, None) if isinstance(loc.dtype, str) else None
    shape_ok = isinstance(loc.shape, tuple) and all(isinstance(d, int) and d >= 0 for d in loc.shape)
    if not isinstance(dtype, torch.dtype) or not shape_ok or \
            math.prod(loc.shape) * dtype.itemsize != loc.length:
        raise CorruptCheckpointError(f"{where}: an item has an invalid dtype or shape "
                                     f"({str(loc.dtype)[:20]!r}, {str(loc.shape)[:40]})")


def item_path(loc) -> str | None:
    """The file an item location names (stock DCP's or a format-2 one); None for anything else."""
    if isinstance(loc, StorageInfo):
        return loc.relative_path
    if isinstance(loc, ItemLocation):
        return loc.path
    return None


class EtrainReader(StorageReader):
    """Reads a committed checkpoint, verifying each file before use."""

    def __init__(self, storage: Storage, step_rel: str, files: dict[str, FileEntry], *,
                 max_batch_bytes: int = 1024 * MiB):
        super().__init__()
        self.storage = storage
        self.step_rel = step_rel
        self.files = files
        self.max_batch_bytes = max_batch_bytes
        self.storage_data: dict[MetadataIndex, StorageInfo | ItemLocation] = {}
        self._metadata: Metadata | None = None
        self._chunks: dict = {}  # MetadataIndex -> (dtype, shape) of each tensor item

    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}
        self._chunks = {}

    def fetch(self, paths: list[str]) -> dict[str, bytes]:
        """The files ``paths`` of the step (names in its manifest), each checked against the manifest's size
        and crc32c; CorruptCheckpointError names the first that is unlisted, missing, cut short or changed."""
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
        check_metadata_size(self.files[names[0]].size, where)
        md = load_metadata(self.fetch(names)[names[0]], where)
        check_locations(md, self.files, where)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data
        self._metadata = self._metadata or metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(item_path(self.storage_data[req.storage_index]), []).append(req)
        batch: list[str] = []
        size = 0
        for path in sorted(per_file):
            batch.append(path)
            size += self.files[path].size if path in self.files else 0
            if size >= self.max_batch_bytes:
                self._apply(self.fetch(batch), per_file, planner)
                batch, size = [], 0
        if batch:
            self._apply(self.fetch(batch), per_file, planner)
        fut: TorchFuture = TorchFuture()
        fut.set_result(None)
        return fut

    def _apply(self, blobs: dict[str, bytes], per_file: dict[str, list], planner: LoadPlanner) -> None:
        for path, data in blobs.items():
            for req in per_file[path]:
                loc = self.storage_data[req.storage_index]
                where = f"{self.step_rel}/{path}: {req.storage_index.fqn}"
                if req.type == LoadItemType.BYTE_IO:
                    blob = data[loc.offset : loc.offset + loc.length]
                    try:  # data, never code: only what the weights-only unpickler accepts
                        torch.load(io.BytesIO(blob), weights_only=True)
                    except Exception as e:
                        raise CorruptCheckpointError(f"{where} is not plain data ({str(e)[:120]})") from None
                    planner.load_bytes(req, io.BytesIO(blob))
                    continue
                src = self._tensor(data, loc, req.storage_index, where)
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    src = src.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise CorruptCheckpointError(
                        f"{where} has shape {tuple(src.size())}, expected {tuple(target.size())}")
                target.copy_(src)
                planner.commit_tensor(req, target)

    def _tensor(self, data: bytes, loc, index: MetadataIndex, where: str) -> torch.Tensor:
        """The saved chunk ``loc`` holds, as a tensor (a view of ``data`` where the format allows)."""
        if isinstance(loc, ItemLocation):  # formats 1 and 2: the raw bytes
            dtype = getattr(torch, loc.dtype)
            if not loc.length:
                return torch.empty(loc.shape, dtype=dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffer: we only copy out of it
                raw = torch.frombuffer(data, dtype=torch.uint8, offset=loc.offset, count=loc.length)
            return raw.view(dtype).view(loc.shape)
        if index not in self._chunks:
            self._chunks[index] = chunk_of(self._metadata, index)
        dtype, shape = self._chunks[index]
        return item_tensor(data, loc, dtype, shape, where)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def check_items(md: Metadata, name: str, data: bytes, where: str) -> None:
    """Every item of file ``name`` (its bytes ``data``) reads back as a load reads it: a tensor of its
    recorded dtype and shape (stock DCP's envelope, or the weights-only unpickler), any other item
    plain data (``torch.load(weights_only=True)``). CorruptCheckpointError naming the item otherwise.
    Locations are checked first (:func:`check_locations`)."""
    for index, loc in md.storage_data.items():
        if item_path(loc) != name:
            continue
        what = f"{where}: {str(index.fqn)[:80]!r}"
        chunk = chunk_of(md, index)
        if chunk is not None:
            if isinstance(loc, StorageInfo):  # formats 1 and 2: raw bytes, checked by check_location
                item_tensor(data, loc, *chunk, what)
            continue
        try:
            torch.load(io.BytesIO(data[loc.offset : loc.offset + loc.length]), weights_only=True)
        except Exception as e:  # the weights-only unpickler refused it
            raise CorruptCheckpointError(f"{what} is not plain data that etrain may load ({str(e)[:160]})") from None


def verify_files(reader: EtrainReader) -> list[str]:
    """Problems a load of ``reader``'s checkpoint would meet, each naming its file: the metadata (size
    bound, checksum, restricted unpickler, locations), then each shard file read once (missing,
    size, crc32c) and every item in it (:func:`check_items`). Empty when a load accepts it all."""
    problems = []
    try:
        md = reader.read_metadata()
    except CorruptCheckpointError as e:
        md = None
        problems.append(str(e))
    for name in sorted(p for p in reader.files if not METADATA_RE.match(p)):
        try:
            data = reader.fetch([name])[name]
            if md is not None:
                check_items(md, name, data, f"{reader.step_rel}/{name}")
        except CorruptCheckpointError as e:
            problems.append(str(e))
    return problems


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor items are loaded with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_failure(e: BaseException) -> BaseException:
    """The underlying error of a (possibly DCP-wrapped) load failure; a checkpoint problem first."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(e, CheckpointException):
        return e
    inner = []
    for _rank, wrapped in sorted(e.failures.items()):
        # DCP wraps each rank's failure as (exception, stack summary).
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        inner.append(exc if isinstance(exc, BaseException) else RuntimeError(str(exc)))
    for exc in inner:
        if isinstance(exc, CheckpointError) and not isinstance(exc, StorageError):
            return exc
    return inner[0] if inner else e
