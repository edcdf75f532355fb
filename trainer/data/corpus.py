"""Training data: a token stream, cut into fixed windows, in one global order.

    train, val = load_splits(cfg)                  # the training stream and the held-out one (or None)
    corpus = load_corpus(cfg.data)                 # the whole [data] stream
    order = SampleOrder(corpus.n_samples(seq_len), seed)
    x, y = batch(corpus, order, samples_consumed, indices)   # see Batcher

Sources (docs/models-and-data.md): text files, JSON lines and Parquet (the
``data.text_field`` of each record), a ``datasets`` spec for local files,
pre-tokenized ``.bin`` files (nanoGPT convention: a flat array of ``uint16``
or ``uint32`` ids, memory-mapped), or a Python factory returning a map-style
dataset of token ids. Text is tokenized once into a token cache
(trainer.data.token_cache) that every rank memory-maps, with the tokenizer's EOS
after each document. The default corpus, this machine's Python standard
library read as bytes (vocabulary 256), is small and stays in memory, listed
and hashed so a run records exactly what it trained on.

Sample ``i`` of the stream is the window ``tokens[i*L : i*L + L + 1]``. The
order is one permutation per (seed, epoch), and the run's only data state is a
single cursor, ``samples_consumed``: global position ``g`` is sample
``perm[epoch = g // n][g % n]``. The global batch of step ``s`` is positions
``[s*B, (s+1)*B)``, split evenly across data-parallel ranks, so a run resumed
at any world size continues with exactly the next sample, whatever the source.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from checkpointing.cli_args import ArgumentParser
from checkpointing.errors import ConfigError

from ..config import DataConfig, RunConfig
from .sources import (
    Progress,
    expand,
    factory_item,
    iter_pieces,
    list_inputs,
    python_dataset,
    resolve_format,
    stdlib_files,
)
from ..models import spec_for
from .token_cache import TokenCache, open_or_build, resolve_cache_dir
from .tokenize import encode_stream, load_tokenizer, token_dtype

__all__ = ["Batcher", "Corpus", "SampleOrder", "load_corpus", "load_splits", "prepare", "stdlib_files",
           "tokenizer_vocab_size"]

log = logging.getLogger("etrain")
_DOC_SEP = b"\x00"


@dataclass(frozen=True)
class SourceFile:
    path: str
    size: int
    xxh64: str


class Corpus:
    """A token stream read from arrays (``parts``) through spans ``(part, start, length)``, as if concatenated.

    Without spans, each part is read whole. ``doc_offsets`` (per part: where its documents start, then
    its end) marks documents, so that whole ones can be held out (:func:`load_splits`)."""

    def __init__(self, parts: list[np.ndarray], files: list, kind: str, vocab_size: int, *,
                 spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                 doc_offsets: list[np.ndarray] | None = None, digest: str | None = None, info: dict | None = None):
        self.parts = parts
        self.files = files
        self.kind = kind
        self.vocab_size = vocab_size
        if spans is None:
            spans = (np.arange(len(parts)), np.zeros(len(parts)), np.array([len(p) for p in parts]))
        self._span_part, self._span_start, self._span_len = (np.asarray(a, dtype=np.int64) for a in spans)
        self._starts = np.concatenate([[0], np.cumsum(self._span_len)]).astype(np.int64)
        self.n_tokens = int(self._starts[-1])
        self.doc_offsets = doc_offsets
        self.info = info or {}
        if digest is not None:
            self.__dict__["digest"] = digest

    @functools.cached_property
    def digest(self) -> str:
        """One hash over the listed files: names, sizes and contents' hashes."""
        h = xxhash.xxh64()
        for f in self.files:
            h.update(f"{f.path}\t{f.size}\t{f.xxh64}\n".encode())
        return h.hexdigest()

    @property
    def n_docs(self) -> int:
        if self.doc_offsets is not None:
            return sum(len(o) - 1 for o in self.doc_offsets)
        return self.info.get("documents", len(self.parts))

    def describe(self) -> dict:
        return {"kind": self.kind, "files": len(self.files), "tokens": self.n_tokens, "digest": self.digest,
                **self.info}

    def n_samples(self, seq_len: int) -> int:
        return max(0, (self.n_tokens - 1) // seq_len)

    def window(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens from stream position ``start``, across span borders."""
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        k = int(np.searchsorted(self._starts, pos, side="right")) - 1
        while filled < length:
            off = pos - int(self._starts[k])
            n = min(length - filled, int(self._span_len[k]) - off)
            src = int(self._span_start[k]) + off
            out[filled : filled + n] = self.parts[int(self._span_part[k])][src : src + n]
            filled += n
            pos += n
            k += 1
        return out

    def select(self, doc_ids: np.ndarray, role: str, salt: str) -> Corpus:
        """The documents ``doc_ids`` (sorted, global numbering) as a stream of their own, in order."""
        offsets = self.doc_offsets or [np.array([0, len(p)]) for p in self.parts]
        first = np.concatenate([[0], np.cumsum([len(o) - 1 for o in offsets])])
        sp, ss, sl = [], [], []
        for p, off in enumerate(offsets):
            local = doc_ids[(doc_ids >= first[p]) & (doc_ids < first[p + 1])] - first[p]
            if not len(local):
                continue
            breaks = np.flatnonzero(np.diff(local) != 1) + 1  # runs of consecutive documents read as one span
            run_first = local[np.concatenate([[0], breaks])]
            run_last = local[np.concatenate([breaks - 1, [len(local) - 1]])]
            sp.append(np.full(len(run_first), p))
            ss.append(off[run_first])
            sl.append(off[run_last + 1] - off[run_first])
        spans = tuple(np.concatenate(a) if a else np.zeros(0, dtype=np.int64) for a in (sp, ss, sl))
        digest = xxhash.xxh64(f"{self.digest}:{role}:{salt}".encode()).hexdigest()
        return Corpus(self.parts, self.files, self.kind, self.vocab_size, spans=spans, digest=digest,
                      info={**self.info, "split": role, "documents": len(doc_ids)})


def _hash_bytes(data: bytes | np.ndarray) -> str:
    return xxhash.xxh64(data).hexdigest()


def _read_stdlib_bytes(cfg: DataConfig) -> Corpus:
    """The default corpus: the standard library's sources, bytes joined by a 0 byte, in memory."""
    chunks, files, total = [], [], 0
    for path in stdlib_files():
        with open(path, "rb") as f:
            data = f.read()
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
        raise ConfigError(f"data.source: the standard library at {sysconfig.get_paths()['stdlib']} holds no text")
    arr = np.frombuffer(_DOC_SEP.join(chunks), dtype=np.uint8)
    # Document i is file i and the separator after it.
    ends = np.cumsum([len(c) + 1 for c in chunks])
    offsets = np.concatenate([[0], ends[:-1], [len(arr)]])
    return Corpus([arr], files, "text", 256, doc_offsets=[offsets], info={"documents": len(chunks)})


def _read_tokens(cfg: DataConfig, source: str) -> Corpus:
    """Pre-tokenized ``.bin`` files, memory-mapped (each file a document)."""
    dtype = np.dtype(cfg.token_dtype)
    fs, paths = expand(source)
    if not paths:
        raise ConfigError(f"data.source={source!r} matches no token files")
    if cfg.max_bytes:
        log.warning("data.max_bytes=%d has no effect on token files (data.format=\"tokens\")", cfg.max_bytes)
    parts, files = [], []
    for path in paths:
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
        raise ConfigError(f"data.source={source!r}: every token file is empty")
    if cfg.tokenizer != "bytes":
        vocab = load_tokenizer(cfg.tokenizer).vocab_size
    else:
        vocab = int(max(int(p.max()) for p in parts)) + 1 if sum(len(p) for p in parts) < (1 << 26) else 0
    return Corpus(parts, files, "tokens", vocab, info={"documents": len(parts)})


def _cache_corpus(cache: TokenCache, kind: str, files: list, vocab_size: int, tokenizer: str) -> Corpus:
    h = cache.header
    info = {"documents": h["n_docs"], "tokenizer": tokenizer, "cache": cache.path, "cache_state": cache.state,
            "source_bytes": h["source_bytes"], "build_seconds": h["build_seconds"]}
    return Corpus([cache.tokens], files, kind, vocab_size, doc_offsets=[cache.doc_starts], digest=cache.digest,
                  info=info)


def _read_text(cfg: DataConfig, source: str, fmt: str, progress: Progress | None) -> Corpus:
    """Text, JSON lines, Parquet or a ``datasets`` spec, through the token cache."""
    tok = load_tokenizer(cfg.tokenizer)
    inputs = list_inputs(cfg, fmt, source)
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    key_doc = {"format": fmt, "builder": source if fmt == "hf" else None, "tokenizer": tok.fingerprint,
               "eos_id": tok.eos_id, "text_field": None if fmt == "text" else cfg.text_field,
               "max_bytes": cfg.max_bytes, "files": [[f.path, f.size, f.stamp] for f in inputs.files]}

    def build(writer) -> None:
        pieces = iter_pieces(cfg, fmt, inputs, as_bytes=getattr(tok, "wants_bytes", False), cache_dir=cache_dir,
                             progress=progress)
        for ids, ends, n_bytes in encode_stream(tok, pieces):
            writer.add(ids, ends, n_bytes)

    field = "data.data_files" if fmt == "hf" else "data.source"
    cache = open_or_build(cache_dir, key_doc, token_dtype(tok.vocab_size), tok.eos_id, build,
                          empty=f"{field} ({source if fmt != 'hf' else cfg.data_files}) holds no text")
    return _cache_corpus(cache, fmt, list(inputs.files), tok.vocab_size, tok.name)


def _read_python(cfg: DataConfig, progress: Progress | None) -> Corpus:
    """``data.factory``'s map-style dataset: item i is a document of token ids, packed as given."""
    ds, n = python_dataset(cfg)
    if n == 0:
        raise ConfigError(f"data.factory={cfg.factory!r} returned an empty dataset (len 0); it must hold documents")
    tok = None if cfg.tokenizer == "bytes" else load_tokenizer(cfg.tokenizer)
    limit = tok.vocab_size if tok else 1 << 32
    probes = sorted({int(i) for i in np.linspace(0, n - 1, min(n, 16))})
    h = xxhash.xxh64()
    for i in probes:
        h.update(np.ascontiguousarray(factory_item(ds, i, limit, cfg.factory), dtype=np.int64).tobytes())
    fingerprint = getattr(ds, "fingerprint", None)
    fingerprint = fingerprint() if callable(fingerprint) else fingerprint
    table = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "cache_dir"}
    key_doc = {"format": "python", "table": table, "len": n, "probes": h.hexdigest(),
               "fingerprint": None if fingerprint is None else str(fingerprint),
               "tokenizer": tok.fingerprint if tok else None}

    def build(writer) -> None:
        batch = []
        for i in range(n):
            batch.append(factory_item(ds, i, limit, cfg.factory))
            if len(batch) == 1024 or i == n - 1:
                writer.add(batch, [True] * len(batch))
                batch = []
                if progress is not None:
                    progress(i + 1, n)

    cache = open_or_build(resolve_cache_dir(cfg.cache_dir), key_doc, token_dtype(limit), None, build,
                          empty=f"data.factory={cfg.factory!r}'s dataset holds no tokens")
    vocab = tok.vocab_size if tok else cache.header["max_id"] + 1
    return _cache_corpus(cache, "python", [], vocab, tok.name if tok else "none (token ids)")


def _load(cfg: DataConfig, source: str, progress: Progress | None) -> Corpus:
    fmt = resolve_format(cfg, source)
    if fmt == "tokens":
        return _read_tokens(cfg, source)
    if fmt == "python":
        return _read_python(cfg, progress)
    if source == "stdlib" and fmt == "text" and cfg.tokenizer == "bytes":
        return _read_stdlib_bytes(cfg)
    return _read_text(cfg, source, fmt, progress)


def load_corpus(cfg: DataConfig, *, progress: Progress | None = None) -> Corpus:
    """The whole stream ``data.source`` names (tokenized through the cache where it is text)."""
    return _load(cfg, cfg.source, progress)


def tokenizer_vocab_size(cfg: DataConfig) -> int:
    """The vocabulary of ``data.tokenizer`` (largest id + 1; 256 for bytes)."""
    return load_tokenizer(cfg.tokenizer).vocab_size


def check_vocab(cfg: RunConfig, have: int, what: str) -> None:
    """ConfigError unless ``have`` token ids (``what``: the tokenizer's size, or the data's largest id + 1)
    fit the model's vocabulary: ``model.vocab_size``, or the vocab_size of an HF model's config."""
    spec = spec_for(cfg.model)  # a transformers model reads its config for it
    vocab = spec.vocab_size
    field, fix = spec.vocab_field(have)
    if have > vocab:
        raise ConfigError(f"{field} is smaller than {what}, which has {have} ids; {fix}")


def _split_scores(n: int, seed: int) -> np.ndarray:
    """A fixed pseudo-random score per document (splitmix64 of its index): the same on every machine."""
    key = np.uint64(xxhash.xxh64_intdigest(f"val:{seed}".encode()))
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + key + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def split_corpus(corpus: Corpus, fraction: float, seed: int, seq_len: int) -> tuple[Corpus, Corpus]:
    """(train, validation): ``fraction`` of the documents, picked by ``seed``, held out whole."""
    n = corpus.n_docs
    if n < 2:
        raise ConfigError(f"eval.val_fraction={fraction} holds out whole documents, and data.source has {n}; "
                          "give eval.source (a validation corpus) instead")
    k = min(n - 1, max(1, round(fraction * n)))
    held = np.sort(np.argpartition(_split_scores(n, seed), k - 1)[:k])
    mask = np.zeros(n, dtype=bool)
    mask[held] = True
    salt = f"{fraction}:{seed}"
    train, val = corpus.select(np.flatnonzero(~mask), "train", salt), corpus.select(held, "val", salt)
    if val.n_samples(seq_len) < 1:
        raise ConfigError(f"eval.val_fraction={fraction} holds out {k} documents of {val.n_tokens} tokens, fewer "
                          f"than one sample of data.seq_len={seq_len} + 1; raise eval.val_fraction")
    return train, val


def load_splits(cfg: RunConfig, *, progress: Progress | None = None) -> tuple[Corpus, Corpus | None]:
    """(training stream, validation stream or None) per ``[data]`` and ``[eval]``.

    ``eval.val_fraction`` holds out whole documents of ``[data]`` (chosen from ``train.seed``; they
    never enter the training stream); ``eval.source`` is read like ``data.source`` (same format and
    tokenizer; with format "hf" it names the validation data_files)."""
    d, e = cfg.data, cfg.eval
    fmt = resolve_format(d)
    if fmt not in ("python", "tokens"):  # before any tokenizing: a vocabulary too small is known now
        check_vocab(cfg, tokenizer_vocab_size(d), f"the vocabulary of data.tokenizer={d.tokenizer!r}")
    train = load_corpus(d, progress=progress)
    check_vocab(cfg, train.vocab_size, "the training data's vocabulary")
    if e.source:
        if fmt == "hf":
            val = _load(dataclasses.replace(d, data_files=[e.source]), d.source, progress)
        else:
            val = _load(d, e.source, progress)
        check_vocab(cfg, val.vocab_size, f"the vocabulary of eval.source={e.source!r}")
        if val.n_samples(d.seq_len) < 1:
            raise ConfigError(f"eval.source={e.source!r} holds {val.n_tokens} tokens, fewer than one sample of "
                              f"data.seq_len={d.seq_len} + 1")
        return train, val
    if e.val_fraction > 0:
        return split_corpus(train, e.val_fraction, cfg.train.seed, d.seq_len)
    return train, None


def prepare(cfg: RunConfig, progress: Progress | None = None) -> list[dict]:
    """Build (or find) the token caches of a run ahead of time; what each split holds."""
    train, val = load_splits(cfg, progress=progress)
    return [{"split": "train", **train.describe()}] + ([{"split": "val", **val.describe()}] if val else [])


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


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.data.corpus prepare CONFIG [--set k=v ...]``: build a run's token caches ahead of time."""
    import json
    import sys
    import time

    from ..config.load import load_config

    ap = ArgumentParser(prog="python -m trainer.data.corpus", description="Prepare a run's token caches.")
    ap.add_argument("command", choices=["prepare"])
    ap.add_argument("config", help="run config (TOML)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    args = ap.parse_args(argv)
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if time.monotonic() - last[0] >= 2.0 or done >= total:
            last[0] = time.monotonic()
            print(f"etrain: tokenizing: {100 * done / max(total, 1):5.1f}%", flush=True)

    try:
        for d in prepare(load_config(args.config, args.set), progress):
            print(json.dumps(d), flush=True)
    except ConfigError as e:
        print(f"etrain: invalid config: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
