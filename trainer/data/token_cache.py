"""The token cache: a corpus tokenized once, then memory-mapped by every rank.

    cache = open_or_build(cache_dir, key_doc, np.uint16, eos_id, build)   # build(writer) runs at most once
    cache.tokens        # the ids (CheckedTokens): documents back to back, EOS after each; slice it
    cache.doc_starts    # np.memmap int64: where each document starts, then the end (n_docs + 1)
    cache.digest        # a hash of the token stream and the index as built: what a checkpoint records

On disk, nanoGPT's flat token file plus Megatron's document index:

    <cache_dir>/<key>/tokens.bin     the ids (uint8, uint16 or uint32)
    <cache_dir>/<key>/chunks.bin     xxh3-64 of every CHUNK_BYTES of tokens.bin (uint64, little-endian)
    <cache_dir>/<key>/index.bin      int64 document offsets
    <cache_dir>/<key>/header.json    what was built from what, the hashes, and its own hash; written last
    <cache_dir>/<key>.lock           held (flock) by the one process that builds

``key`` is a hash of the key document: the input files' names, sizes and
modification stamps, the tokenizer's own bytes, the format, ``text_field`` and
``max_bytes`` (see trainer.data.corpus), and the format version. Any change there is a
new key, so a cache is never updated: a build goes to a temporary directory,
every file is fsync'ed, and one ``rename`` publishes it whole, or not at all.
Processes that start together (the ranks of a node: no process group exists
yet) race for the lock; one builds while the others wait on it and then map
the result. A builder that dies releases its lock with its process, and the
next one builds again; a half-written directory is never opened.

Integrity covers every byte. Opening checks the header (a schema, and its own
hash), the file sizes, and the whole of chunks.bin and index.bin against the
header's hashes; a cache that fails is moved aside and built again. The
tokens are checked a chunk (1 MiB) at a time, the first time this process
reads any of a chunk (``CheckedTokens``): a chunk that differs from its hash
raises :class:`CorruptCacheError` before any id of it is returned, and moves
the cache aside so that the next start builds it again.

Why per chunk rather than one hash of tokens.bin at open, measured on a 1 GB
cache (``bench/token_cache.py``; a loaded 2-core machine, three runs): a full
hash at open adds a read of the whole file to every rank's every start,
recoveries included: 0.04-0.18 s from the page cache, 0.5-0.75 s after
dropping it (this machine's disk is cached by its host; minutes for a 100 GB
corpus on a cold disk). The check per chunk costs 1-4 ms at open whatever the
size, 50-190 us on a chunk's first read, and about a microsecond per sample
after: the same hashing in all, spread over the samples that read it, never
blocking a start, and only for chunks that are read. The price: damage is
found when its chunk is first read, mid-run, which stops the run (exit 1)
instead of refusing it at start; no token of it is ever used either way.

The format version 1 hashed only the first and last MiB of tokens; its caches
have another key, so they are never opened (a warning names them), and the
cache is built again.
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

from checkpointing.errors import ConfigError, EtrainError

log = logging.getLogger("etrain")

CACHE_VERSION = 2
CHUNK_BYTES = 1 << 20
_DTYPES = ("uint8", "uint16", "uint32")
_HEADER_TYPES = {"version": int, "key": str, "dtype": str, "n_tokens": int, "n_docs": int, "eos_id": (int, type(None)),
                 "max_id": int, "tokens_xxh64": str, "index_xxh64": str, "chunk_bytes": int, "chunks_xxh3": str,
                 "inputs": dict, "source_bytes": int, "build_seconds": (int, float), "built_by": str,
                 "created": (int, float), "header_xxh3": str}


class CorruptCacheError(EtrainError):
    """Bytes of a token cache differ from the hashes recorded when it was built."""


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


def cache_key(key_doc: dict, version: int = CACHE_VERSION) -> str:
    blob = json.dumps({"version": version, **key_doc}, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _xxh3(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _header_hash(doc: dict) -> str:
    """The header's own hash: every field but this one, as canonical JSON."""
    rest = {k: v for k, v in doc.items() if k != "header_xxh3"}
    return _xxh3(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def _move_aside(path: str) -> str | None:
    """Rename a damaged cache to ``<key>.damaged-<ns>-<pid>``; where it went, or None when it was already gone."""
    dest = f"{path}.damaged-{time.time_ns()}-{os.getpid()}"
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return None
    return dest


class CheckedTokens:
    """tokens.bin, memory-mapped; each chunk is hashed against chunks.bin the first time any of it is read.

    Slicing returns the memmap's own view (no copy) once the chunks it spans are checked."""

    def __init__(self, directory: str, identity: tuple[int, int], dtype: np.dtype, n_tokens: int,
                 chunk_bytes: int, table: np.ndarray):
        self.directory = directory
        self._identity = identity  # (st_dev, st_ino) of the directory opened: what a detection may move aside
        mm = np.memmap(os.path.join(directory, "tokens.bin"), dtype=dtype, mode="r", shape=(n_tokens,))
        self._ids = mm.view(np.ndarray)  # slices of a plain view skip memmap's per-slice bookkeeping
        self.dtype = self._ids.dtype
        self._n = n_tokens
        self._per = chunk_bytes // self.dtype.itemsize
        self._table = table
        self._ok = bytearray(len(self._table))

    def __len__(self) -> int:
        return self._n

    @property
    def shape(self) -> tuple[int]:
        return (self._n,)

    def __getitem__(self, key):
        if type(key) is slice and key.step is None:  # a sample's window: the hot path
            start, stop, _ = key.indices(self._n)
            if stop > start:
                c = start // self._per
                if c != (stop - 1) // self._per or not self._ok[c]:
                    self.check(start, stop)
        elif isinstance(key, slice):
            self.check(0, self._n)
        else:
            i = int(key) + (self._n if int(key) < 0 else 0)
            self.check(i, i + 1)
        return self._ids[key]

    def __array__(self, dtype=None, copy=None):
        self.check(0, self._n)
        return np.asarray(self._ids, dtype=dtype)

    def check(self, start: int, stop: int) -> None:
        """Verify the chunks that tokens ``[start, stop)`` lie in (once each); CorruptCacheError if one differs."""
        if stop <= start:
            return
        for c in range(start // self._per, (stop - 1) // self._per + 1):
            if not self._ok[c]:
                self._verify(c)

    def _verify(self, c: int) -> None:
        lo = c * self._per
        if xxhash.xxh3_64_intdigest(self._ids[lo : lo + self._per]) == int(self._table[c]):
            self._ok[c] = 1
            return
        isz = self.dtype.itemsize
        where = self._quarantine()
        raise CorruptCacheError(
            f"token cache {self.directory}: tokens.bin bytes {lo * isz}-{min(lo + self._per, self._n) * isz} "
            "differ from the hash recorded when it was built (the file was changed or damaged since); none of "
            "those tokens was used. " + (f"It was moved aside ({where}); the next start builds it again." if where else
                                 f"Delete {self.directory} to build it again."))

    def _quarantine(self) -> str | None:
        """Move this cache aside, unless the directory at its path is no longer the one mapped."""
        try:
            st = os.stat(self.directory)
            if (st.st_dev, st.st_ino) != self._identity:
                return None
            return _move_aside(self.directory)
        except OSError:
            return None


@dataclass
class TokenCache:
    path: str
    header: dict
    tokens: CheckedTokens
    doc_starts: np.ndarray
    state: str  # "built" here, "reused", or "waited" (another process built it while this one waited)

    @property
    def digest(self) -> str:
        """A hash of exactly what was tokenized: the token stream and its documents, as built (the same as
        format 1's for the same content). Every token used is first checked against the chunk table made
        from the same bytes, and the index at open, so the content read is the content this names."""
        return xxhash.xxh64(f"{self.header['tokens_xxh64']}:{self.header['index_xxh64']}".encode()).hexdigest()


class CacheWriter:
    """Appends tokenized documents; ``add`` takes a batch of pieces, each possibly ending its document."""

    def __init__(self, directory: str, dtype, eos_id: int | None, chunk_bytes: int = CHUNK_BYTES):
        self.directory = directory
        self.dtype = np.dtype(dtype)
        self.eos = None if eos_id is None else np.array([eos_id], dtype=self.dtype)
        self.chunk_bytes = chunk_bytes
        self._tokens = open(os.path.join(directory, "tokens.bin"), "wb")
        self._index = open(os.path.join(directory, "index.bin"), "wb")
        self._hash = xxhash.xxh64()
        self._chunk = xxhash.xxh3_64()
        self._chunk_fill = 0
        self._chunks: list[int] = []
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
        self._hash_chunks(memoryview(data))
        self._tokens.write(data)
        self.n_tokens = pos
        if offsets:
            self._index.write(np.asarray(offsets, dtype=np.int64).tobytes())
            self.n_docs += len(offsets)

    def _hash_chunks(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.chunk_bytes - self._chunk_fill)
            self._chunk.update(data[:take])
            self._chunk_fill += take
            data = data[take:]
            if self._chunk_fill == self.chunk_bytes:
                self._chunks.append(self._chunk.intdigest())
                self._chunk.reset()
                self._chunk_fill = 0

    def finish(self, key: str, key_doc: dict, started: float) -> dict:
        if self._cur:  # a source that ended inside a document: close it
            self.add([], [True])
        if self._chunk_fill:
            self._chunks.append(self._chunk.intdigest())
        for f in (self._tokens, self._index):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        table = np.asarray(self._chunks, dtype="<u8").tobytes()
        _write_synced(os.path.join(self.directory, "chunks.bin"), table)
        index = np.fromfile(os.path.join(self.directory, "index.bin"), dtype=np.int64)
        header = {"version": CACHE_VERSION, "key": key, "dtype": self.dtype.name, "n_tokens": self.n_tokens,
                  "n_docs": self.n_docs, "eos_id": None if self.eos is None else int(self.eos[0]),
                  "max_id": self.max_id, "tokens_xxh64": self._hash.hexdigest(),
                  "index_xxh64": xxhash.xxh64_hexdigest(index), "chunk_bytes": self.chunk_bytes,
                  "chunks_xxh3": _xxh3(table), "inputs": key_doc, "source_bytes": self.source_bytes,
                  "build_seconds": round(time.monotonic() - started, 3),
                  "built_by": f"{socket.gethostname()}:{os.getpid()}", "created": time.time()}
        header["header_xxh3"] = _header_hash(header)
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


class _Invalid(Exception):
    pass


def _check_header(doc, key: str) -> dict:
    if not isinstance(doc, dict) or set(doc) != set(_HEADER_TYPES):
        raise _Invalid("header fields differ from this version's")
    for name, typ in _HEADER_TYPES.items():
        if not isinstance(doc[name], typ) or isinstance(doc[name], bool):
            raise _Invalid(f"header field {name!r} has the wrong type")
    if doc["header_xxh3"] != _header_hash(doc):
        raise _Invalid("header differs from its own hash")
    if doc["version"] != CACHE_VERSION or doc["key"] != key:
        raise _Invalid("header version or key differs")
    if doc["dtype"] not in _DTYPES or doc["n_tokens"] < 1 or doc["n_docs"] < 1:
        raise _Invalid("header dtype or counts out of range")
    cb = doc["chunk_bytes"]
    if not 64 <= cb <= 1 << 30 or cb & (cb - 1):
        raise _Invalid("header chunk_bytes out of range")
    return doc


def _read_header(path: str, key: str) -> dict:
    try:
        with open(os.path.join(path, "header.json"), "rb") as f:
            return _check_header(json.loads(f.read()), key)
    except (OSError, ValueError, RecursionError) as e:
        raise _Invalid(f"header unreadable: {type(e).__name__}") from None


def _open(path: str, key: str, state: str) -> TokenCache:
    """Map a committed cache; _Invalid when anything about it does not add up."""
    header = _read_header(path, key)
    dtype, n_tokens, cb = np.dtype(header["dtype"]), header["n_tokens"], header["chunk_bytes"]
    files = {name: os.path.join(path, name) for name in ("tokens.bin", "chunks.bin", "index.bin")}
    sizes = {"tokens.bin": n_tokens * dtype.itemsize, "index.bin": (header["n_docs"] + 1) * 8}
    sizes["chunks.bin"] = -(-sizes["tokens.bin"] // cb) * 8
    try:
        st = os.stat(path)
        for name, size in sizes.items():
            if os.path.getsize(files[name]) != size:
                raise _Invalid(f"{name} size differs from the header's")
        with open(files["chunks.bin"], "rb") as f:
            table = f.read()
        if _xxh3(table) != header["chunks_xxh3"]:
            raise _Invalid("chunks.bin hash differs from the header's")
        index = np.memmap(files["index.bin"], dtype=np.int64, mode="r")
        if xxhash.xxh64_hexdigest(index) != header["index_xxh64"]:
            raise _Invalid("index.bin hash differs from the header's")
        if index[0] != 0 or index[-1] != n_tokens or (np.diff(index) < 0).any():
            raise _Invalid("index.bin offsets are not a partition of the tokens")
        tokens = CheckedTokens(path, (st.st_dev, st.st_ino), dtype, n_tokens, cb, np.frombuffer(table, "<u8"))
    except (OSError, ValueError) as e:
        raise _Invalid(f"{type(e).__name__}: {e}") from None
    return TokenCache(path, header, tokens, index, state)


def _try_open(path: str, key: str, state: str) -> TokenCache | None:
    """The committed cache at ``path``; None when there is none (or it is damaged: logged)."""
    if not os.path.lexists(os.path.join(path, "header.json")):
        return None
    try:
        return _open(path, key, state)
    except _Invalid as e:
        log.warning("token cache %s is damaged (%s); it is moved aside and built again", path, e)
        return None


def _note_older_formats(cache_dir: str, key_doc: dict) -> None:
    """Say so when a cache of the same inputs exists in an older format: it is not used (its hashes
    do not cover every byte), and its space can be freed."""
    for version in range(1, CACHE_VERSION):
        old = os.path.join(cache_dir, cache_key(key_doc, version))
        if os.path.isdir(old):
            log.warning("token cache %s has an older format (%d) whose hashes do not cover every token; it is not "
                        "used, and the cache is built again in format %d (delete %s to free its space)",
                        old, version, CACHE_VERSION, old)


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
                  *, empty: str = "data.source holds no text", chunk_bytes: int = CHUNK_BYTES) -> TokenCache:
    """Map the cache of ``key_doc`` under ``cache_dir``, building it first (once, under a lock) if needed.

    ``empty``: what the ConfigError says when the build wrote no tokens; ``chunk_bytes``: the span of
    tokens.bin each hash of chunks.bin covers, for a new build (a power of two, at least 64)."""
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
        if os.path.lexists(final):
            _move_aside(final)
        _note_older_formats(cache_dir, key_doc)
        tmp = tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=cache_dir)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep other users' runs from mapping it
        writer = CacheWriter(tmp, dtype, eos_id, chunk_bytes)
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
