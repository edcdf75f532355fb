"""The sample order and its single cursor: resumable at any world size; the default byte corpus.

Formats, tokenizers and the token cache: tests/trainer/test_data_formats.py."""

import os

import numpy as np
import pytest

from checkpointing.errors import ConfigError
from trainer.config import DataConfig
from trainer.data.corpus import Batcher, Corpus, SampleOrder, load_corpus, split_corpus, stdlib_files


def small_corpus(n_tokens=2000):
    arr = (np.arange(n_tokens) % 251).astype(np.uint8)
    return Corpus([arr], [], "text", 256)


def run_schedule(corpus, sizes_and_steps, global_batch=12, seq_len=8, seed=7):
    """Train-like walk: for each (dp_size, steps) chunk, concatenate every rank's samples per step."""
    seen, consumed = [], 0
    for dp, steps in sizes_and_steps:
        batchers = [Batcher(corpus, seq_len, seed, global_batch, r, dp) for r in range(dp)]
        for _ in range(steps):
            step = []
            for b in batchers:
                pos = b.local_positions(consumed)
                step.extend(b.order.sample_ids(pos.start, len(pos)))
            seen.extend(step)
            consumed += global_batch
    return seen


def test_resume_4_3_1_equals_uninterrupted():
    corpus = small_corpus()
    n = corpus.n_samples(8)
    # 60 steps x 12 samples crosses several epochs of n samples.
    straight = run_schedule(corpus, [(1, 60)])
    resized = run_schedule(corpus, [(4, 17), (3, 23), (1, 20)])
    assert resized == straight
    assert len(straight) > 2 * n


def test_no_sample_skipped_or_repeated_within_an_epoch():
    corpus = small_corpus()
    n = corpus.n_samples(8)
    seq = run_schedule(corpus, [(4, 10), (3, 10), (2, 10)])
    for epoch in range(len(seq) // n):
        assert sorted(seq[epoch * n : (epoch + 1) * n]) == list(range(n))
    # Different epochs are different orders.
    assert seq[:n] != seq[n : 2 * n]


def test_order_depends_on_seed_only():
    a, b, c = SampleOrder(100, 1), SampleOrder(100, 1), SampleOrder(100, 2)
    assert a.sample_ids(0, 250) == b.sample_ids(0, 250)
    assert a.sample_ids(0, 100) != c.sample_ids(0, 100)


def test_batch_is_next_token_shifted():
    corpus = small_corpus()
    b = Batcher(corpus, 8, 0, 4, 0, 1)
    x, y = b.tokens(b.local_positions(0))
    assert x.shape == (4, 8) and y.shape == (4, 8)
    assert (x[:, 1:] == y[:, :-1]).all()


def test_stdlib_corpus_is_listed_and_hashed():
    files = stdlib_files()
    assert files and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)
    c1 = load_corpus(DataConfig(max_bytes=300_000))
    c2 = load_corpus(DataConfig(max_bytes=300_000))
    assert sum(f.size for f in c1.files) == 300_000
    assert c1.n_tokens == 300_000 + len(c1.files) - 1  # a separator byte between files
    assert c1.digest == c2.digest and len(c1.files) >= 1
    assert c1.files[0].path == files[0]


def test_text_glob_and_tokens_bin(tmp_path):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text("hello world " * (i + 1))
    c = load_corpus(DataConfig(source=f"file://{tmp_path}/*.txt", cache_dir=str(tmp_path / "cache")))
    assert len(c.files) == 3 and c.kind == "text"
    assert bytes(c.window(0, c.n_tokens).astype(np.uint8)) == b"hello world \0" + b"hello world " * 2 + b"\0" + \
        b"hello world " * 3 + b"\0"
    toks = np.arange(5000, dtype=np.uint16) % 1000
    toks.tofile(tmp_path / "train.bin")
    t = load_corpus(DataConfig(source=str(tmp_path / "train.bin")))
    assert t.kind == "tokens" and t.n_tokens == 5000 and t.vocab_size == 1000
    assert list(t.window(10, 5)) == [10, 11, 12, 13, 14]


def test_window_crosses_file_borders():
    parts = [np.arange(0, 5, dtype=np.uint16), np.arange(5, 9, dtype=np.uint16), np.arange(9, 20, dtype=np.uint16)]
    c = Corpus(parts, [], "tokens", 20)
    assert list(c.window(3, 10)) == list(range(3, 13))


def test_missing_and_empty_corpus_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(DataConfig(source=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="matches no files"):
        load_corpus(DataConfig(source=f"file://{tmp_path}/*.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="holds no text"):
        load_corpus(DataConfig(source=f"file://{tmp_path}/*.txt", cache_dir=str(tmp_path / "cache")))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="token_dtype"):
        load_corpus(DataConfig(source=str(tmp_path / "odd.bin")))
    assert not os.path.exists(tmp_path / "nope")


def test_held_out_documents_of_the_default_corpus():
    """val_fraction holds out whole files of the default corpus, picked by the seed; spans read across gaps."""
    c = load_corpus(DataConfig(max_bytes=200_000))
    docs = [bytes(c.parts[0][a:b]) for a, b in zip(c.doc_offsets[0][:-1], c.doc_offsets[0][1:])]
    assert len(docs) == len(c.files) and b"".join(docs) == bytes(c.parts[0])
    train, val = split_corpus(c, 0.25, seed=3, seq_len=16)
    got_train = bytes(train.window(0, train.n_tokens).astype(np.uint8))
    got_val = bytes(val.window(0, val.n_tokens).astype(np.uint8))
    held = [d for d in docs if d in got_val]
    assert len(held) == round(0.25 * len(docs)) and got_val == b"".join(held)
    assert got_train == b"".join(d for d in docs if d not in held)
    assert train.n_tokens + val.n_tokens == c.n_tokens
    assert split_corpus(c, 0.25, seed=3, seq_len=16)[1].digest == val.digest != split_corpus(c, 0.25, 4, 16)[1].digest
    with pytest.raises(ConfigError, match="give eval.source"):
        split_corpus(load_corpus(DataConfig(max_bytes=100)), 0.5, seed=3, seq_len=16)


@pytest.mark.parametrize("as_bytes", [True, False])
def test_long_text_files_are_read_in_pieces_cut_after_newlines(monkeypatch, as_bytes):
    import io

    from trainer.data import sources as data_sources

    monkeypatch.setattr(data_sources, "_BLOCK", 4)
    for data in [b"", b"ab", b"abcd", b"ab\ncd\nef", b"abcdefgh", b"a\nbcdefgh\n", "h\u00e9\u00e9\u00e9\n\u00e9".encode()]:
        pieces = [(p if as_bytes else p.encode(), end) for p, end in data_sources._text_pieces(io.BytesIO(data),
                                                                                               as_bytes)]
        assert b"".join(p for p, _ in pieces) == data
        assert [end for _, end in pieces] == [False] * (len(pieces) - 1) + [True] * bool(data)
        # Cut after a newline, or at a full block (less a character split there, which the next piece starts).
        assert all(p.endswith(b"\n") or len(p) >= 4 - 3 * (not as_bytes) for p, end in pieces if not end)
