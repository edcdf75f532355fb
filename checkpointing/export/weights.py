"""Read a committed checkpoint's model weights one full tensor at a time, and write them as a
consolidated ``safetensors`` file (sharded with an index above a size) or a ``torch.save`` file.

    src = ModelSource.open("file:///ckpt/runs/tiny/checkpoints/step_000000100")   # a run URL: its newest
    specs = src.specs()                          # {fqn: (dtype, shape)} of the model, from the DCP metadata
    t = src.read("layers.0.attention.wq.weight") # the full tensor, assembled from its chunks
    write_safetensors("/out/model.safetensors", plan, read)   # streamed: one tensor in memory at a time

Whatever layout saved the checkpoint (ZeRO-3, TP, PP, HSDP, any world size), each parameter is
stored as a global tensor of its full shape cut into chunks, located by the DCP metadata; a tensor
is assembled from its chunks and the files holding them are fetched, checked against the
manifest's size and crc32c, and kept in a small cache bounded in bytes. The model's weights are
the checkpoint's ``model.<fqn>`` items; optimizer state is not read.

Writers take a list of ``(name, dtype, shape)`` and a function returning each tensor, so the
layout of the output is known before any tensor is read and nothing more than one tensor (plus
the file cache) is held in memory. This module knows nothing of models: the trainer's own
export (``trainer.export.convert``) renames and converts tensors on the way.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..dcp.format import chunk_of, item_tensor
from ..dcp.reader import EtrainReader, item_path
from ..errors import CheckpointError, ConfigError
from ..manager import CheckpointManager
from ..manifest import Manifest, checksum
from ..names import check_url, redact
from ..storage.base import MiB, Storage
from .manifest import (  # noqa: F401 (where the export's manifest is read back; re-exported)
    EXPORT_FORMAT,
    EXPORT_MANIFEST,
    EXPORT_VERSION,
    export_complete,
    export_rel,
    export_state,
    list_exports,
    read_export_manifest,
)

MODEL_PREFIX = "model."
SHARD_BYTES = 5 * 1024**3  # hf: one model.safetensors up to this size, else shards and an index
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
Spec = tuple[str, torch.dtype, tuple[int, ...]]


class ModelSource:
    """The model weights of one committed checkpoint step."""

    def __init__(self, mgr: CheckpointManager, step: int, manifest: Manifest, reader: EtrainReader, *,
                 cache_bytes: int = 512 * MiB, read_threads: int = 4):
        self.mgr, self.step, self.manifest, self.reader = mgr, step, manifest, reader
        self.md = reader.read_metadata()
        self.cache_bytes = cache_bytes
        self.read_threads = read_threads
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._order: list[str] = []  # files in the order planned reads need them (plan_reads)
        self._next = 0
        self._ahead: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def open(cls, url: str, **kw) -> ModelSource:
        """The step a URL names (``<root>/<run>[/checkpoints[/step_N]]``; the newest committed without a step).
        ConfigError (exit 2) when it is not committed or its manifest or metadata are corrupt."""
        from ..layout import parse_url

        check_url(url, "URL")
        try:
            root, run_id, step = parse_url(url)
            mgr = CheckpointManager(root, run_id)
            if step is None:
                step = mgr.latest_committed()
                if step is None:
                    raise CheckpointError(f"no committed checkpoint under {mgr.storage.join(mgr.prefix)}")
            manifest = mgr.read_manifest(step)
            reader = EtrainReader(mgr.storage, mgr.step_rel(step), manifest.file_table())
            return cls(mgr, step, manifest, reader, **kw)
        except CheckpointError as e:
            raise ConfigError(f"{redact(url)}: {e}") from None

    @property
    def url(self) -> str:
        return redact(self.mgr.url_of(self.step))

    def specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{fqn: (dtype, full shape)} of every model tensor, in the metadata's order."""
        out = {}
        for key, entry in self.md.state_dict_metadata.items():
            if key.startswith(MODEL_PREFIX) and hasattr(entry, "chunks"):
                out[key[len(MODEL_PREFIX):]] = (entry.properties.dtype, tuple(entry.size))
        if not out:
            raise ConfigError(f"{self.url} holds no model tensors (no 'model.*' items)")
        return out

    def plan_reads(self, fqns: list[str]) -> None:
        """Tensors will be read in this order: fetch (and check) the files ahead, on a thread, while the
        caller writes, on ``read_threads`` threads, up to half the cache's bytes in flight."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        seen: set[str] = set()
        self._order, self._next = [], 0
        for fqn in fqns:
            key = MODEL_PREFIX + fqn
            for chunk in self.md.state_dict_metadata[key].chunks:
                path = item_path(self.md.storage_data[MetadataIndex(key, chunk.offsets)])
                if path not in seen:
                    seen.add(path)
                    self._order.append(path)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="etrain-export-read")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._ahead.clear()
        self._cache.clear()

    def _pump(self) -> None:
        if self._pool is None:
            return
        inflight = sum(self.reader.files[p].size for p in self._ahead)
        while self._next < len(self._order) and inflight < self.cache_bytes // 2:
            path = self._order[self._next]
            self._next += 1
            if path in self._cache or path in self._ahead:
                continue
            self._ahead[path] = self._pool.submit(self._fetch, path)
            inflight += self.reader.files[path].size

    def _fetch(self, path: str):
        """One file's bytes, checked against the manifest's size and crc32c before use. On local
        storage the file is mapped read-only rather than copied (committed files never change)."""
        want = self.reader.files.get(path)
        local = self.mgr.storage.local_path(f"{self.reader.step_rel}/{path}") if want and want.size else None
        if local is None:
            return self.reader.fetch([path])[path]
        try:
            with open(local, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                 prot=mmap.PROT_READ)
        except (FileNotFoundError, ValueError):  # ValueError: an empty file cannot be mapped
            return self.reader.fetch([path])[path]  # says what is wrong with it
        if len(data) != want.size or checksum(data) != want.crc32c:
            return self.reader.fetch([path])[path]
        return data

    def _file(self, path: str) -> bytes:
        data = self._cache.pop(path, None)
        if data is None:
            fut = self._ahead.pop(path, None)
            data = fut.result() if fut is not None else self._fetch(path)
            while self._cache and sum(map(len, self._cache.values())) + len(data) > self.cache_bytes:
                self._cache.popitem(last=False)
        self._cache[path] = data
        self._pump()
        return data

    def read(self, fqn: str) -> torch.Tensor:
        """The full tensor ``fqn`` (a model fqn, without the ``model.`` prefix), assembled from its chunks
        (a read-only view of the file when one chunk holds it all)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        key = MODEL_PREFIX + fqn
        entry = self.md.state_dict_metadata[key]
        if len(entry.chunks) == 1 and tuple(entry.chunks[0].sizes) == tuple(entry.size):
            # stored whole: a read-only view of the file's bytes (clone it to write to it)
            index = MetadataIndex(key, entry.chunks[0].offsets)
            loc = self.md.storage_data[index]
            dtype, shape = chunk_of(self.md, index)
            path = item_path(loc)
            return item_tensor(self._file(path), loc, dtype, shape, f"{self.reader.step_rel}/{path}: {key}")
        out = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for chunk in entry.chunks:
            index = MetadataIndex(key, chunk.offsets)
            loc = self.md.storage_data[index]
            dtype, shape = chunk_of(self.md, index)
            path = item_path(loc)
            src = item_tensor(self._file(path), loc, dtype, shape, f"{self.reader.step_rel}/{path}: {key}")
            dst = out
            for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                dst = dst.narrow(dim, off, size)
            dst.copy_(src)
        return out


# --- writers ----------------------------------------------------------------------------------


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_safetensors(path: str, specs: list[Spec], get: Callable[[str], torch.Tensor],
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``specs`` as one safetensors file, each tensor ``get(name)`` streamed in order; its size."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in _ST_DTYPES:
            raise ConfigError(f"{name}: dtype {dtype} cannot be stored in safetensors")
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape in specs:
            t = get(name)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise CheckpointError(f"{name}: got {t.dtype} {tuple(t.shape)}, planned {dtype} {shape}")
            f.write(_raw(t))
    return 8 + len(blob) + offset


def write_hf_weights(out_dir: str, specs: list[Spec], get: Callable[[str], torch.Tensor], *,
                     shard_bytes: int = SHARD_BYTES, on_written: Callable[[str], None] | None = None) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards of at most ``shard_bytes``
    (a larger tensor alone) and ``model.safetensors.index.json`` as ``transformers`` writes them.
    ``on_written(name)`` is called as each file is complete (an :class:`Output` uploads it then)."""
    done = on_written or (lambda name: None)
    groups: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        n = _nbytes(spec[1], spec[2])
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += n
    if len(groups) == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), specs, get)
        done("model.safetensors")
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(os.path.join(out_dir, name), group, get)
        done(name)
        names.append(name)
        weight_map.update({spec[0]: name for spec in group})
    total = sum(_nbytes(s[1], s[2]) for s in specs)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    done("model.safetensors.index.json")
    return names + ["model.safetensors.index.json"]


def write_torch(path: str, specs: list[Spec], get: Callable[[str], torch.Tensor]) -> None:
    """A ``torch.save`` file of ``{name: tensor}`` (``torch.load(path, weights_only=True)`` reads it),
    written without holding the tensors together: the archive is laid out by ``torch.save`` under
    ``skip_data`` and each tensor's bytes are then written into its record."""
    skeleton = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in specs}
    with torch.serialization.skip_data():
        torch.save(skeleton, path)
    del skeleton
    with zipfile.ZipFile(path) as z:
        records = {i.filename.rsplit("/data/", 1)[1]: i for i in z.infolist() if "/data/" in i.filename}
    with open(path, "r+b") as f:
        for key, (name, dtype, shape) in enumerate(specs):
            n = _nbytes(dtype, shape)
            if not n:
                continue
            info = records.get(str(key))
            if info is None or info.file_size != n:
                raise CheckpointError(f"torch.save laid out {name} unexpectedly (record {key})")
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            t = get(name)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise CheckpointError(f"{name}: got {t.dtype} {tuple(t.shape)}, planned {dtype} {shape}")
            f.seek(info.header_offset + 30 + name_len + extra_len)
            f.write(_raw(t))


def prepare_out(out: str, *, directory: bool, overwrite: bool) -> None:
    """Refuse an output that exists and is not empty (ConfigError) unless ``overwrite``; make the
    directory it goes in (ConfigError naming OUT when it cannot be made or written: the export is
    written beside ``out`` first, then renamed into place)."""
    try:
        if os.path.exists(out):
            busy = os.path.isfile(out) or bool(os.listdir(out))
            if busy and not overwrite:
                raise ConfigError(f"{out} exists and is not empty; choose another output or pass --overwrite")
            if directory and os.path.isfile(out):
                raise ConfigError(f"{out} is a file; the export is a directory")
            if not directory and os.path.isdir(out):
                raise ConfigError(f"{out} is a directory; the {out.rsplit('.', 1)[-1]} export is one file")
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", parent)
    except OSError as e:
        raise ConfigError(f"OUT {out}: cannot create or write {e.filename or out} ({e.strerror or e}); "
                          "choose a directory you can write to, or create it first") from None


def _listed(directory: str) -> set[str]:
    """The files an export's manifest in ``directory`` lists (plain names only; none when it is unreadable)."""
    try:
        with open(os.path.join(directory, EXPORT_MANIFEST), "rb") as f:
            doc = json.loads(f.read(16 * MiB))
        names = {e.get("path") for e in doc["files"] if isinstance(e, dict)}
        return {n for n in names if isinstance(n, str) and n and "/" not in n and n not in (".", "..", EXPORT_MANIFEST)}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


# --- where an export goes, and its commit -----------------------------------------------------

class Output:
    """Where an export's files go: ``out``, a local path or a storage URL (``file://``, ``s3://``,
    ``gs://``, anything :class:`Storage` opens), a directory (``directory=True``: the hf format) or one
    file. Every file's size and crc32c is kept for the manifest that :meth:`commit` writes last.

    On a local disk the writers write into a temporary directory beside ``out`` (``.NAME.partial-*``),
    each finished file fsync'ed, and the export is renamed into place only when it is complete
    (:meth:`publish`, which :meth:`commit` calls): an export that fails leaves nothing at ``out``, and
    one that replaces an export (``overwrite``) leaves the old one whole. Elsewhere (object stores have
    no rename) each file is written to a local temporary directory, uploaded through :class:`Storage`
    (its retries, time bounds, multipart uploads) as soon as it is complete (:meth:`done`), and
    removed, so the local disk holds one file at a time; the manifest, written last, is the commit,
    and a failed export removes what it uploaded."""

    def __init__(self, out: str, *, directory: bool):
        check_url(out, "OUT")
        self.out, self.directory = out, directory
        if "://" in out:
            where, _, self.name = out.rstrip("/").rpartition("/") if not directory else (out.rstrip("/"), "", "")
            if where.endswith(":/"):
                raise ConfigError(f"OUT {redact(out)} names no object under a bucket or directory; give OUT as "
                                  "URL/name")
        else:
            path = os.path.abspath(out)
            where, self.name = (path, "") if directory else (os.path.dirname(path), os.path.basename(path))
        self.storage = Storage(where)
        root = self.storage.local_path("")
        self.local = root is not None
        # local: the final path (a directory, or the file); the writers write into self.dir until publish()
        self.final = None if root is None else (os.path.join(root, self.name) if self.name else root)
        self.dir = tempfile.mkdtemp(prefix="etrain-export-") if root is None else ""
        self.files: list[dict] = []
        self.overwrite = False
        self.published = False

    def path(self, name: str) -> str:
        """The local path a writer writes ``name`` to (the output file's own name for one file)."""
        return os.path.join(self.dir, name)

    def prepare(self, *, overwrite: bool) -> None:
        """Refuse an output that exists and is not empty (ConfigError) unless ``overwrite``; on a local disk,
        make the temporary directory beside it; elsewhere, with ``overwrite``, remove an existing export
        manifest first, so a directory being rewritten reads as incomplete."""
        self.overwrite = overwrite
        if self.local:
            prepare_out(self.final, directory=self.directory, overwrite=overwrite)
            parent, base = os.path.split(self.final.rstrip("/"))
            try:
                self.dir = tempfile.mkdtemp(prefix=f".{base}.partial-", dir=parent)
                mask = os.umask(0o022)
                os.umask(mask)
                os.chmod(self.dir, 0o777 & ~mask)  # mkdtemp's 0700 would be the export's mode
            except OSError as e:
                raise ConfigError(f"OUT {self.out}: cannot create a directory in {parent} ({e.strerror or e}); "
                                  "choose a directory you can write to") from None
            return
        present = self.storage.list_dir("")
        busy = bool(present) if self.directory else self.name in present
        if not self.directory and present.get(self.name, 0) is None:
            raise ConfigError(f"{redact(self.out)} is a directory; the {self.name.rsplit('.', 1)[-1]} export is one "
                              "file")
        if busy and not overwrite:
            raise ConfigError(f"{redact(self.out)} exists and is not empty; choose another output or pass --overwrite")
        if self.directory and EXPORT_MANIFEST in present:
            self.storage.delete_tree(EXPORT_MANIFEST)

    def done(self, name: str) -> None:
        """``name`` is complete: made durable (local) or uploaded and removed (elsewhere)."""
        path = self.path(name)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if size else memoryview(b"")
            try:
                if self.local:
                    os.fsync(f.fileno())
                    crc = checksum(data)
                else:
                    crc = self.storage.put_parts(name, [data])
            finally:
                try:
                    data.release() if isinstance(data, memoryview) else data.close()
                except BufferError:  # a view of it outlived the upload (an error's traceback): unmapped at GC
                    pass
        if not self.local:
            os.remove(path)
        self.files.append({"path": name, "size": size, "crc32c": crc})

    def commit(self, meta: dict) -> None:
        """Write ``MANIFEST.json`` (every file with its size and crc32c, and ``meta``), created exclusively;
        on a local disk, then :meth:`publish` the directory."""
        doc = {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION, "created_unix": time.time(), **meta,
               "files": self.files}
        blob = json.dumps(doc, indent=1).encode()
        if not self.local:
            self.storage.put(EXPORT_MANIFEST, blob, exclusive=True)
            self.published = True
            return
        with open(self.path(EXPORT_MANIFEST), "xb") as f:
            f.write(blob)
            os.fsync(f.fileno())
        self.publish()

    def publish(self) -> None:
        """Move a complete local export into place: a directory by one rename (FileExistsError when another
        export took its place meanwhile), or file by file into an existing directory, the old manifest
        removed first, the new one moved last, and the files the old manifest listed that the new export
        does not write removed; one file by one rename. Nothing to do elsewhere (uploaded already)."""
        if not self.local or self.published:
            self.published = True
            return
        final = self.final.rstrip("/")
        if not self.directory:
            os.replace(self.path(self.name), final)
        elif not os.path.isdir(final):
            try:
                os.rename(self.dir, final)
            except OSError as e:
                if os.path.isdir(final) and os.listdir(final) and not self.overwrite:
                    raise FileExistsError(17, "another export took its place", final) from e
                raise
        else:
            names = sorted(os.listdir(self.dir), key=lambda n: n == EXPORT_MANIFEST)  # the manifest last
            if not self.overwrite and os.listdir(final):
                raise FileExistsError(17, "another export took its place", final)
            stale = _listed(final) - set(names)
            if os.path.exists(os.path.join(final, EXPORT_MANIFEST)):
                os.remove(os.path.join(final, EXPORT_MANIFEST))  # the old commit goes first
            for name in names:
                os.replace(os.path.join(self.dir, name), os.path.join(final, name))
            for name in stale:
                if os.path.isfile(os.path.join(final, name)):
                    os.remove(os.path.join(final, name))
        if os.path.isdir(self.dir):
            os.rmdir(self.dir)
        for path in ([final] if self.directory else []) + [os.path.dirname(final)]:  # the renames, durable
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.published = True

    @property
    def url(self) -> str:
        return redact(self.storage.join(self.name) if self.name else self.storage.url)

    def close(self) -> None:
        """Remove what an export that did not complete wrote: the temporary directory (local), or the files it
        uploaded (elsewhere; nothing once its manifest is written)."""
        if self.local:
            if not self.published and self.dir:
                shutil.rmtree(self.dir, ignore_errors=True)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
            for entry in [] if self.published else self.files:  # best effort: without a manifest none is read
                with contextlib.suppress(Exception):
                    self.storage.delete_tree(entry["path"])
        self.storage.close()
