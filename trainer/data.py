"""Training data: a token stream, cut into fixed windows, in one global order.

    corpus = load_corpus(cfg.data)                 # text bytes or token files
    order = SampleOrder(corpus.n_samples(seq_len), seed)
    x, y = batch(corpus, order, samples_consumed, indices)   # see Batcher

Text is modelled byte by byte (vocabulary 256); the default corpus is this
machine's Python standard library sources, listed and hashed so a run records
exactly what it trained on. Pre-tokenized ``.bin`` files (nanoGPT convention:
a flat array of ``uint16`` or ``uint32`` token ids) are memory-mapped.

Sample ``i`` of the stream is the window ``tokens[i*L : i*L + L + 1]``. The
order is one permutation per (seed, epoch), and the run's only data state is a
single cursor, ``samples_consumed``: global position ``g`` is sample
``perm[epoch = g // n][g % n]``. The global batch of step ``s`` is positions
``[s*B, (s+1)*B)``, split evenly across data-parallel ranks, so a run resumed
at any world size continues with exactly the next sample.
"""

from __future__ import annotations

import functools
import glob as globmod
import os
import sysconfig
from dataclasses import dataclass

import fsspec
import numpy as np
import torch
import xxhash

from checkpointing.errors import ConfigError

from .config import DataConfig

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib"}
_DOC_SEP = b"\x00"


@dataclass(frozen=True)
class SourceFile:
    path: str
    size: int
    xxh64: str


class Corpus:
    """A token stream made of one or more arrays, read as if concatenated."""

    def __init__(self, parts: list[np.ndarray], files: list[SourceFile], kind: str, vocab_size: int):
        self.parts = parts
        self.files = files
        self.kind = kind
        self.vocab_size = vocab_size
        self._starts = np.cumsum([0] + [len(p) for p in parts])
        self.n_tokens = int(self._starts[-1])

    @functools.cached_property
    def digest(self) -> str:
        """One hash over the listed files: names, sizes and contents' hashes."""
        h = xxhash.xxh64()
        for f in self.files:
            h.update(f"{f.path}\t{f.size}\t{f.xxh64}\n".encode())
        return h.hexdigest()

    def describe(self) -> dict:
        return {"kind": self.kind, "files": len(self.files), "tokens": self.n_tokens, "digest": self.digest}

    def n_samples(self, seq_len: int) -> int:
        return max(0, (self.n_tokens - 1) // seq_len)

    def window(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens from stream position ``start``, across part borders."""
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        k = int(np.searchsorted(self._starts, pos, side="right")) - 1
        while filled < length:
            part = self.parts[k]
            off = pos - int(self._starts[k])
            n = min(length - filled, len(part) - off)
            out[filled : filled + n] = part[off : off + n]
            filled += n
            pos += n
            k += 1
        return out


def _hash_bytes(data: bytes | np.ndarray) -> str:
    return xxhash.xxh64(data).hexdigest()


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files, without tests and installed packages, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(out)


def _expand(source: str) -> list[tuple[fsspec.AbstractFileSystem, str]]:
    """Files named by an fsspec URL, glob or directory, sorted."""
    fs, _, paths = fsspec.get_fs_token_paths(source)
    if not any(ch in source for ch in "*?[") and len(paths) == 1 and fs.isdir(paths[0]):
        paths = fs.find(paths[0])
    files = sorted(p for p in paths if fs.isfile(p))
    return [(fs, p) for p in files]


def _read_text(cfg: DataConfig) -> Corpus:
    if cfg.source == "stdlib":
        names = stdlib_files()
        opener = [(None, p) for p in names]
        where = f"the standard library at {sysconfig.get_paths()['stdlib']}"
    else:
        opener = _expand(cfg.source)
        where = repr(cfg.source)
    if not opener:
        raise ConfigError(f"data.source={cfg.source!r} matches no files; point it at text files or a glob")
    chunks, files, total = [], [], 0
    for fs, path in opener:
        if fs is None:
            with open(path, "rb") as f:
                data = f.read()
        else:
            data = fs.cat_file(path)
        if not data:
            continue
        if cfg.max_bytes and total + len(data) > cfg.max_bytes:
            data = data[: cfg.max_bytes - total]
        files.append(SourceFile(path, len(data), _hash_bytes(data)))
        chunks.append(data)
        total += len(data)
        if cfg.max_bytes and total >= cfg.max_bytes:
            break
    if total == 0:
        raise ConfigError(f"data.source: {where} holds no text (every file is empty)")
    arr = np.frombuffer(_DOC_SEP.join(chunks), dtype=np.uint8)
    return Corpus([arr], files, "text", 256)


def _read_tokens(cfg: DataConfig) -> Corpus:
    dtype = np.dtype(cfg.token_dtype)
    opener = _expand(cfg.source)
    if not opener:
        raise ConfigError(f"data.source={cfg.source!r} matches no token files")
    parts, files = [], []
    for fs, path in opener:
        if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            size = os.path.getsize(path)
            if size == 0:
                continue
            if size % dtype.itemsize:
                raise ConfigError(
                    f"token file {path} has {size} bytes, not a multiple of {dtype.itemsize}; "
                    f"is data.token_dtype={cfg.token_dtype!r} right?"
                )
            arr = np.memmap(path, dtype=dtype, mode="r")
        else:
            arr = np.frombuffer(fs.cat_file(path), dtype=dtype)
        if len(arr) == 0:
            continue
        # Hash the ends, not gigabytes: enough to tell files apart and cheap at start-up.
        edge = 1 << 19
        sig = _hash_bytes(np.ascontiguousarray(arr[:edge])) + _hash_bytes(np.ascontiguousarray(arr[-edge:]))
        files.append(SourceFile(path, int(arr.nbytes), sig))
        parts.append(arr)
    if not parts:
        raise ConfigError(f"data.source={cfg.source!r}: every token file is empty")
    vocab = int(max(int(p.max()) for p in parts)) + 1 if sum(len(p) for p in parts) < (1 << 26) else 0
    return Corpus(parts, files, "tokens", vocab)


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read (or map) the corpus that ``data.source`` names."""
    fmt = cfg.format
    if fmt == "auto":
        fmt = "tokens" if cfg.source.endswith(".bin") else "text"
    if cfg.source != "stdlib" and "://" not in cfg.source and not globmod.has_magic(cfg.source):
        if not os.path.exists(cfg.source):
            raise ConfigError(f"data.source={cfg.source!r} does not exist")
    return _read_tokens(cfg) if fmt == "tokens" else _read_text(cfg)


def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(xxhash.xxh64(f"order:{seed}:{epoch}".encode()).digest(), "little") & ((1 << 63) - 1)


class SampleOrder:
    """Global position -> sample id: one permutation per (seed, epoch)."""

    def __init__(self, n_samples: int, seed: int):
        if n_samples < 1:
            raise ConfigError("the corpus is shorter than one sample; lower data.seq_len or add data")
        self.n = n_samples
        self.seed = seed
        self._cache: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._cache:
            if len(self._cache) > 2:
                self._cache.pop(min(self._cache))
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._cache[epoch] = torch.randperm(self.n, generator=g)
        return self._cache[epoch]

    def sample_ids(self, start: int, count: int) -> list[int]:
        """Sample ids at global positions ``[start, start + count)``."""
        out = []
        for g in range(start, start + count):
            epoch, pos = divmod(g, self.n)
            out.append(int(self.permutation(epoch)[pos]))
        return out

    def epoch_of(self, position: int) -> int:
        return position // self.n


class Batcher:
    """Cuts each step's global batch into this data-parallel rank's micro-batches.

    ``samples_consumed`` is the only state; it advances by ``global_batch``
    per step, whatever the world size.
    """

    def __init__(self, corpus: Corpus, seq_len: int, seed: int, global_batch: int, dp_rank: int, dp_size: int):
        if global_batch % dp_size:
            raise ConfigError(f"train.global_batch={global_batch} is not divisible by the data-parallel size {dp_size}")
        self.corpus = corpus
        self.seq_len = seq_len
        self.order = SampleOrder(corpus.n_samples(seq_len), seed)
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.local_batch = global_batch // dp_size

    def local_positions(self, samples_consumed: int) -> range:
        """Global positions this rank trains on in the step starting at ``samples_consumed``."""
        start = samples_consumed + self.dp_rank * self.local_batch
        return range(start, start + self.local_batch)

    def tokens(self, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(positions), seq_len) int64."""
        ids = self.order.sample_ids(positions.start, len(positions))
        L = self.seq_len
        rows = np.stack([self.corpus.window(i * L, L + 1) for i in ids])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]
