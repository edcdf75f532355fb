"""Token-cache build throughput against the raw ``tokenizers`` encoder, and the cost of reusing a cache.

    python bench/data_prepare.py [--quick] [--threads N] [--mb MB] [--rounds R]

The corpus is this machine's Python standard library sources (text, no
download), up to ``--mb`` MB; the tokenizer a byte-level BPE trained here with
``tokenizers`` on part of it. Per round, back to back:

* ``raw``: the encoder alone, at its best: one ``Tokenizer.encode_batch_fast``
  call (the faster of the two raw batch calls: no offsets) over all the texts,
  read into memory beforehand (untimed), keeping nothing;
* ``build``: ``trainer.data.corpus.load_corpus`` into an empty cache directory, i.e.
  read, encode, append EOS, write, hash and fsync the token file and index,
  rename into place, then map and validate it;
* ``reuse``: ``load_corpus`` again with the same config: list and stat the
  files, fingerprint the tokenizer, open and validate the committed cache.

Both encoders run on the same ``RAYON_NUM_THREADS`` thread pool (``--threads``,
default every core). ``ratio`` is the median over rounds of build MB/s over raw
MB/s (target >= 0.8); ``cpu_ratio`` the same for CPU seconds of the process
(raw over build), which a busy shared machine disturbs less than wall time. Rounds
alternate which side goes first. The last line printed is one JSON object with
every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def stdlib_texts(max_bytes: int) -> list[bytes]:
    """The stdlib files as the default corpus lists them, cut at ``max_bytes`` as data.max_bytes cuts them."""
    from trainer.data.sources import stdlib_files

    out, total = [], 0
    for path in stdlib_files():
        with open(path, "rb") as f:
            data = f.read()
        if not data:
            continue
        data = data[: max_bytes - total]
        out.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return out


def train_tokenizer(texts: list[bytes], path: str, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((t.decode("utf-8", "replace") for t in texts), trainer)
    tok.save(path)


def raw_encode(tok_path: str, max_bytes: int) -> tuple[float, float, int, int]:
    """Seconds (wall, CPU) to encode the files' texts, already in memory, in one ``encode_batch_fast`` call
    (the thread pool balances it best that way); bytes, files."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    texts = [t.decode("utf-8", "replace") for t in stdlib_texts(max_bytes)]
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    t0, c0 = time.monotonic(), time.process_time()
    tok.encode_batch_fast(texts, add_special_tokens=False)
    return time.monotonic() - t0, time.process_time() - c0, n_bytes, len(texts)


def cache_load(tok_path: str, max_bytes: int, cache_dir: str) -> tuple[float, float, dict]:
    """Seconds (wall, CPU) of ``load_corpus`` through the cache at ``cache_dir``; what it loaded."""
    from trainer.config import DataConfig
    from trainer.data.corpus import load_corpus

    t0, c0 = time.monotonic(), time.process_time()
    corpus = load_corpus(DataConfig(source="stdlib", tokenizer=tok_path, max_bytes=max_bytes, cache_dir=cache_dir))
    return time.monotonic() - t0, time.process_time() - c0, corpus.describe()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 MB, 4 rounds, a smaller vocabulary")
    ap.add_argument("--mb", type=float, help="MB of text (default 12: the whole stdlib; 4 with --quick)")
    ap.add_argument("--rounds", type=int, help="rounds (default 5; 4 with --quick)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="encoder threads, both sides")
    ap.add_argument("--vocab", type=int, help="BPE vocabulary (default 8192; 2048 with --quick)")
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before the first encode starts the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    max_bytes = int((args.mb or (4 if args.quick else 12)) * 1e6)
    rounds = args.rounds or (4 if args.quick else 5)
    vocab = args.vocab or (2048 if args.quick else 8192)

    tmp = tempfile.mkdtemp(prefix="etrain-bench-data-")
    try:
        tok_path = os.path.join(tmp, "tokenizer.json")
        t0 = time.monotonic()
        train_tokenizer(stdlib_texts(min(max_bytes, 2_000_000)), tok_path, vocab)
        print(f"tokenizer: BPE, vocabulary {vocab}, trained in {time.monotonic() - t0:.1f} s", flush=True)
        raw_encode(tok_path, min(max_bytes, 1_000_000))  # warm the thread pool and the page cache
        rows: dict[str, list[float]] = {"raw_mb_s": [], "build_mb_s": [], "ratio": [], "cpu_ratio": [],
                                        "reuse_s": []}
        info = {}
        for r in range(rounds):
            cache_dir = os.path.join(tmp, f"cache{r}")
            if r % 2 == 0:  # alternate which goes first: the load of a shared machine drifts
                raw_s, raw_cpu, n_bytes, n_files = raw_encode(tok_path, max_bytes)
            build_s, build_cpu, info = cache_load(tok_path, max_bytes, cache_dir)
            if r % 2 == 1:
                raw_s, raw_cpu, n_bytes, n_files = raw_encode(tok_path, max_bytes)
            assert info["cache_state"] == "built", info
            reuse_s, _, again = cache_load(tok_path, max_bytes, cache_dir)
            assert again["cache_state"] == "reused" and again["digest"] == info["digest"], again
            mb = n_bytes / 1e6
            rows["raw_mb_s"].append(mb / raw_s)
            rows["build_mb_s"].append(mb / build_s)
            rows["ratio"].append(raw_s / build_s)
            rows["cpu_ratio"].append(raw_cpu / build_cpu)
            rows["reuse_s"].append(reuse_s)
            print(f"round {r}: {mb:.1f} MB, raw {mb / raw_s:.2f} MB/s, build {mb / build_s:.2f} MB/s "
                  f"(ratio {raw_s / build_s:.2f}; CPU seconds {raw_cpu:.2f} vs {build_cpu:.2f}), "
                  f"reuse {reuse_s * 1e3:.0f} ms", flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(json.dumps({
            "bench": "data_prepare", "quick": args.quick, "threads": args.threads, "vocab": vocab,
            "text_mb": round(n_bytes / 1e6, 2), "files": n_files, "tokens": info["tokens"],
            "raw_mb_s": round(med["raw_mb_s"], 2), "build_mb_s": round(med["build_mb_s"], 2),
            "ratio": round(med["ratio"], 3), "cpu_ratio": round(med["cpu_ratio"], 3),
            "reuse_s": round(med["reuse_s"], 3), "rounds": rounds,
        }))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
