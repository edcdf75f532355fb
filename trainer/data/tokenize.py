"""Tokenizers for text corpora: raw bytes, or a local Hugging Face tokenizer.

    tok = load_tokenizer("bytes")                      # ids 0-255, EOS 0
    tok = load_tokenizer("/models/gpt2/tokenizer.json") # or the directory holding it
    tok.vocab_size, tok.eos_id, tok.fingerprint
    for ids, ends_doc, n_bytes in encode_stream(tok, pieces): ...

A Hugging Face tokenizer is a ``tokenizer.json`` file (read with the
``tokenizers`` library), or a directory that has one, or a directory that
``transformers.AutoTokenizer`` can load without a network (``local_files_only``).
Nothing is ever fetched from a hub. Text is encoded without the tokenizer's own
special tokens (no BOS, no template); the corpus appends ``eos_id`` after each
document itself. ``vocab_size`` is the largest id + 1, added tokens included,
which is what ``model.vocab_size`` must hold.

``encode_stream`` encodes with ``encode_batch_fast``: the Rust side spreads a
batch over ``RAYON_NUM_THREADS`` threads (default: every core) with the GIL
released; two batches are in flight at once, and the finished one is written
while the next is encoded.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import xxhash

from checkpointing.errors import ConfigError
from checkpointing.names import redact

log = logging.getLogger("etrain")

# Names an end-of-text token goes by, most common first, when the tokenizer's config does not say.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]", "<|end|>")
# Files of a tokenizer directory that make up the tokenizer (hashed into the cache key); weights are not.
_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "spiece", "config.json")
_BATCH_PIECES = 4096


def batch_bytes() -> int:
    """Text per encode call: enough pieces for every encoder thread, small enough that reading and writing
    overlap encoding (2 MiB, or 512 KiB per thread)."""
    threads = int(os.environ.get("RAYON_NUM_THREADS") or 0) or os.cpu_count() or 1
    return max(2 << 20, threads * (512 << 10))


class Tokenizer(Protocol):
    """What the token cache needs from a tokenizer."""

    name: str
    vocab_size: int  # largest id + 1
    eos_id: int | None  # appended after every document; None = documents are packed back to back
    fingerprint: str  # a hash of the tokenizer's own bytes

    def encode_batch(self, texts: list) -> list[np.ndarray]: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ids below ``vocab_size``."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


class ByteTokenizer:
    """UTF-8 bytes as ids (vocabulary 256); byte 0 ends a document."""

    name = "bytes"
    vocab_size = 256
    eos_id = 0
    fingerprint = "bytes"
    wants_bytes = True

    def encode_batch(self, texts: list) -> list[np.ndarray]:
        return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8", "replace"), dtype=np.uint8)
                for t in texts]


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (fast), from a tokenizer.json or a transformers fast tokenizer."""

    wants_bytes = False

    def __init__(self, tok, name: str, fingerprint: str, eos_token: str | None):
        self.tok = tok
        self.name = name
        self.fingerprint = fingerprint
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eos_id = _find_eos(vocab, tok.get_added_tokens_decoder(), eos_token, name)
        self.dtype = token_dtype(self.vocab_size)

    def encode_batch(self, texts: list) -> list[np.ndarray]:
        texts = [t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in texts]
        dt = self.dtype
        return [np.array(e.ids, dtype=dt) for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]


class SlowHFTokenizer:
    """A transformers tokenizer with no fast (Rust) form: correct, but encodes in Python."""

    wants_bytes = False

    def __init__(self, tok, name: str, fingerprint: str):
        self.tok = tok
        self.name = name
        self.fingerprint = fingerprint
        self.vocab_size = max(len(tok), max(tok.get_vocab().values(), default=-1) + 1)
        self.eos_id = tok.eos_token_id
        self.dtype = token_dtype(self.vocab_size)
        if self.eos_id is None:
            log.warning("tokenizer %s has no eos_token: documents are packed without a separator", name)

    def encode_batch(self, texts: list) -> list[np.ndarray]:
        texts = [t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in texts]
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        return [np.array(i, dtype=self.dtype) for i in ids]


def _find_eos(vocab: dict, added: dict, eos_token: str | None, name: str) -> int | None:
    if eos_token is not None:
        if eos_token not in vocab:
            raise ConfigError(f"data.tokenizer={name!r}: its config names eos_token {eos_token!r}, which is not in "
                              "its vocabulary; fix tokenizer_config.json")
        return vocab[eos_token]
    special = {t.content: i for i, t in added.items() if t.special}
    for cand in _EOS_NAMES:
        if cand in special:
            return special[cand]
    log.warning("tokenizer %s names no end-of-text token (looked for %s among its special tokens): documents are "
                "packed without a separator; add one, or an eos_token in tokenizer_config.json",
                name, ", ".join(_EOS_NAMES[:3]))
    return None


def _config_eos(directory: str) -> str | None:
    """``eos_token`` from tokenizer_config.json / special_tokens_map.json in ``directory``, if any."""
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        p = os.path.join(directory, fname)
        if not os.path.isfile(p):
            continue
        try:
            with open(p) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"data.tokenizer: {p} is not valid JSON ({e}); fix or remove it") from None
        eos = doc.get("eos_token") if isinstance(doc, dict) else None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return None


def _fingerprint(paths: list[str]) -> str:
    h = xxhash.xxh64()
    for p in sorted(paths):
        h.update(os.path.basename(p).encode() + b"\0")
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def files_of_tokenizer(directory: str) -> list[str]:
    return [os.path.join(directory, n) for n in sorted(os.listdir(directory))
            if os.path.isfile(os.path.join(directory, n)) and n.startswith(_TOKENIZER_FILES)
            or n.endswith((".model", ".tiktoken")) and os.path.isfile(os.path.join(directory, n))]


def _from_json(path: str, name: str, fingerprint: str) -> HFTokenizer:
    from ..models.hf.hf_dir import require_hf

    require_hf(f"data.tokenizer={name!r}", "tokenizers")
    from tokenizers import Tokenizer as RustTokenizer

    try:
        tok = RustTokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the Rust side raises a plain Exception on a malformed file
        raise ConfigError(f"data.tokenizer={name!r}: {path} is not a tokenizers JSON file ({e})") from None
    return _nonempty(HFTokenizer(tok, name, fingerprint, _config_eos(os.path.dirname(path) or ".")))


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"``, a tokenizer.json file, or a local tokenizer directory (ConfigError naming data.tokenizer)."""
    if spec == "bytes":
        return ByteTokenizer()
    if "://" in spec:
        raise ConfigError(f"data.tokenizer={redact(spec)!r} is a URL; give a local tokenizer.json file or directory "
                          "(tokenizers are never downloaded)")
    if os.path.isfile(spec):
        return _from_json(spec, spec, _fingerprint([spec]))
    if not os.path.isdir(spec):
        raise ConfigError(f"data.tokenizer={spec!r} does not exist; use \"bytes\" or a local tokenizer.json file "
                          "or a directory holding one")
    files = files_of_tokenizer(spec)
    if not files:
        raise ConfigError(f"data.tokenizer={spec!r} holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
                          "vocab/merges); point it at a tokenizer directory")
    fp = _fingerprint(files)
    if os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return _from_json(os.path.join(spec, "tokenizer.json"), spec, fp)
    from ..models.hf.hf_dir import require_hf

    require_hf(f"data.tokenizer={spec!r} (no tokenizer.json: read by AutoTokenizer)", "transformers")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for malformed tokenizer files
        raise ConfigError(f"data.tokenizer={spec!r}: AutoTokenizer cannot load it ({type(e).__name__}: {e}); fix "
                          "or replace its tokenizer files") from None
    if getattr(tok, "is_fast", False):
        eos = tok.eos_token if isinstance(tok.eos_token, str) else None
        return _nonempty(HFTokenizer(tok.backend_tokenizer, spec, fp, eos))
    return _nonempty(SlowHFTokenizer(tok, spec, fp))


def _nonempty(tok: Tokenizer) -> Tokenizer:
    if tok.vocab_size < 1:
        raise ConfigError(f"data.tokenizer={tok.name!r} has an empty vocabulary; point it at a trained tokenizer")
    return tok


def _batches(pieces: Iterable[tuple[str | bytes, bool]]) -> Iterator[tuple[list, list[bool], int]]:
    texts, ends, size, limit = [], [], 0, batch_bytes()
    for text, end in pieces:
        texts.append(text)
        ends.append(end)
        size += len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "replace"))
        if size >= limit or len(texts) >= _BATCH_PIECES:
            yield texts, ends, size
            texts, ends, size = [], [], 0
    if texts:
        yield texts, ends, size


def encode_stream(tok: Tokenizer, pieces: Iterable[tuple[str | bytes, bool]], *,
                  depth: int = 2) -> Iterator[tuple[list[np.ndarray], list[bool], int]]:
    """Encode ``(text, ends_document)`` pieces in batches; yields (ids per piece, ends, text bytes) in order.

    ``depth`` batches are encoded at once on threads of their own (the Rust encoder releases the GIL and
    its thread pool takes work from both), so one batch's last pieces never leave encoder threads idle,
    and reading and writing overlap encoding."""
    batches = _batches(pieces)
    with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="etrain-encode") as pool:
        pending = deque((pool.submit(tok.encode_batch, b[0]), b) for b in itertools.islice(batches, depth))
        while pending:
            future, (_, ends, size) = pending.popleft()
            ids = future.result()
            nxt = next(batches, None)
            if nxt is not None:
                pending.append((pool.submit(tok.encode_batch, nxt[0]), nxt))
            yield ids, ends, size
