"""The token cache: a corpus tokenized once, then memory-mapped by every rank.

    cache = open_or_build(cache_dir, key_doc, np.uint16, eos_id, build)   # build(writer) runs at most once
    cache.tokens        # np.memmap of ids: documents back to back, EOS after each
    cache.doc_starts    # np.memmap int64: where each document starts, then the end (n_docs + 1)

On disk, nanoGPT's flat token file plus Megatron's document index:

    <cache_dir>/<key>/tokens.bin     the ids (uint8, uint16 or uint32)
    <cache_dir>/<key>/index.bin      int64 document offsets
    <cache_dir>/<key>/header.json    what was built from what, the hashes; written last
    <cache_dir>/<key>.lock           held (flock) by the one process that builds

``key`` is a hash of the key document: the input files' names, sizes and
modification stamps, the tokenizer's own bytes, the format, ``text_field`` and
``max_bytes`` (see trainer.data). Any change there is a new key, so a cache is
never updated: a build goes to a temporary directory, every file is fsync'ed,
and one ``rename`` publishes it whole, or not at all. Processes that start
together (the ranks of a node: no process group exists yet) race for the
lock; one builds while the others wait on it and then map the result. A
builder that dies releases its lock with its process, and the next one builds
again; a half-written directory is never opened. Opening validates the header
against a schema, the file sizes, and the index's hash.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from checkpointing.errors import ConfigError

log = logging.getLogger("etrain")

CACHE_VERSION = 1
_DTYPES = ("uint8", "uint16", "uint32")
_EDGE = 1 << 20
_HEADER_TYPES = {"version": int, "key": str, "dtype": str, "n_tokens": int, "n_docs": int, "eos_id": (int, type(None)),
                 "max_id": int, "tokens_xxh64": str, "edges_xxh64": str, "index_xxh64": str, "inputs": dict,
                 "source_bytes": int, "build_seconds": (int, float), "built_by": str, "created": (int, float)}


def default_cache_dir() -> str:
    """``$ETRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/etrain/tokens`` (``~/.cache/etrain/tokens``)."""
    if os.environ.get("ETRAIN_CACHE_DIR"):
        return os.environ["ETRAIN_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "etrain", "tokens")


def resolve_cache_dir(cache_dir: str) -> str:
    d = cache_dir or default_cache_dir()
    if d.startswith("file://"):
        d = d[len("file://"):]
    if "://" in d:
        raise ConfigError(f"data.cache_dir={cache_dir!r} is not a local directory; the token cache is "
                          "memory-mapped, so give a local (or network-mounted) path")
    return os.path.abspath(os.path.expanduser(d))


def cache_key(key_doc: dict) -> str:
    blob = json.dumps({"version": CACHE_VERSION, **key_doc}, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


@dataclass
class TokenCache:
    path: str
    header: dict
    tokens: np.ndarray
    doc_starts: np.ndarray
    state: str  # "built" here, "reused", or "waited" (another process built it while this one waited)

    @property
    def digest(self) -> str:
        """A hash of exactly what was tokenized: the token stream and its documents."""
        return xxhash.xxh64(f"{self.header['tokens_xxh64']}:{self.header['index_xxh64']}".encode()).hexdigest()


class CacheWriter:
    """Appends tokenized documents; ``add`` takes a batch of pieces, each possibly ending its document."""

    def __init__(self, directory: str, dtype, eos_id: int | None):
        self.directory = directory
        self.dtype = np.dtype(dtype)
        self.eos = None if eos_id is None else np.array([eos_id], dtype=self.dtype)
        self._tokens = open(os.path.join(directory, "tokens.bin"), "wb")
        self._index = open(os.path.join(directory, "index.bin"), "wb")
        self._hash = xxhash.xxh64()
        self.n_tokens = 0
        self.n_docs = 0
        self.max_id = -1
        self.source_bytes = 0
        self._cur = 0  # tokens of the document being written
        self._index.write(np.zeros(1, dtype=np.int64).tobytes())

    def add(self, pieces: list[np.ndarray], ends: list[bool], source_bytes: int = 0) -> None:
        out, offsets, pos = [], [], self.n_tokens
        for ids, end in zip(pieces, ends):
            if len(ids):
                out.append(ids)
                pos += len(ids)
                self._cur += len(ids)
            if end and self._cur:  # an empty document is dropped, EOS and all
                if self.eos is not None:
                    out.append(self.eos)
                    pos += 1
                offsets.append(pos)
                self._cur = 0
        self.source_bytes += source_bytes
        if not out:
            return
        buf = np.concatenate(out)
        if buf.dtype != self.dtype:
            buf = buf.astype(self.dtype)
        self.max_id = max(self.max_id, int(buf.max()))
        data = buf.tobytes()
        self._hash.update(data)
        self._tokens.write(data)
        self.n_tokens = pos
        if offsets:
            self._index.write(np.asarray(offsets, dtype=np.int64).tobytes())
            self.n_docs += len(offsets)

    def finish(self, key: str, key_doc: dict, started: float) -> dict:
        if self._cur:  # a source that ended inside a document: close it
            self.add([], [True])
        for f in (self._tokens, self._index):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        index = np.fromfile(os.path.join(self.directory, "index.bin"), dtype=np.int64)
        header = {"version": CACHE_VERSION, "key": key, "dtype": self.dtype.name, "n_tokens": self.n_tokens,
                  "n_docs": self.n_docs, "eos_id": None if self.eos is None else int(self.eos[0]),
                  "max_id": self.max_id, "tokens_xxh64": self._hash.hexdigest(),
                  "edges_xxh64": _edges(os.path.join(self.directory, "tokens.bin")),
                  "index_xxh64": xxhash.xxh64(index.tobytes()).hexdigest(), "inputs": key_doc,
                  "source_bytes": self.source_bytes, "build_seconds": round(time.monotonic() - started, 3),
                  "built_by": f"{socket.gethostname()}:{os.getpid()}", "created": time.time()}
        _write_synced(os.path.join(self.directory, "header.json"), json.dumps(header, indent=1).encode())
        return header

    def abort(self) -> None:
        for f in (self._tokens, self._index):
            f.close()


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _edges(path: str) -> str:
    """A hash of the first and last MiB: catches a truncated or swapped file without reading gigabytes."""
    size = os.path.getsize(path)
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        f.seek(max(0, size - _EDGE))
        h.update(f.read(_EDGE))
    return h.hexdigest()


class _Invalid(Exception):
    pass


def _check_header(doc, key: str) -> dict:
    if not isinstance(doc, dict) or set(doc) != set(_HEADER_TYPES):
        raise _Invalid("header fields differ from this version's")
    for name, typ in _HEADER_TYPES.items():
        if not isinstance(doc[name], typ) or isinstance(doc[name], bool):
            raise _Invalid(f"header field {name!r} has the wrong type")
    if doc["version"] != CACHE_VERSION or doc["key"] != key:
        raise _Invalid("header version or key differs")
    if doc["dtype"] not in _DTYPES or doc["n_tokens"] < 1 or doc["n_docs"] < 1:
        raise _Invalid("header dtype or counts out of range")
    return doc


def _open(path: str, key: str, state: str) -> TokenCache:
    """Map a committed cache; _Invalid when anything about it does not add up."""
    try:
        with open(os.path.join(path, "header.json"), "rb") as f:
            header = _check_header(json.loads(f.read()), key)
    except (OSError, ValueError) as e:
        raise _Invalid(f"header unreadable: {e}") from None
    dtype = np.dtype(header["dtype"])
    tok_path, idx_path = os.path.join(path, "tokens.bin"), os.path.join(path, "index.bin")
    try:
        if os.path.getsize(tok_path) != header["n_tokens"] * dtype.itemsize:
            raise _Invalid("tokens.bin size differs from the header's")
        if os.path.getsize(idx_path) != (header["n_docs"] + 1) * 8:
            raise _Invalid("index.bin size differs from the header's")
        index = np.memmap(idx_path, dtype=np.int64, mode="r")
        if xxhash.xxh64(index.tobytes()).hexdigest() != header["index_xxh64"]:
            raise _Invalid("index.bin hash differs from the header's")
        if index[0] != 0 or index[-1] != header["n_tokens"] or (np.diff(index) < 0).any():
            raise _Invalid("index.bin offsets are not a partition of the tokens")
        if _edges(tok_path) != header["edges_xxh64"]:
            raise _Invalid("tokens.bin hash (first and last MiB) differs from the header's")
        tokens = np.memmap(tok_path, dtype=dtype, mode="r")
    except OSError as e:
        raise _Invalid(str(e)) from None
    return TokenCache(path, header, tokens, index, state)


def _try_open(path: str, key: str, state: str) -> TokenCache | None:
    """The committed cache at ``path``; None when there is none (or it is damaged: logged)."""
    if not os.path.exists(os.path.join(path, "header.json")):
        return None
    try:
        return _open(path, key, state)
    except _Invalid as e:
        log.warning("token cache %s is damaged (%s); it is moved aside and built again", path, e)
        return None


class _Lock:
    """An exclusive flock on ``path``, waited for; released when the holder exits, however it exits."""

    def __init__(self, path: str):
        self.path = path
        self.waited = False

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.waited = True
            log.info("waiting for another process to build the token cache (%s)", self.path)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def open_or_build(cache_dir: str, key_doc: dict, dtype, eos_id: int | None, build: Callable[[CacheWriter], None],
                  *, empty: str = "data.source holds no text") -> TokenCache:
    """Map the cache of ``key_doc`` under ``cache_dir``, building it first (once, under a lock) if needed.

    ``empty``: what the ConfigError says when the build wrote no tokens."""
    key = cache_key(key_doc)
    final = os.path.join(cache_dir, key)
    cache = _try_open(final, key, "reused")
    if cache is not None:
        return cache
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"data.cache_dir: cannot create {cache_dir} ({e.strerror}); set data.cache_dir or "
                          "$ETRAIN_CACHE_DIR to a writable directory") from None
    with _Lock(final + ".lock") as lock:
        cache = _try_open(final, key, "waited" if lock.waited else "reused")
        if cache is not None:
            return cache
        for stale in glob.glob(glob.escape(final) + ".tmp-*"):  # left by builders that died
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.exists(final):
            os.rename(final, f"{final}.damaged-{int(time.time())}")
        tmp = tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=cache_dir)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep other users' runs from mapping it
        writer = CacheWriter(tmp, dtype, eos_id)
        started = time.monotonic()
        try:
            build(writer)
            if writer.n_tokens == 0 or writer.n_docs == 0:
                raise ConfigError(f"{empty}: every document is empty; point it at non-empty data")
            writer.finish(key, key_doc, started)
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(cache_dir)
        except BaseException:
            writer.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return _open(final, key, "built")
