"""How one item sits in a shard file: stock DCP's format, written without copying tensors.

    env = envelope(torch.float32, (4096, 1024))      # cached per (dtype, shape)
    parts = [env.prefix, tensor_bytes, env.suffix]   # one item: a torch.save archive of the tensor
    loc = _StorageInfo("__0_0.5f1c2a9e.distcp", offset, env.size(nbytes))
    tensor = item_tensor(blob, loc, dtype, shape, where)   # reading it back (any torch.save bytes)

Stock DCP (``FileSystemReader``, ``FsspecReader``, ``dcp_to_torch_save``)
records where each item lives as ``_StorageInfo(relative_path, offset,
length)`` and reads a tensor item as the ``torch.save`` archive of that tensor
(``torch.load(..., weights_only=True)`` of the byte range). etrain writes the
same archive, but never serializes the tensor: the archive's bytes before the
tensor's storage (the pickle and the zip records, 64-byte aligned) and after
it (the zip directory) depend only on the dtype and the shape, so they are
made once per (dtype, shape), by ``torch.save`` itself under
``torch.serialization.skip_data``, and the tensor's own bytes are written
between them straight from its memory. Like ``torch.save`` with
``set_crc32_options(False)``, the zip CRC of the tensor record is zero;
integrity is the manifest's crc32c of every file.

Reading: an item whose archive starts with the bytes etrain writes for its
dtype and shape is sliced in place (no copy, no unpickling); any other
archive (a stock DCP writer's, a future torch's) is read with
``torch.load(..., weights_only=True)`` and must hold a tensor of the dtype and
shape the DCP metadata records.
"""

from __future__ import annotations

import functools
import io
import math
import struct
import warnings
import zipfile
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointError

StorageInfo = _StorageInfo  # stock DCP's item location, the class etrain writes (format 3)


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated or fails its checksum."""


@dataclass(frozen=True)
class Envelope:
    """The ``torch.save`` archive of a contiguous tensor of one dtype and shape, less its bytes."""

    prefix: bytes  # up to the tensor's storage: a multiple of 64 bytes
    suffix: bytes  # after it: the remaining records and the zip directory

    def size(self, nbytes: int) -> int:
        return len(self.prefix) + nbytes + len(self.suffix)


class _Sink(io.RawIOBase):
    """Takes what ``torch.save`` writes; under ``skip_data`` the storage's bytes are one forward seek."""

    def __init__(self) -> None:
        super().__init__()
        self.before: list[bytes] = []
        self.after: list[bytes] = []
        self.pos = 0
        self.gap: tuple[int, int] | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, b) -> int:
        data = bytes(b)
        (self.before if self.gap is None else self.after).append(data)
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset if whence == 0 else self.pos + offset if whence == 1 else -1
        if target == self.pos:
            return target
        if target < self.pos or self.gap is not None:
            raise io.UnsupportedOperation("torch.save moved back while writing an envelope")
        self.gap = (self.pos, target)
        self.pos = target
        return target


def nbytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


@functools.lru_cache(maxsize=8192)
def envelope(dtype: torch.dtype, shape: tuple[int, ...]) -> Envelope:
    """The archive ``torch.save`` writes for a contiguous ``dtype`` tensor of ``shape``, split around
    the tensor's bytes (made without touching any tensor memory: ``torch.empty`` is never read)."""
    nbytes = nbytes_of(dtype, shape)
    sink = _Sink()
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=dtype), sink)
    head = b"".join(sink.before)
    if sink.gap is not None:
        prefix, suffix = head, b"".join(sink.after)
        if sink.gap[1] - sink.gap[0] != nbytes or _data_start(prefix) != len(prefix):
            raise CheckpointError(f"torch.save laid out a {dtype} tensor of shape {shape} unexpectedly")
    else:  # nothing skipped (no bytes to skip): the archive is whole
        start = _record_start(head)
        prefix, suffix = head[:start], head[start + nbytes:]
    return Envelope(prefix, suffix)


def _data_start(prefix: bytes) -> int:
    """Where the bytes of the last zip record begun in ``prefix`` start, if that record is a tensor
    storage (``<archive>/data/0``); -1 otherwise."""
    h = prefix.rfind(b"PK\x03\x04")
    if h < 0 or h + 30 > len(prefix):
        return -1
    name_len, extra_len = struct.unpack_from("<HH", prefix, h + 26)
    if not prefix[h + 30 : h + 30 + name_len].endswith(b"/data/0"):
        return -1
    return h + 30 + name_len + extra_len


def _record_start(archive: bytes) -> int:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        (info,) = [i for i in z.infolist() if i.filename.endswith("/data/0")]
    name_len, extra_len = struct.unpack_from("<HH", archive, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def chunk_of(md: Metadata, index: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """The dtype and shape of the tensor chunk ``index`` names; None for a non-tensor item.
    CorruptCheckpointError when the metadata does not describe it."""
    entry = md.state_dict_metadata.get(index.fqn) if isinstance(index, MetadataIndex) else None
    if entry is None:
        raise CorruptCheckpointError(f"an item ({str(getattr(index, 'fqn', index))[:80]!r}) is not in the "
                                     "state dict metadata")
    if not isinstance(entry, TensorStorageMetadata):
        return None
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{index.fqn[:80]!r} has no valid dtype")
    for chunk in entry.chunks:
        if tuple(chunk.offsets) == tuple(index.offset or ()):
            shape = tuple(chunk.sizes)
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise CorruptCheckpointError(f"{index.fqn[:80]!r} has an invalid chunk shape")
            return dtype, shape
    raise CorruptCheckpointError(f"{index.fqn[:80]!r} at {tuple(index.offset or ())} is not one of its chunks")


def item_tensor(data: bytes, loc: _StorageInfo, dtype: torch.dtype, shape: tuple[int, ...],
                where: str) -> torch.Tensor:
    """The tensor stored at ``loc`` in ``data`` (the whole file), of ``dtype`` and ``shape``: a view of
    ``data`` when it is in the envelope etrain writes, else what ``torch.load(weights_only=True)``
    reads; CorruptCheckpointError when it is neither."""
    env, n = envelope(dtype, shape), nbytes_of(dtype, shape)
    start, p = loc.offset, len(env.prefix)
    if loc.length >= p + n and data[start : start + p] == env.prefix:
        if not n:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: callers only copy out of it
            return torch.frombuffer(data, dtype=torch.uint8, offset=start + p, count=n).view(dtype).view(shape)
    try:
        t = torch.load(io.BytesIO(data[start : start + loc.length]), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptCheckpointError(f"{where} is not a tensor saved by torch.save ({str(e)[:120]})") from None
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CorruptCheckpointError(f"{where} holds {got}, the metadata says {dtype} {shape}")
    return t
