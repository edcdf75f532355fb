"""Hostile Hugging Face directories (trainer.models.hf.hf_dir): ``etrain generate``, ``[model] init_from`` and
``model.hf_config`` refuse them with exit 2 naming the file and the fix, never a traceback; a pickle is
never run; nan weights are refused naming the tensor; a seeded fuzz of headers, indexes and configs."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpointing.errors import ConfigError
from orchestrator.cli.main import main as etrain
from trainer.config import ModelConfig
from trainer.export.convert import WeightSource

TRAIN = ["data.max_bytes=20000", "data.seq_len=16", "train.global_batch=4", "train.micro_batch=2",
         "train.steps=1", "metrics.enabled=false"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny LlamaForCausalLM saved by transformers (config.json, model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("hf") / "llama")
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def copy(llama: str, tmp_path, name: str = "m") -> str:
    out = str(tmp_path / name)
    shutil.copytree(llama, out)
    return out


def header(path: str) -> tuple[int, dict, bytes]:
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(path: str, head: bytes | dict, data: bytes, n: int | None = None) -> None:
    blob = head if isinstance(head, bytes) else json.dumps(head).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if n is None else n) + blob + data)


def generate(capsys, path: str, *flags: str) -> tuple[int, str]:
    capsys.readouterr()
    code = etrain(["generate", path, "--prompt", "ab", "--max-new-tokens", "2", "--device", "cpu", *flags])
    return code, capsys.readouterr().err


@pytest.fixture
def train(monkeypatch, capsys):
    """``python -m trainer`` in this process, a model.source="hf" run starting from ``init_from``."""
    from trainer.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)

    def run(hf_config: str, init_from: str | None = None) -> tuple[int, str]:
        sets = [*TRAIN, 'model.source="hf"', f'model.hf_config="{hf_config}"']
        sets += [f'model.init_from="{init_from}"'] if init_from else []
        capsys.readouterr()
        code = main([a for s in sets for a in ("--set", s)] + ["--quiet"])
        return code, capsys.readouterr().err

    return run


# --- one test per defect ---------------------------------------------------------------------------


def _huge(p):
    _, h, data = header(p)
    write_st(p, h, data, n=2**40)


def _truncated(p):
    with open(p, "rb") as f:
        raw = f.read()
    with open(p, "wb") as f:
        f.write(raw[: len(raw) // 2])


def _lying_shape(p):
    _, h, data = header(p)
    h["model.norm.weight"]["shape"] = [16000]
    write_st(p, h, data)


def _overlap(p):
    _, h, data = header(p)
    h["model.norm.weight"]["data_offsets"] = [0, h["model.norm.weight"]["data_offsets"][1]
                                              - h["model.norm.weight"]["data_offsets"][0]]
    write_st(p, h, data)


@pytest.mark.parametrize("mutate, says", [(_huge, "16 MiB bound"), (_truncated, "the file holds"),
                                          (_lying_shape, "'model.norm.weight' is [16000]"),
                                          (_overlap, "overlap")])
def test_generate_refuses_a_hostile_safetensors_header(llama, tmp_path, capsys, mutate, says):
    d = copy(llama, tmp_path)
    mutate(os.path.join(d, "model.safetensors"))
    code, err = generate(capsys, d)
    assert code == 2 and "model.safetensors" in err and says in err and "download or export it again" in err, err


def _shard(d: str) -> None:
    """model.safetensors as two shards and an index, as transformers writes a large model."""
    tensors = load_file(os.path.join(d, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(d, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _point(d: str, tensor: str, target: str) -> None:
    path = os.path.join(d, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    index["weight_map"][tensor] = target
    with open(path, "w") as f:
        json.dump(index, f)


def test_an_index_cannot_reach_outside_its_directory(llama, tmp_path, capsys, train):
    outside = copy(llama, tmp_path, "outside")  # a valid file outside: read today, silently
    d = copy(llama, tmp_path)
    _shard(d)
    assert generate(capsys, d)[0] == 0 and train(llama, d)[0] == 0  # the sharded directory itself is fine
    for target in ("../outside/model.safetensors", f"{outside}/model.safetensors", "x/../../outside/model.safetensors"):
        _point(d, "model.norm.weight", target)
        for code, err in (generate(capsys, d), train(llama, d)):
            assert code == 2 and "model.safetensors.index.json" in err and "not a plain name" in err, (target, err)
    os.symlink(os.path.join(outside, "model.safetensors"), os.path.join(d, "link.safetensors"))
    _point(d, "model.norm.weight", "link.safetensors")
    for code, err in (generate(capsys, d), train(llama, d)):
        assert code == 2 and "outside" in err and "copy the file into the directory" in err, err


def test_a_hugging_face_cache_snapshot_may_link_into_its_blobs(llama, tmp_path, capsys):
    repo = tmp_path / "models--x--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name in os.listdir(llama):
        shutil.copyfile(os.path.join(llama, name), repo / "blobs" / name)
        os.symlink(f"../../blobs/{name}", snap / name)
    assert generate(capsys, str(snap))[0] == 0


@pytest.mark.parametrize("text, says", [("{not json", "config.json is not valid JSON"),
                                        ("[1, 2]", "holds a JSON list, not an object"),
                                        ('{"model_type": "llama", "hidden_size": "big"}', "hidden_size='big' must be"),
                                        ('{"model_type": 7}', "model_type=7 must be a string")])
def test_a_bad_config_json_is_named(llama, tmp_path, capsys, train, text, says):
    d = copy(llama, tmp_path)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(text)
    for code, err in (generate(capsys, d), train(d)):
        assert code == 2 and says in err and "Traceback" not in err, err


class _RunsCode:
    """A pickle whose loading would create the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_bin_is_refused_and_never_run(llama, tmp_path, capsys, train):
    marker = str(tmp_path / "code-ran")
    d = copy(llama, tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    torch.save({"model.norm.weight": _RunsCode(marker)}, os.path.join(d, "pytorch_model.bin"))
    for code, err in (generate(capsys, d), train(llama, d)):
        assert code == 2 and "pytorch_model.bin" in err and "weights_only=True" in err and "io.open" in err, err
    assert not os.path.exists(marker)


def test_weights_that_torch_load_weights_only_reads_are_used(llama, tmp_path, capsys, train):
    d = copy(llama, tmp_path)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))
    torch.save(tensors, os.path.join(d, "pytorch_model.bin"))
    assert generate(capsys, d)[0] == 0
    assert train(llama, d)[0] == 0


def test_nan_weights_are_refused_naming_the_tensor(llama, tmp_path, capsys, train):
    d = copy(llama, tmp_path)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"][3, 2] = float("inf")
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    for code, err in (train(llama, d), generate(capsys, d)):
        assert code == 2 and "'model.layers.0.mlp.up_proj.weight' holds 1 non-finite value" in err, err


def test_generate_refuses_a_config_that_leaves_weights_to_chance(llama, tmp_path, capsys):
    """transformers fills what the weights lack with random values; generate would sample noise."""
    d = copy(llama, tmp_path)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**config, "num_hidden_layers": 2}, f)
    code, err = generate(capsys, d)
    assert code == 2 and "the weights lack ['model.layers.1." in err, err


@pytest.mark.parametrize("flags, says", [(["--temperature", "nan"], "--temperature nan"),
                                         (["--temperature", "inf"], "--temperature inf"),
                                         (["--temperature", "-1"], "--temperature -1.0"),
                                         (["--device", "gpu0"], "--device 'gpu0'"),
                                         (["--device", "meta"], "--device 'meta'"),
                                         (["--device", "cuda:99"], "--device cuda:99")])
def test_generate_refuses_a_bad_flag_naming_it(llama, capsys, flags, says):
    code, err = generate(capsys, llama, *flags)
    assert code == 2 and says in err and "Traceback" not in err, err


def test_model_hf_config_errors_name_the_file(tmp_path, train):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 0}')
    code, err = train(str(tmp_path))
    assert code == 2 and "num_hidden_layers=0 must be an integer >= 1" in err and "config.json" in err, err


# --- the fuzz -----------------------------------------------------------------------------------


def _expected(llama: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(llama, "model.safetensors"))


def _load_all(d: str, want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``init_from`` reads of ``d`` for a model of ``want``'s names and shapes: the shapes checked, every
    tensor read."""
    src = WeightSource(d, ModelConfig(source="hf", hf_config=d))
    src.check({k: tuple(v.shape) for k, v in want.items()})
    return {k: src.read(k) for k in want}


def _mutate_header(rng: random.Random, path: str) -> str:
    _, h, data = header(path)
    raw = json.dumps(h).encode()
    names = sorted(k for k in h if k != "__metadata__")
    name = rng.choice(names)
    kind = rng.choice(["flip", "length", "truncate", "append", "shape", "dtype", "offsets", "keys", "json", "benign"])
    if kind == "benign":  # the same tensors, written otherwise: keys reordered, metadata, padding spaces
        items = sorted(h.items(), reverse=rng.random() < 0.5)
        head = dict(items) | ({"__metadata__": {"note": "x" * rng.randrange(20)}} if rng.random() < 0.5 else {})
        write_st(path, json.dumps(head, indent=rng.choice([None, 1])).encode() + b" " * rng.randrange(9), data)
    elif kind == "flip":
        blob = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        write_st(path, bytes(blob), data)
    elif kind == "length":
        size = 8 + len(raw) + len(data)
        n_new = rng.choice([0, 1, len(raw) - 1, len(raw) + 1, len(raw) + 8, size, 2**63, 2**64 - 1,
                            rng.randrange(2**32)])
        write_st(path, raw, data, n=n_new if n_new != len(raw) else 0)
    elif kind == "truncate":
        with open(path, "rb") as f:
            whole = f.read()
        with open(path, "wb") as f:
            f.write(whole[: rng.randrange(len(whole))])
    elif kind == "append":
        write_st(path, raw, data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
    elif kind == "shape":
        shape = list(h[name]["shape"])
        h[name]["shape"] = rng.choice([shape + [1, 2], shape[:-1], [d + rng.choice([-1, 1]) for d in shape],
                                       shape[::-1] + [2], [-1] + shape, [1.5], ["8"], [2**62, 2**62], [True], "x",
                                       None, [shape[0] * 2] + shape[1:]])
        write_st(path, h, data)
    elif kind == "dtype":
        h[name]["dtype"] = rng.choice(["F16", "BF16", "F64", "I32", "U32", "I8", "BOOL", "F4", "Q8_0", "", 5, None,
                                       ["F32"], "f32"])
        write_st(path, h, data)
    elif kind == "offsets":
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = rng.choice([[b, e + 1], [b - 1, e], [e, b], [0, 2**64], [-1, e], [b, e, 0], "x",
                                              [b + 4, e + 4], [rng.randrange(len(data)), rng.randrange(len(data))],
                                              [b, b], None, [str(b), e]])
        write_st(path, h, data)
    elif kind == "keys":
        op = rng.choice(["drop", "extra", "dup", "meta", "entry"])
        if op == "drop":
            del h[name][rng.choice(["dtype", "shape", "data_offsets"])]
        elif op == "extra":
            h[name]["extra"] = 1
        elif op == "meta":
            h["__metadata__"] = rng.choice([{"format": 5}, ["pt"], "pt", {"a": None}])
        elif op == "entry":
            h[name] = rng.choice([[], "x", 3, None, {}])
        if op == "dup":  # the same tensor twice, at other offsets: JSON text with a repeated key
            other = json.dumps(h[rng.choice(names)])
            blob = raw[:-1] + f', "{name}": {other}}}'.encode()
            write_st(path, blob, data)
        else:
            write_st(path, h, data)
    else:
        blob = rng.choice([b"[]", b'"x"', b"{", b"[" * 100_000, b'{"a": NaN}', b"\xff\xfe{}", b"", b"null",
                           b'{"x": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}'])
        write_st(path, blob, data)
    return kind


def _mutate_index(rng: random.Random, d: str, outside: str) -> str:
    path = os.path.join(d, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    wm = index["weight_map"]
    name = rng.choice(sorted(wm))
    kind = rng.choice(["path", "path", "structure", "bytes", "entries"])
    if kind == "path":
        choice = rng.choice(["../outside/model.safetensors", f"{outside}/model.safetensors", "", "a\\b.safetensors",
                             "./" + wm[name], "sub/../" + wm[name], "x.bin", 5, None, ["a"], "missing.safetensors",
                             "link.safetensors", "loop.safetensors", "fifo.safetensors", "\0.safetensors",
                             min(wm.values()), max(wm.values())])
        wm[name] = choice
    elif kind == "structure":
        index = rng.choice([[], "x", {"weight_map": []}, {"weight_map": "a"}, {"metadata": {}}, None,
                            {"weight_map": {}}, {"weight_map": {**wm, "ghost.weight": min(wm.values())}}])
    elif kind == "entries":
        del wm[name]  # a tensor the index does not name is still read from its file
    if kind == "bytes":
        blob = bytearray(json.dumps(index).encode())
        for _ in range(rng.randint(1, 3)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        with open(path, "wb") as f:
            f.write(bytes(blob))
    else:
        with open(path, "w") as f:
            json.dump(index, f)
    return kind


def _mutate_config(rng: random.Random, d: str) -> str:
    path = os.path.join(d, "config.json")
    with open(path) as f:
        config = json.load(f)
    kind = rng.choice(["value", "value", "drop", "bytes", "document"])
    if kind == "value":
        key = rng.choice(["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "max_position_embeddings", "head_dim", "model_type", "architectures",
                          "tie_word_embeddings", "rms_norm_eps", "hidden_act", "torch_dtype", "rope_parameters"])
        config[key] = rng.choice([None, "x", -1, 0, 1, 3, 7, 1.5, True, False, [], {}, "llama", ["Nope"], 1e308])
        text = json.dumps(config)
    elif kind == "drop":
        del config[rng.choice(sorted(config))]
        text = json.dumps(config)
    elif kind == "bytes":
        blob = bytearray(json.dumps(config).encode())
        for _ in range(rng.randint(1, 3)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        text = bytes(blob).decode("latin-1")
    else:
        text = rng.choice(["[]", "", "{", "null", '{"model_type": "llama", "hidden_size": 1e999}', "[" * 50_000,
                           json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "evil.Model"}})])
    with open(path, "w", encoding="latin-1") as f:
        f.write(text)
    return kind


def test_fuzz_hugging_face_directories(llama, tmp_path):
    """>= 200 seeded mutations of safetensors headers, a weight index and config.json, and pickles that
    would run code: each is refused with a ConfigError or read exactly as the original; never another
    exception, never code run, never a tensor other than the file's."""
    from trainer.generate import load

    rng = random.Random(26)
    want = _expected(llama)
    outside = copy(llama, tmp_path, "outside")
    got = _load_all(outside, want)  # the oracle's own check: the unmutated directory reads as the original
    assert all(torch.equal(got[k], want[k]) for k in want)
    outcomes: dict[str, list[int]] = {}

    def record(kind: str, fn) -> None:
        refused = 0
        try:
            got = fn()
        except ConfigError:
            refused = 1
        else:
            if isinstance(got, dict):  # accepted: exactly the original tensors
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), kind
        outcomes.setdefault(kind, [0, 0])[refused] += 1

    for i in range(130):  # safetensors headers
        d = copy(llama, tmp_path, f"st{i}")
        kind = _mutate_header(rng, os.path.join(d, "model.safetensors"))
        record(f"header/{kind}", lambda d=d: _load_all(d, want))
    base = copy(llama, tmp_path, "sharded")
    _shard(base)
    for i in range(60):  # the weight index
        d = str(tmp_path / f"ix{i}")
        shutil.copytree(base, d)
        os.symlink(os.path.join(outside, "model.safetensors"), os.path.join(d, "link.safetensors"))
        os.symlink("loop.safetensors", os.path.join(d, "loop.safetensors"))
        os.mkfifo(os.path.join(d, "fifo.safetensors"))  # refused unopened (opening it would block)
        kind = _mutate_index(rng, d, outside)
        record(f"index/{kind}", lambda d=d: _load_all(d, want))
    marker = str(tmp_path / "code-ran")
    for i in range(40):  # config.json, through generate's loader (transformers)
        d = copy(llama, tmp_path, f"cf{i}")
        kind = _mutate_config(rng, d)

        def through_generate(d=d):
            m = load(d, "cpu")
            return {k: v for k, v in m.forward.args[0].state_dict().items() if k in want}

        record(f"config/{kind}", through_generate)
    payloads = [_RunsCode(marker), {"w": _RunsCode(marker)}, [torch.zeros(2)], {"w": [torch.zeros(2)]},
                {"w": 3}, {5: torch.zeros(2)}, {"state_dict": want}, "weights"]
    for i in range(24):  # pickles: what would run code is refused unread, and so is anything but {name: tensor}
        d = copy(llama, tmp_path, f"pk{i}")
        os.remove(os.path.join(d, "model.safetensors"))
        target = os.path.join(d, rng.choice(["pytorch_model.bin", "weights.pt"]))
        torch.save(payloads[i % len(payloads)], target)
        if i >= len(payloads):  # and damaged ones
            with open(target, "r+b") as f:
                f.seek(rng.randrange(os.path.getsize(target)))
                f.write(bytes(rng.randrange(256) for _ in range(4)))
        record("pickle", lambda d=d: _load_all(d, want))
    total = sum(sum(v) for v in outcomes.values())
    assert total >= 250, outcomes
    assert not os.path.exists(marker)
    # lies about lengths and truncations are always refused; a tensor the index leaves out is still read
    for kind in ("header/length", "header/truncate", "header/append", "header/json", "pickle"):
        assert outcomes[kind][0] == 0, (kind, outcomes)
    assert outcomes["header/benign"][1] == outcomes["index/entries"][1] == 0, outcomes
    assert outcomes["config/drop"][0] > 0, outcomes
