"""The model out and in: ``etrain ckpt export``, ``[model] init_from`` and ``etrain generate``.

One world-2 job trains a built-in ``tiny`` run under ZeRO-3 and saves step 2, then reloads that
step under tensor parallelism, pipeline parallelism and HSDP and saves it again as three other
runs. ``transformers`` loads the ``hf`` export as ``LlamaForCausalLM`` and its logits equal
etrain's own forward; the exports of the four layouts are bitwise equal; bad input exits 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from checkpointing.manifest import MANIFEST_NAME
from orchestrator.cli.main import main as etrain
from tests.harness import ROOT, run_ranks
from trainer.export.convert import export, model_config

BASE = ["data.max_bytes=60000", "data.seq_len=16", "train.global_batch=4", "train.micro_batch=2",
        "train.warmup_steps=1", "train.steps=20", "metrics.enabled=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Checkpoint root with step 2 of runs "z3" (ZeRO-3, world 2), "tp" (tp=2), "pp" (pp=2) and "hsdp"
    (dp_replicate=2 over FSDP), all the same weights."""
    root = tmp_path_factory.mktemp("export")
    url = f"file://{root}/ck"
    res = run_ranks("tests.ckpt_jobs:run_plan", 2, {"base": BASE + [f'checkpoint.url="{url}"'], "actions": [
        {"layout": ["parallel.zero_stage=3"], "train": 2, "save": "z3", "state": False},
        {"layout": ["parallel.tp=2"], "load": "z3", "save": "tp", "state": False},
        {"layout": ["parallel.pp=2"], "load": "z3", "save": "pp", "state": False},
        {"layout": ["parallel.dp_replicate=2", "parallel.zero_stage=3"], "load": "z3", "save": "hsdp", "state": False},
    ]}, timeout=600)
    for r in res[0]:
        assert r["saves"] == [(2, "committed", "")], r
    return root, url


def step_url(url: str, run: str) -> str:
    return f"{url}/{run}/checkpoints/step_000000002"


@pytest.mark.compat
def test_transformers_loads_the_hf_export_and_its_logits_match(runs):
    from transformers import AutoModelForCausalLM

    from trainer.models.decoder.model import Transformer

    root, url = runs
    out = str(root / "z3-hf")
    assert etrain(["ckpt", "export", step_url(url, "z3"), out, "--format", "hf"]) == 0
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    summary = export(step_url(url, "z3"), str(root / "z3.safetensors"), "safetensors")
    cfg = json.loads((root / "ck" / "z3" / "checkpoints" / "step_000000002" / MANIFEST_NAME).read_text())["config"]
    model = Transformer(model_config(cfg)).eval()
    model.load_state_dict(load_file(str(root / "z3.safetensors")))
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(input_ids=tokens).logits
    assert summary["tensors"] == len(model.state_dict())
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.compat
def test_exports_of_every_layout_are_bitwise_equal(runs):
    root, url = runs
    got = {}
    for run in ("z3", "tp", "pp", "hsdp"):
        path = str(root / f"{run}-all.safetensors")
        export(step_url(url, run), path, "safetensors")
        got[run] = load_file(path)
    assert got["z3"].keys() == got["tp"].keys() == got["pp"].keys() == got["hsdp"].keys()
    for k, v in got["z3"].items():
        assert all(torch.equal(v, got[run][k]) for run in ("tp", "pp", "hsdp")), k
    # torch format and bf16 hold the same values
    export(step_url(url, "tp"), str(root / "tp.pt"), "torch")
    pt = torch.load(str(root / "tp.pt"), weights_only=True)
    assert all(torch.equal(pt[k], v) for k, v in got["z3"].items()) and pt.keys() == got["z3"].keys()
    export(step_url(url, "pp"), str(root / "pp-bf16"), "hf", "bf16", shard_bytes=400_000)
    index = json.loads((root / "pp-bf16" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert load_file(str(root / "pp-bf16" / "model-00001-of-" f"{len(set(index['weight_map'].values())):05d}"
                         ".safetensors"))["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_bad_export_input_exits_2(runs, capsys):
    root, url = runs
    bad = root / "copy" / "z3" / "checkpoints"
    shutil.copytree(root / "ck" / "z3" / "checkpoints" / "step_000000002", bad / "step_000000002")
    burl = f"file://{root}/copy/z3/checkpoints/step_000000002"
    out = str(root / "bad-out")
    assert etrain(["ckpt", "export", step_url(url, "z3"), out, "--format", "onnx"]) == 2
    assert "unknown" in capsys.readouterr().err
    os.makedirs(out)
    open(os.path.join(out, "x"), "w").close()
    assert etrain(["ckpt", "export", step_url(url, "z3"), out]) == 2
    assert "--overwrite" in capsys.readouterr().err
    shard = sorted(p for p in os.listdir(bad / "step_000000002") if p.endswith(".distcp"))[0]
    with open(bad / "step_000000002" / shard, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    assert etrain(["ckpt", "export", burl, str(root / "o1.safetensors"), "--format", "safetensors"]) == 2
    assert "checksum" in capsys.readouterr().err
    os.remove(bad / "step_000000002" / MANIFEST_NAME)
    assert etrain(["ckpt", "export", burl, str(root / "o2.safetensors"), "--format", "safetensors"]) == 2
    assert "never committed" in capsys.readouterr().err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small random LlamaForCausalLM saved by transformers (safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("hf") / "llama")
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.compat
def test_init_from_loads_weights_into_any_layout_and_exports_them_unchanged(runs, hf_dir):
    from checkpointing.manager import CheckpointManager

    root, url = runs
    z3hf = str(root / "z3-hf-init")
    export(step_url(url, "z3"), z3hf, "hf")
    hf = ['model.source="hf"', f'model.hf_config="{hf_dir}"', f'model.init_from="{hf_dir}"']
    res = run_ranks("tests.ckpt_jobs:run_plan", 2, {"base": BASE + [f'checkpoint.url="{url}"'], "actions": [
        {"layout": hf + ["parallel.zero_stage=3"], "save": "hfrun", "state": False},
        {"layout": ["parallel.tp=2", f'model.init_from="{z3hf}"'], "save": "fromhf", "state": False},
        {"layout": ["parallel.pp=2", f'model.init_from="{step_url(url, "z3")}"'], "save": "fromckpt",
         "state": False},
        # a resumed run keeps its checkpoint's weights: init_from (here a path that does not exist) is not read
        {"layout": ['model.init_from="/nonexistent/weights"'], "load": "fromckpt", "train": 1, "save": "resumed",
         "state": False},
    ]}, timeout=600)
    assert [r["saves"] for r in res[0]] == [[(0, "committed", "")]] * 3 + [[(1, "committed", "")]], res[0]
    assert CheckpointManager(url, "resumed").read_manifest(1).trainer_state["weights_from"] == step_url(url, "z3")
    # the transformers model: etrain run -> export equals the original weights, bitwise
    export(f"{url}/hfrun", str(root / "hfrun.safetensors"), "safetensors")
    ours, original = load_file(str(root / "hfrun.safetensors")), load_file(os.path.join(hf_dir, "model.safetensors"))
    assert ours.keys() == original.keys()
    assert all(torch.equal(ours[k], original[k]) for k in ours)
    # ... and as an hf directory, its own names and config: transformers loads it, generate reads both
    export(f"{url}/hfrun", str(root / "hfrun-hf"), "hf")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(root / "hfrun-hf")).state_dict()
    assert all(torch.equal(loaded[k], original[k]) for k in original)
    from trainer.generate import generate, load

    texts = {generate(load(src), "ab", max_new_tokens=8, temperature=0) for src in (f"{url}/hfrun",
                                                                                   str(root / "hfrun-hf"))}
    assert len(texts) == 1, texts
    # the built-in model from its own hf export (rotary rows permuted back) and from a checkpoint URL
    ref = load_file(str(root / "z3-all.safetensors")) if os.path.exists(root / "z3-all.safetensors") else None
    if ref is None:
        export(step_url(url, "z3"), str(root / "z3-all.safetensors"), "safetensors")
        ref = load_file(str(root / "z3-all.safetensors"))
    for run in ("fromhf", "fromckpt"):
        path = str(root / f"{run}.safetensors")
        export(f"{url}/{run}", path, "safetensors")
        got = load_file(path)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), run
    m = CheckpointManager(url, "fromckpt").read_manifest(0)
    assert m.trainer_state["weights_from"] == step_url(url, "z3") and m.config["model"]["init_from"]


def test_init_from_with_other_shapes_exits_2_naming_the_tensor(hf_dir, tmp_path, capsys, monkeypatch):
    from trainer.cli import main as train

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    argv = ["--set", f'model.init_from="{hf_dir}"', "--set", "data.max_bytes=20000", "--set", "train.steps=1"]
    assert train(argv) == 2  # the built-in tiny model (dim 128) from a Llama of hidden size 64
    err = capsys.readouterr().err
    assert "'model.embed_tokens.weight' has shape [256, 64], the model's 'tok_embeddings.weight' has shape " \
           "[256, 128]" in err, err
    assert train(argv[2:] + ["--set", f'model.init_from="{tmp_path}"']) == 2
    assert "holds no .safetensors weights" in capsys.readouterr().err
    from orchestrator.cli.main import main as etrain  # `etrain run` checks it on the driver, before Ray starts

    assert etrain(["run", "examples/tiny.toml", "--store", f"file://{tmp_path}/runs", *argv]) == 2
    assert "'model.embed_tokens.weight' has shape [256, 64]" in capsys.readouterr().err


@pytest.mark.compat
def test_generate_is_deterministic_at_temperature_0_from_a_checkpoint_and_its_export(runs, capsys):
    root, url = runs
    out = str(root / "gen-hf")
    export(step_url(url, "tp"), out, "hf")
    texts = []
    for source in (f"{url}/tp", step_url(url, "z3"), out):
        assert etrain(["generate", source, "--prompt", "The ", "--max-new-tokens", "24", "--temperature", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] and texts[0].startswith("The ") and len(texts[0]) > 4, texts
    sampled = []
    for _ in range(2):
        assert etrain(["generate", out, "--prompt", "a", "--max-new-tokens", "16", "--top-k", "20",
                       "--seed", "3"]) == 0
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1]
    assert etrain(["generate", str(root / "nothing-here"), "--prompt", "a"]) == 2


def test_generate_runs_a_checkpoints_factory_only_when_trusted(tmp_path):
    """A checkpoint of a Python factory's model names, in its manifest, a module to import: `etrain generate`
    refuses it (exit 2, naming --trust-code) without importing that module, and loads it with --trust-code."""
    marker = tmp_path / "imported"
    (tmp_path / "planted_factory.py").write_text(
        "import pathlib\npathlib.Path(%r).write_text('ran')\nfrom tests.custom_model import build\n" % str(marker))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{tmp_path}", OMP_NUM_THREADS="1")
    url = f"file://{tmp_path}/ckpt"
    sets = ['model.source="python"', 'model.factory="planted_factory:build"', "model.vocab_size=256",
            "train.steps=1", "train.warmup_steps=0", "data.max_bytes=20000", "metrics.enabled=false",
            f'checkpoint.url="{url}"', 'run_id="fac"']
    r = subprocess.run([sys.executable, "-m", "trainer", "--config", "examples/tiny.toml", "--quiet",
                        *[a for s in sets for a in ("--set", s)]], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    marker.unlink()
    gen = [sys.executable, "-m", "orchestrator", "generate", f"{url}/fac", "--prompt", "ab", "--max-new-tokens", "2",
           "--temperature", "0"]
    r = subprocess.run(gen, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--trust-code" in r.stderr and "planted_factory:build" in r.stderr, r.stderr
    assert not marker.exists()  # refused before anything was imported
    r = subprocess.run([*gen, "--trust-code"], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert marker.exists()
