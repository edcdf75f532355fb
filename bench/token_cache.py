"""The token cache's integrity check: one hash of all of tokens.bin at open, against a hash per chunk
checked the first time a chunk is read (what trainer.data.token_cache does).

    python bench/token_cache.py [--quick] [--gb 1.0] [--windows N]

Builds a cache of random uint16 ids (``--gb`` of tokens, default 1; 0.25 with
``--quick``; documents of 1-2,000 tokens) through ``trainer.data.token_cache``, then
measures, with the page cache warm unless said:

* ``open_s``: opening the built cache (header, sizes, chunk table, index): all a
  rank pays at start when chunks are checked on first read;
* ``full_hash_warm_s`` / ``full_hash_cold_s``: hashing every chunk of tokens.bin,
  what a full hash at open would add to every rank's start (cold: the file
  dropped from the page cache first with ``posix_fadvise(DONTNEED)``);
* ``chunk_first_read_us``: one chunk's check on its first read (warm);
* ``window_raw_us`` / ``window_checked_us``: a training sample (``Corpus.window``
  of 1,025 ids at a random position) from the plain memory map and through
  the checked tokens once every chunk is checked: the steady overhead per
  sample is their difference;
* ``first_pass_raw_s`` / ``first_pass_checked_s``: ``--windows`` random samples
  from a fresh open, cold, the checked side hashing each chunk as it is first
  touched: where the per-chunk design pays what a full hash pays at open.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trainer.data.corpus import Corpus
from trainer.data.token_cache import CHUNK_BYTES, open_or_build

KEY = {"bench": "token_cache"}
SEQ = 1024


def build(cache_dir: str, n_tokens: int) -> None:
    rng = np.random.default_rng(0)

    def fill(writer) -> None:
        done = 0
        while done < n_tokens:
            n = min(8 << 20, n_tokens - done)
            ids = rng.integers(1, 65535, size=n, dtype=np.uint16)
            cuts = np.cumsum(rng.integers(1, 2000, size=n // 1000 + 1))
            cuts = cuts[cuts < n]
            pieces = np.split(ids, cuts)
            writer.add(pieces, [True] * (len(pieces) - 1) + [done + n >= n_tokens])
            done += n

    open_or_build(cache_dir, KEY, np.uint16, None, fill)


def evict(cache_dir: str) -> None:
    """Drop tokens.bin from the page cache (no map of it may be live)."""
    gc.collect()
    for root, _, names in os.walk(cache_dir):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def windows(corpus: Corpus, starts: np.ndarray) -> float:
    return timed(lambda: [corpus.window(int(s), SEQ + 1) for s in starts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="0.25 GB of tokens, fewer samples")
    ap.add_argument("--gb", type=float, help="GB of tokens.bin (default 1; 0.25 with --quick)")
    ap.add_argument("--windows", type=int, help="random samples per pass (default 20,000; 5,000 with --quick)")
    ap.add_argument("--dir", default=None, help="where to build the cache (default: a temporary directory)")
    args = ap.parse_args()
    gb = args.gb or (0.25 if args.quick else 1.0)
    n_windows = args.windows or (5000 if args.quick else 20000)
    tmp = tempfile.mkdtemp(prefix="etrain-bench-cache-", dir=args.dir)
    try:
        n_tokens = int(gb * 1e9) // 2
        t = timed(lambda: build(tmp, n_tokens))
        print(f"built {n_tokens * 2 / 1e9:.2f} GB of tokens in {t:.1f} s", flush=True)

        def open_cache():
            return open_or_build(tmp, KEY, np.uint16, None, lambda w: None)

        open_cache().tokens.check(0, n_tokens)  # warm the page cache
        open_s = statistics.median(timed(open_cache) for _ in range(5))
        full_warm = statistics.median(timed(lambda: open_cache().tokens.check(0, n_tokens)) for _ in range(5))
        n_chunks = -(-n_tokens * 2 // CHUNK_BYTES)
        cold = []
        for _ in range(3):
            evict(tmp)
            cold.append(timed(lambda: open_cache().tokens.check(0, n_tokens)))
        full_cold = statistics.median(cold)
        print(f"open {open_s * 1e3:.1f} ms; full hash {full_warm:.3f} s warm, {full_cold:.2f} s cold "
              f"({n_chunks} chunks of {CHUNK_BYTES >> 20} MiB)", flush=True)

        rng = np.random.default_rng(1)
        starts = rng.integers(0, (n_tokens - 1) // SEQ, size=n_windows) * SEQ
        cache = open_cache()
        tokens_bin = os.path.join(cache.path, "tokens.bin")

        def plain() -> Corpus:  # the same map without the checks
            return Corpus([np.memmap(tokens_bin, dtype=np.uint16, mode="r").view(np.ndarray)], [], "t", 65536)

        raw, checked = plain(), Corpus([cache.tokens], [], "t", 65536)
        cache.tokens.check(0, n_tokens)
        raw_t, checked_t = [], []
        for _ in range(5):  # interleaved: the load of a shared machine drifts
            raw_t.append(windows(raw, starts))
            checked_t.append(windows(checked, starts))
        raw_s, checked_s = statistics.median(raw_t), statistics.median(checked_t)
        del cache, raw, checked
        first_raw, first_checked = [], []
        for _ in range(3):
            evict(tmp)
            first_raw.append(windows(plain(), starts))
            evict(tmp)
            first_checked.append(windows(Corpus([open_cache().tokens], [], "t", 65536), starts))
        first_raw, first_checked = statistics.median(first_raw), statistics.median(first_checked)
        touched = len(set((starts * 2 // CHUNK_BYTES).tolist()) | set(((starts + SEQ) * 2 // CHUNK_BYTES).tolist()))
        print(f"sample: {raw_s / n_windows * 1e6:.2f} us raw, {checked_s / n_windows * 1e6:.2f} us checked; first "
              f"pass of {n_windows} cold: {first_raw:.2f} s raw, {first_checked:.2f} s checked ({touched} chunks)",
              flush=True)
        print(json.dumps({
            "bench": "token_cache", "quick": args.quick, "tokens_gb": round(n_tokens * 2 / 1e9, 3),
            "chunk_bytes": CHUNK_BYTES, "chunks": n_chunks, "open_s": round(open_s, 4),
            "full_hash_warm_s": round(full_warm, 3), "full_hash_cold_s": round(full_cold, 3),
            "chunk_first_read_us": round(full_warm / n_chunks * 1e6, 1),
            "window_raw_us": round(raw_s / n_windows * 1e6, 2),
            "window_checked_us": round(checked_s / n_windows * 1e6, 2),
            "window_overhead_us": round((checked_s - raw_s) / n_windows * 1e6, 2), "windows": n_windows,
            "first_pass_raw_s": round(first_raw, 3), "first_pass_checked_s": round(first_checked, 3),
            "first_pass_chunks": touched,
        }))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
