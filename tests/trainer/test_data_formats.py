"""Tokenizers, data formats and the token cache, with a BPE tokenizer trained here (no network).

    pytest tests/trainer/test_data_formats.py

Every text format goes through the token cache and decodes back to its
documents with EOS between them; the cache is built once (by one of the ranks
that start together) and reused; a run resumed 4 -> 3 -> 1 trains exactly the
samples of an uninterrupted one; bad input is one ConfigError (exit 2) that
names the field to fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from checkpointing.errors import ConfigError
from tests.harness import ROOT, run_ranks
from trainer.config import DataConfig
from trainer.config.load import load_config
from trainer.data.corpus import load_corpus, load_splits, prepare, tokenizer_vocab_size

EOS = "<|endoftext|>"


def make_docs(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["def", "return", "data", "token", "cache", "élan", "naïve", "über", "shard", "rank", "epoch", "\n"]
    return [f"doc {seed}.{i}: " + " ".join(rng.choice(words, size=int(rng.integers(8, 40)))) for i in range(n)]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Documents as JSON lines, Parquet and a directory of text files, and a BPE tokenizer trained on them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("data")
    docs = make_docs(240, 1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=420, special_tokens=[EOS], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    with open(d / "docs.jsonl", "w") as f:
        for i, t in enumerate(docs):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), d / "docs.parquet", row_group_size=64)
    (d / "txt").mkdir()
    for i, t in enumerate(docs):
        (d / "txt" / f"{i:04d}.txt").write_text(t)
    with open(d / "val.jsonl", "w") as f:
        for t in make_docs(30, 2):
            f.write(json.dumps({"text": t}) + "\n")
    return {"dir": d, "docs": docs, "tokenizer": str(d / "tokenizer.json"), "tok": tok}


SOURCES = {
    "jsonl": lambda d: {"source": str(d / "docs.jsonl")},
    "parquet": lambda d: {"source": str(d / "docs.parquet")},
    "text_dir": lambda d: {"source": str(d / "txt")},
    "hf_json": lambda d: {"source": "json", "format": "hf", "data_files": [str(d / "docs.jsonl")]},
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_each_format_through_the_token_cache(corpus_dir, tmp_path, name):
    cfg = DataConfig(tokenizer=corpus_dir["tokenizer"], cache_dir=str(tmp_path), **SOURCES[name](corpus_dir["dir"]))
    c = load_corpus(cfg)
    info = c.describe()
    assert info["cache_state"] == "built" and info["documents"] == len(corpus_dir["docs"])
    assert c.vocab_size == tokenizer_vocab_size(cfg) == corpus_dir["tok"].get_vocab_size()
    text = corpus_dir["tok"].decode(c.window(0, c.n_tokens).tolist(), skip_special_tokens=False)
    assert text == "".join(t + EOS for t in corpus_dir["docs"])  # documents packed, EOS after each

    header = os.path.join(info["cache"], "header.json")
    built_at = os.stat(header).st_mtime_ns
    again = load_corpus(cfg)
    assert again.describe()["cache_state"] == "reused" and again.digest == c.digest
    assert os.stat(header).st_mtime_ns == built_at
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []


def test_same_text_same_digest_any_format(corpus_dir, tmp_path):
    """The digest is of the tokens trained on, so the formats of one text agree; the tokenizer is in it."""
    digests = {n: load_corpus(DataConfig(tokenizer=corpus_dir["tokenizer"], cache_dir=str(tmp_path),
                                         **f(corpus_dir["dir"]))).digest for n, f in SOURCES.items()}
    assert len(set(digests.values())) == 1, digests
    as_bytes = load_corpus(DataConfig(cache_dir=str(tmp_path), **SOURCES["jsonl"](corpus_dir["dir"])))
    assert as_bytes.vocab_size == 256 and as_bytes.digest not in digests.values()
    assert bytes(as_bytes.window(0, 40).astype(np.uint8)) == (corpus_dir["docs"][0] + "\0").encode()[:40]


def test_tokenizer_directories(corpus_dir, tmp_path):
    """A directory with tokenizer.json (read with tokenizers alone), and one with only vocab.json and
    merges.txt (AutoTokenizer, offline): the same ids as the file, EOS from tokenizer_config.json."""
    from trainer.data.tokenize import load_tokenizer

    tok = corpus_dir["tok"]
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": EOS, "bos_token": EOS, "unk_token": EOS}
    (tmp_path / "fast").mkdir()
    tok.save(str(tmp_path / "fast" / "tokenizer.json"))
    (tmp_path / "slow").mkdir()
    tok.model.save(str(tmp_path / "slow"))  # vocab.json, merges.txt
    for d in ("fast", "slow"):
        (tmp_path / d / "tokenizer_config.json").write_text(json.dumps(config))
    want = [e.ids for e in tok.encode_batch(corpus_dir["docs"][:20], add_special_tokens=False)]
    for form in ("fast", "slow"):
        t = load_tokenizer(str(tmp_path / form))
        assert [list(a) for a in t.encode_batch(corpus_dir["docs"][:20])] == want, form
        assert (t.vocab_size, t.eos_id) == (tok.get_vocab_size(), tok.token_to_id(EOS)), form


def test_val_fraction_holds_out_whole_documents(corpus_dir, tmp_path):
    base = ['data.tokenizer="%s"' % corpus_dir["tokenizer"], f'data.source="{corpus_dir["dir"]}/docs.jsonl"',
            f'data.cache_dir="{tmp_path}"', "model.vocab_size=512", "eval.val_fraction=0.1"]
    train, val = load_splits(load_config(None, base))
    tok, docs = corpus_dir["tok"], corpus_dir["docs"]
    held = tok.decode(val.window(0, val.n_tokens).tolist(), skip_special_tokens=False).split(EOS)[:-1]
    kept = tok.decode(train.window(0, train.n_tokens).tolist(), skip_special_tokens=False).split(EOS)[:-1]
    assert len(held) == 24 and sorted(held + kept) == sorted(docs) and not set(held) & set(kept)
    assert kept == [d for d in docs if d not in set(held)]  # the rest, in order
    again, _ = load_splits(load_config(None, base))
    other, _ = load_splits(load_config(None, base + ["train.seed=99"]))
    assert again.digest == train.digest and other.digest != train.digest
    assert load_splits(load_config(None, base[:-1]))[1] is None

    own = load_splits(load_config(None, base[:-1] + [f'eval.source="{corpus_dir["dir"]}/val.jsonl"']))
    assert own[0].digest == load_corpus(load_config(None, base).data).digest
    assert tok.decode(own[1].window(0, own[1].n_tokens).tolist(), skip_special_tokens=False).startswith("doc 2.0:")


def test_python_factory_and_token_directories(tmp_path):
    from tests.data_jobs import token_documents

    cfg = DataConfig(source="python", factory="tests.data_jobs:token_documents", cache_dir=str(tmp_path))
    c = load_corpus(cfg)
    ds = token_documents({"seq_len": cfg.seq_len})
    want = np.concatenate([np.asarray(ds[i]) for i in range(len(ds))])
    assert np.array_equal(c.window(0, c.n_tokens), want)  # packed as given: the items carry their own EOS
    assert c.vocab_size == int(want.max()) + 1 and c.describe()["documents"] == len(ds)
    assert load_corpus(cfg).describe()["cache_state"] == "reused"

    (tmp_path / "bins").mkdir()
    for i in range(3):
        (np.arange(100, dtype=np.uint16) + 100 * i).tofile(tmp_path / "bins" / f"shard{i}.bin")
    t = load_corpus(DataConfig(source=str(tmp_path / "bins")))  # a directory of .bin files is tokens
    assert t.kind == "tokens" and t.n_tokens == 300 and list(t.window(95, 10)) == list(range(95, 105))
    (tmp_path / "bins" / "README.md").write_text("shards")
    with pytest.raises(ConfigError, match=r"several formats \(.bin, .md\); set data.format"):
        load_corpus(DataConfig(source=str(tmp_path / "bins")))


def test_prepare_builds_ahead_and_a_damaged_cache_is_rebuilt(corpus_dir, tmp_path):
    from trainer.data.token_cache import CorruptCacheError

    over = ['data.tokenizer="%s"' % corpus_dir["tokenizer"], f'data.source="{corpus_dir["dir"]}/txt"',
            f'data.cache_dir="{tmp_path}"', "model.vocab_size=512"]
    r = subprocess.run([sys.executable, "-m", "orchestrator", "data", "prepare", "examples/tiny.toml",
                        *sum((["--set", o] for o in over), [])], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("etrain: train: ") and "240 documents" in line and "cache built at" in line, line
    built = prepare(load_config(None, over))[0]
    assert built["cache_state"] == "reused" and line.endswith(built["cache"])

    with open(os.path.join(built["cache"], "tokens.bin"), "r+b") as f:
        f.write(b"\xff\xff")  # no longer what the header hashed
    damaged = load_corpus(load_config(None, over).data)  # found whole: its tokens are checked as they are read
    with pytest.raises(CorruptCacheError, match=r"tokens.bin bytes 0-\d+ differ .* moved aside"):
        damaged.window(0, 16)
    c = load_corpus(load_config(None, over).data)
    assert c.describe()["cache_state"] == "built" and c.digest == built["digest"]
    assert any(".damaged-" in p for p in os.listdir(tmp_path))


def test_bad_data_is_a_config_error_naming_the_fix(corpus_dir, tmp_path_factory):
    d, tok = corpus_dir["dir"], corpus_dir["tokenizer"]
    tmp_path, inputs = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("inputs")
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than the vocabulary of data.tokenizer="
                                          r".*420 ids; set model.vocab_size >= 420"):
        load_splits(load_config(None, [f'data.tokenizer="{tok}"', f'data.source="{d}/docs.jsonl"']))
    for source in ("docs.jsonl", "docs.parquet"):
        with pytest.raises(ConfigError, match="no (field|column) 'body'.*id, text.*set data.text_field"):
            load_corpus(DataConfig(source=str(d / source), text_field="body", cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="no column 'body'.*set data.text_field"):
        load_corpus(DataConfig(source="json", format="hf", data_files=[str(d / "docs.jsonl")], text_field="body",
                               cache_dir=str(tmp_path)))
    (inputs / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n\n")
    with pytest.raises(ConfigError, match="holds no text: every document is empty"):
        load_corpus(DataConfig(source=str(inputs / "empty.jsonl"), cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="returned an empty dataset"):
        load_corpus(DataConfig(source="python", factory="tests.data_jobs:no_documents", cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="without __len__ and __getitem__"):
        load_corpus(DataConfig(source="python", factory="tests.data_jobs:not_a_dataset", cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="data.tokenizer='/nope' does not exist"):
        load_corpus(DataConfig(source=str(d / "docs.jsonl"), tokenizer="/nope"))
    assert [p for p in os.listdir(tmp_path) if not p.endswith(".lock") and p != "hf-datasets"] == []  # none half-built


def raising_factory(table: dict):
    raise RuntimeError("no shards under /data/corpus")


class BrokenDataset:
    """A map-style dataset broken one way: ``len`` not a count, an item that raises, or ragged items."""

    def __init__(self, how: str):
        self.how = how

    def __len__(self):
        return "many" if self.how == "len" else 4  # noqa: PLE0303 - the breakage under test

    def __getitem__(self, i: int):
        if self.how == "item":
            raise KeyError(f"doc-{i}")
        return [[1, 2], [3]]


def broken_dataset(table: dict) -> BrokenDataset:
    return BrokenDataset(table["text_field"])


def test_garbage_files_and_broken_factories_are_config_errors(corpus_dir, tmp_path, monkeypatch):
    """A tokenizer directory transformers cannot read, or with no vocabulary; a file that is not what its
    format says (as data.source or data.data_files); a data.factory that raises, returns no count, serves
    items that raise or are ragged, or whose module fails to import: one ConfigError naming the field and
    the fix, never the reader's own exception."""
    (tmp_path / "garbage.parquet").write_bytes(np.random.default_rng(0).bytes(5000))
    good = (corpus_dir["dir"] / "docs.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(good[: len(good) // 2])
    (tmp_path / "garbage.txt.gz").write_bytes(b"\x1f\x8b" + np.random.default_rng(1).bytes(3000))
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('configured for another cluster')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, files in {"tok_list": {"tokenizer_config.json": "[]", "vocab.json": '{"a": 0}', "merges.txt": "#v\n"},
                        "tok_empty": {"tokenizer.json": json.dumps({"version": "1.0", "model": {
                            "type": "BPE", "vocab": {}, "merges": []}})}}.items():
        (tmp_path / name).mkdir()
        for fname, text in files.items():
            (tmp_path / name / fname).write_text(text)
    cache = str(tmp_path / "cache")
    jsonl = str(corpus_dir["dir"] / "docs.jsonl")
    cases = {
        r"data.tokenizer='.*tok_list': AutoTokenizer cannot load it \(AttributeError: .*\); fix or replace": DataConfig(
            source=jsonl, tokenizer=str(tmp_path / "tok_list"), cache_dir=cache),
        r"data.tokenizer='.*tok_empty' has an empty vocabulary": DataConfig(
            source=jsonl, tokenizer=str(tmp_path / "tok_empty"), cache_dir=cache),
        r"data.source: .*garbage.parquet cannot be read as parquet \(ArrowInvalid: .*\); replace or remove the "
        r"file, or set data.format": DataConfig(source=str(tmp_path / "garbage.parquet"), cache_dir=cache),
        r"data.source: .*cut.parquet cannot be read as parquet": DataConfig(source=str(tmp_path / "cut.parquet"),
                                                                          cache_dir=cache),
        r"data.source: .*garbage.txt.gz cannot be read as text \(BadGzipFile": DataConfig(
            source=str(tmp_path / "garbage.txt.gz"), cache_dir=cache),
        r"data.source='parquet' with data.data_files: datasets cannot read them \(ArrowInvalid: .*every file of "
        r"data.data_files must hold that format": DataConfig(source="parquet", format="hf", cache_dir=cache,
                                                             data_files=[str(tmp_path / "garbage.parquet")]),
        r"data.factory='tests.trainer.test_data_formats:raising_factory' raised RuntimeError: no shards under /data/corpus "
        r"at .*test_data_formats.py:\d+; fix the factory": DataConfig(
            source="python", factory="tests.trainer.test_data_formats:raising_factory", cache_dir=cache),
        r"data.factory='raises_on_import:make': module 'raises_on_import' does not import \(RuntimeError: "
        r"configured for another cluster\)": DataConfig(source="python", factory="raises_on_import:make",
                                                         cache_dir=cache),
        r"len\(\) of its BrokenDataset fails \(TypeError: .*\); __len__ must return the number of documents":
            DataConfig(source="python", factory="tests.trainer.test_data_formats:broken_dataset", text_field="len",
                       cache_dir=cache),
        r"item 0 cannot be read as token ids \(KeyError: 'doc-0' at .*test_data_formats.py:\d+\); __getitem__":
            DataConfig(source="python", factory="tests.trainer.test_data_formats:broken_dataset", text_field="item",
                       cache_dir=cache),
        r"item 0 cannot be read as token ids \(ValueError: .*inhomogeneous": DataConfig(
            source="python", factory="tests.trainer.test_data_formats:broken_dataset", text_field="ragged", cache_dir=cache),
    }
    for message, cfg in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_corpus(cfg)
    assert [p for p in os.listdir(cache) if not p.endswith(".lock") and p != "hf-datasets"] == []  # none half-built


def test_bad_data_exits_2(corpus_dir, tmp_path):
    """python -m trainer: a tokenizer larger than the vocabulary, a missing text_field, an empty dataset, a
    garbage Parquet file, a factory that raises: before any process group starts."""
    d = corpus_dir["dir"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    cases = {"model.vocab_size=256 is smaller than the vocabulary of data.tokenizer":
             [f'data.tokenizer="{corpus_dir["tokenizer"]}"', f'data.source="{d}/docs.jsonl"'],
             "has no column 'body'": [f'data.source="{d}/docs.parquet"', 'data.text_field="body"'],
             "holds no text": [f'data.source="{tmp_path}/empty"'],
             "cannot be read as parquet (ArrowInvalid": [f'data.source="{tmp_path}/garbage.parquet"'],
             "data.factory='tests.trainer.test_data_formats:raising_factory' raised RuntimeError":
                 ['data.source="python"', 'data.factory="tests.trainer.test_data_formats:raising_factory"']}
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 8)
    args = ["-m", "trainer", "--config", "examples/tiny.toml", "--set", f'data.cache_dir="{tmp_path}"']
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    procs = {message: subprocess.Popen([sys.executable, *args, *sum((["--set", s] for s in sets), [])], cwd=ROOT,
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for message, sets in cases.items()}  # side by side: each pays for importing torch
    for message, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, out + err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_resume_4_3_1_trains_exactly_the_uninterrupted_samples(corpus_dir, tmp_path):
    """Ranks that start together build the cache once; a run resized 4 -> 3 -> 1 through checkpoints
    consumes, position by position, the same token rows as one that never stopped (across an epoch)."""
    base = ['model.preset="tiny"', "model.vocab_size=512", "data.seq_len=32", "data.max_bytes=5000",
            f'data.tokenizer="{corpus_dir["tokenizer"]}"', f'data.source="{corpus_dir["dir"]}/docs.parquet"',
            f'data.cache_dir="{tmp_path}/cache"', "train.global_batch=12", "train.micro_batch=1",
            "metrics.enabled=false"]
    ckpt = base + [f'checkpoint.url="file://{tmp_path}/ckpt"', 'run_id="resize"', "checkpoint.async_save=false"]
    phases = [(4, 3, False), (3, 3, True), (1, 2, True)]
    resized, consumed = {}, 0
    for world, steps, resume in phases:
        res = run_ranks("tests.data_jobs:train_recording", world, {"overrides": ckpt, "steps": steps,
                                                                    "resume": resume}, timeout=240)
        states = [r["corpus"]["cache_state"] for r in res]
        if not resume:  # four ranks raced for an empty cache directory: one built, the others mapped it
            assert states.count("built") == 1 and set(states) <= {"built", "waited", "reused"}, states
        else:
            assert set(states) == {"reused"}, states
        assert all(r["start"] == consumed for r in res)
        for r in res:
            assert not set(r["rows"]) & set(resized)
            resized.update(r["rows"])
        consumed = res[0]["samples_consumed"]
    (straight,) = run_ranks("tests.data_jobs:train_recording", 1, {"overrides": base, "steps": 8})
    n_samples = straight["corpus"]["tokens"] // 32
    assert consumed == 96 > n_samples  # the schedule crossed an epoch boundary
    assert sorted(resized) == list(range(96))
    assert resized == straight["rows"]
