"""The token cache's integrity: every byte is covered, damage is found before a token of it is used.

    pytest tests/trainer/test_token_cache.py

100 KB overwritten in the middle of tokens.bin is found on the first read of
that span (and the cache is built again at the next start); a run on a damaged
cache stops with exit 1 naming it; a cache of the older format, whose hashes
covered only the ends of tokens.bin, is never opened; and a seeded fuzz of
300 mutations of the cache's files (bit flips, overwrites, truncation,
extension, removal, garbage and ill-typed JSON, headers rewritten with the
wrong dtype or sizes) ends every time in a detection or in exactly the
original content, never in a traceback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from checkpointing.errors import EtrainError
from tests.harness import ROOT
from trainer.config import DataConfig
from trainer.data.corpus import load_corpus
from trainer.data.token_cache import open_or_build


def write_jsonl(path, n_docs: int, doc_bytes: int, seed: int = 0) -> bytes:
    """JSON lines of random lowercase text; the byte tokens they make (each document, then EOS 0)."""
    rng = np.random.default_rng(seed)
    docs = [bytes(rng.integers(97, 123, size=doc_bytes, dtype=np.uint8)).decode() for _ in range(n_docs)]
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return b"".join(d.encode() + b"\0" for d in docs)


def test_damage_in_the_middle_is_found_before_use(tmp_path):
    """The issue's case: 100 KB overwritten in the middle of a 3 MB tokens.bin."""
    want = write_jsonl(tmp_path / "docs.jsonl", 3000, 1000)
    cfg = DataConfig(source=str(tmp_path / "docs.jsonl"), cache_dir=str(tmp_path / "cache"))
    built = load_corpus(cfg)
    path = built.describe()["cache"]
    assert bytes(built.window(0, built.n_tokens).astype(np.uint8)) == want
    del built
    with open(os.path.join(path, "tokens.bin"), "r+b") as f:
        f.seek(1_500_000)
        f.write(os.urandom(100_000))

    damaged = load_corpus(cfg)  # found whole (opening reads no token), same header, same digest
    assert damaged.describe()["cache_state"] == "reused"
    assert bytes(damaged.window(0, 1000).astype(np.uint8)) == want[:1000]  # an intact chunk reads as ever
    with pytest.raises(EtrainError, match=r"tokens.bin bytes 1048576-2097152 differ from the hash .* moved "
                                                r"aside .* the next start builds it again"):
        damaged.window(1_400_000, 200_000)
    assert not os.path.exists(path) and any(".damaged-" in p for p in os.listdir(tmp_path / "cache"))

    again = load_corpus(cfg)
    assert again.describe()["cache_state"] == "built" and again.digest == damaged.digest
    assert bytes(again.window(0, again.n_tokens).astype(np.uint8)) == want


def test_a_run_on_a_damaged_cache_stops_with_exit_1(tmp_path):
    """python -m trainer on a cache damaged after it was built: exit 1 naming the cache, no step trained."""
    write_jsonl(tmp_path / "docs.jsonl", 200, 500)
    over = [f'data.source="{tmp_path}/docs.jsonl"', f'data.cache_dir="{tmp_path}/cache"', "train.steps=2",
            "metrics.enabled=false"]
    path = load_corpus(DataConfig(source=str(tmp_path / "docs.jsonl"), cache_dir=str(tmp_path / "cache")))
    path = path.describe()["cache"]
    with open(os.path.join(path, "tokens.bin"), "r+b") as f:
        f.seek(50_000)
        f.write(b"\x7f" * 100)
    r = subprocess.run([sys.executable, "-m", "trainer", "--config", "examples/tiny.toml", "--log-file",
                        str(tmp_path / "steps.jsonl"), *[a for o in over for a in ("--set", o)]],
                       cwd=ROOT, check=False, capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"etrain: error: token cache {path}: tokens.bin bytes 0-" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "steps.jsonl").exists() or (tmp_path / "steps.jsonl").read_text() == ""
    assert not os.path.exists(path)  # moved aside: the next start builds it again


KEY_DOC = {"format": "test", "files": [["a", 1, "0"]]}


def test_a_cache_of_the_older_format_is_built_again(tmp_path, caplog):
    """Format 1 hashed the first and last MiB of tokens.bin only: a cache it wrote, damaged in the
    middle, passed its checks. It is never opened now (another key), and the cache is built afresh."""
    tokens = np.random.default_rng(1).integers(0, 60000, size=3 << 20, dtype=np.uint16)
    index = np.array([0, 1 << 20, len(tokens)], dtype=np.int64)
    old = tmp_path / hashlib.sha256(json.dumps({"version": 1, **KEY_DOC}, sort_keys=True,
                                               separators=(",", ":")).encode()).hexdigest()[:32]
    old.mkdir()
    damaged = tokens.copy()
    damaged[3 << 19 : (3 << 19) + 50_000] = 7
    damaged.tofile(old / "tokens.bin")
    index.tofile(old / "index.bin")
    data = tokens.tobytes()
    edges = xxhash.xxh64(data[: 1 << 20] + data[-(1 << 20):]).hexdigest()
    header = {"version": 1, "key": old.name, "dtype": "uint16", "n_tokens": len(tokens), "n_docs": 2,
              "eos_id": None, "max_id": int(tokens.max()), "tokens_xxh64": xxhash.xxh64(data).hexdigest(),
              "edges_xxh64": edges, "index_xxh64": xxhash.xxh64(index.tobytes()).hexdigest(), "inputs": KEY_DOC,
              "source_bytes": 0, "build_seconds": 0.1, "built_by": "old", "created": 0.0}
    (old / "header.json").write_text(json.dumps(header))

    def build(writer):
        writer.add([tokens[: 1 << 20], tokens[1 << 20 :]], [True, True])

    with caplog.at_level(logging.WARNING, logger="etrain"):
        cache = open_or_build(str(tmp_path), KEY_DOC, np.uint16, None, build)
    assert cache.state == "built" and cache.path != str(old)
    assert np.array_equal(cache.tokens[0 : len(tokens)], tokens)
    assert cache.digest == xxhash.xxh64(f"{header['tokens_xxh64']}:{header['index_xxh64']}".encode()).hexdigest()
    assert f"token cache {old} has an older format (1)" in caplog.text and "delete" in caplog.text


# The fuzz: a small cache of several chunks, its files mutated one way at a time.

CHUNK = 256
FIELDS = ("version", "key", "dtype", "n_tokens", "n_docs", "eos_id", "max_id", "tokens_xxh64", "index_xxh64",
          "chunk_bytes", "chunks_xxh3", "inputs", "source_bytes", "build_seconds", "built_by", "created",
          "header_xxh3")


def _docs(rng) -> list[np.ndarray]:
    return [rng.integers(1, 1000, size=int(rng.integers(1, 120)), dtype=np.uint16) for _ in range(40)]


def _rehash(doc: dict) -> dict:
    """A header rewritten consistently: its own hash recomputed after a field changed."""
    rest = {k: v for k, v in doc.items() if k != "header_xxh3"}
    return {**rest, "header_xxh3": xxhash.xxh3_64_hexdigest(json.dumps(rest, sort_keys=True,
                                                                         separators=(",", ":")).encode())}


def _mutate(rng, final: str, header: dict) -> str:
    """One seeded mutation of the committed cache at ``final``; what it did."""
    name = str(rng.choice(["tokens.bin", "chunks.bin", "index.bin", "header.json"]))
    p = os.path.join(final, name)
    with open(p, "rb") as f:
        data = bytearray(f.read())
    kind = int(rng.integers(0, 11))
    if kind == 0:  # bit flips
        for _ in range(int(rng.integers(1, 4))):
            bit = int(rng.integers(0, len(data) * 8))
            data[bit // 8] ^= 1 << (bit % 8)
    elif kind == 1:  # a span overwritten
        at = int(rng.integers(0, len(data)))
        n = len(data[at : at + int(rng.integers(1, 64))])
        data[at : at + n] = rng.bytes(n)
    elif kind == 2:
        data = data[: int(rng.integers(0, len(data)))]
    elif kind == 3:
        data += rng.bytes(int(rng.integers(1, 300))) if rng.random() < 0.5 else b"\0" * int(rng.integers(1, 300))
    elif kind == 4:
        os.remove(p)
        if rng.random() < 0.3:
            os.mkdir(p)  # a directory where a file was
        return f"{name}: removed"
    elif kind == 5:  # header: JSON of another shape, or not JSON
        name, p = "header.json", os.path.join(final, "header.json")
        data = bytearray(str(rng.choice(['[]', '{}', 'null', '"x"', '12', '{"version": 2', '[' * 5000 + ']' * 5000,
                                         '\ufeff{}', 'NaN', ''])).encode()) + rng.bytes(int(rng.integers(0, 3)))
    elif kind == 6:  # header: a field dropped, added, or of the wrong type
        name, p = "header.json", os.path.join(final, "header.json")
        doc = dict(header)
        field = str(rng.choice(FIELDS))
        choice = int(rng.integers(0, 3))
        if choice == 0:
            del doc[field]
        elif choice == 1:
            doc["extra"] = 1
        else:
            doc[field] = [None, True, "1", 1.5, -1, [], {}, 2**70][int(rng.integers(0, 8))]
        data = bytearray(json.dumps(doc).encode())
    elif kind == 7:  # header rewritten consistently with the wrong dtype, sizes or hashes
        name, p = "header.json", os.path.join(final, "header.json")
        field, values = [("dtype", ["uint8", "uint32", "float32", "<U8", "int64", "object"]),
                         ("n_tokens", [0, -1, 1, header["n_tokens"] - 1, header["n_tokens"] + 1, 2**63]),
                         ("n_docs", [0, 1, header["n_docs"] - 1, header["n_docs"] + 1, 2**40]),
                         ("chunk_bytes", [0, 1, 3, 63, 128, 512, 2**31, -256]),
                         ("chunks_xxh3", ["0" * 16, ""]), ("index_xxh64", ["0" * 16, "zz"]),
                         ("version", [1, 3, 0]), ("key", ["", "0" * 32])][int(rng.integers(0, 8))]
        data = bytearray(json.dumps(_rehash({**header, field: values[int(rng.integers(0, len(values)))]})).encode())
    elif kind == 8:  # header: whitespace added, the one change of its bytes that changes nothing
        name, p = "header.json", os.path.join(final, "header.json")
        data = bytearray(b"\n " + json.dumps(header, indent=int(rng.integers(0, 4))).encode() + b" \n")
    elif kind == 9:  # two files swapped
        other = os.path.join(final, "index.bin" if name != "index.bin" else "chunks.bin")
        tmp = p + ".swap"
        os.rename(p, tmp)
        os.rename(other, p)
        os.rename(tmp, other)
        return f"{name} <-> {os.path.basename(other)}"
    else:  # a file of another cache's size: zeros
        data = bytearray(len(data) + int(rng.choice([-8, 8, 2, -2])))
    with open(p, "wb") as f:
        f.write(data)
    return f"{name}: kind {kind}"


def test_fuzz_300_mutations_are_detected_or_harmless(tmp_path):
    from trainer.data.token_cache import CorruptCacheError

    rng = np.random.default_rng(26)
    docs = _docs(rng)
    want = np.concatenate(docs)
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    builds = []

    def build(writer):
        builds.append(1)
        writer.add(docs, [True] * len(docs))

    cache_dir = str(tmp_path / "cache")
    first = open_or_build(cache_dir, KEY_DOC, np.uint16, None, build, chunk_bytes=CHUNK)
    final, digest, header = first.path, first.digest, dict(first.header)
    assert len(want) * 2 > 6 * CHUNK  # several chunks
    pristine = str(tmp_path / "pristine")
    shutil.copytree(final, pristine)
    outcomes: dict[str, int] = {"at open": 0, "on read": 0, "harmless": 0}
    for i in range(300):
        shutil.rmtree(final, ignore_errors=True)
        for p in os.listdir(cache_dir):
            if ".damaged-" in p:
                shutil.rmtree(os.path.join(cache_dir, p))
        shutil.copytree(pristine, final)
        what = _mutate(rng, final, header)
        n_builds = len(builds)
        cache = open_or_build(cache_dir, KEY_DOC, np.uint16, None, build, chunk_bytes=CHUNK)
        try:
            got = np.array(cache.tokens[0 : len(cache.tokens)])
        except CorruptCacheError:
            outcomes["on read"] += 1
            assert not os.path.exists(final), what  # moved aside: the next open builds it again
            cache = open_or_build(cache_dir, KEY_DOC, np.uint16, None, build, chunk_bytes=CHUNK)
            got = np.array(cache.tokens[0 : len(cache.tokens)])
            assert cache.state == "built", what
        else:
            outcomes["at open" if len(builds) > n_builds else "harmless"] += 1
        # Whatever happened, what is used is exactly what was built, under the same digest.
        assert np.array_equal(got, want) and np.array_equal(cache.doc_starts, starts), (i, what)
        assert cache.digest == digest, (i, what)
        assert {k: cache.header[k] for k in ("dtype", "n_tokens", "n_docs", "max_id", "eos_id")} == \
            {k: header[k] for k in ("dtype", "n_tokens", "n_docs", "max_id", "eos_id")}, (i, what)
    assert min(outcomes.values()) > 0, outcomes  # every path taken
    assert outcomes["at open"] + outcomes["on read"] > 250, outcomes
