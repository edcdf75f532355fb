"""Bring your own model: transformers GPT-2 and Llama from local configs, and a python factory.

The reference is a plain single-process PyTorch loop written here: the model built by
``transformers`` itself (AutoModelForCausalLM.from_config under the same seed), torch.optim.AdamW,
torch's clip_grad_norm_, the same batches; no etrain training code. Every layout must match its
first 5 losses within 1e-4 relative (fp32).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.harness import run_ranks
from tests.checkpointing.test_input_safety import run_module

STEPS = 5
SEED = 1234
TRAIN = ["data.max_bytes=400000", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
         "train.warmup_steps=0", "train.min_lr_ratio=1.0", "train.lr=3e-3", "train.grad_clip=0.5",
         f"train.seed={SEED}", "metrics.enabled=false"]

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, doc in (("llama", LLAMA), ("gpt2", GPT2)):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(doc))
        out[name] = str(d)
    return out


def hf(path: str) -> list[str]:
    return ['model.source="hf"', f'model.hf_config="{path}"']


def plain_setup(hf_dir: str):
    """(model, optimizer, batcher) of the plain loop: transformers' model under the seed, torch's AdamW."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.config.load import load_config
    from trainer.data.corpus import Batcher, load_corpus

    cfg = load_config(None, TRAIN)
    config = AutoConfig.from_pretrained(os.path.join(hf_dir, "config.json"))
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    batcher = Batcher(load_corpus(cfg.data), 32, SEED, 8, 0, 1)  # reading the data is not training code
    return model, opt, batcher


def reference_losses(hf_dir: str) -> list[float]:
    """The plain loop: transformers' model, torch's AdamW and clipping, the run's batches."""
    model, opt, batcher = plain_setup(hf_dir)
    losses = []
    for step in range(STEPS):
        x, y = batcher.tokens(batcher.local_positions(step * 8))
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_close(name: str, got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= 1e-4 * abs(b), f"{name} step {step + 1}: {a} vs plain loop {b}"
    assert ref[-1] < ref[0]


@pytest.fixture(scope="module")
def runs(configs):
    llama, gpt2 = hf(configs["llama"]), hf(configs["gpt2"])
    w2 = run_ranks("tests.jobs:train_layouts", 2, {"base": TRAIN, "steps": STEPS, "layouts": [
        ("llama_zero0", llama + ["parallel.zero_stage=0"]),
        ("llama_zero3", llama + ["parallel.zero_stage=3"]),
        ("gpt2_zero0", gpt2 + ["parallel.zero_stage=0"]),
        ("gpt2_zero3", gpt2 + ["parallel.zero_stage=3"]),
        ("llama_pp2_gpipe", llama + ["parallel.pp=2", 'parallel.pp_schedule="gpipe"', "parallel.zero_stage=0"]),
    ]}, timeout=600)
    w4 = run_ranks("tests.jobs:train_layouts", 4, {"base": TRAIN, "steps": STEPS, "layouts": [
        ("llama_hsdp", llama + ["parallel.dp_replicate=2", "parallel.zero_stage=3"]),
        ("gpt2_hsdp", gpt2 + ["parallel.dp_replicate=2", "parallel.zero_stage=3"]),
        ("llama_tp2_zero1", llama + ["parallel.tp=2", "parallel.zero_stage=1"]),
        ("llama_tp2_zero3_ac", llama + ["parallel.tp=2", "parallel.zero_stage=3",
                                        'parallel.activation_checkpoint="full"']),
        ("llama_pp2_dp2_1f1b", llama + ["parallel.pp=2", "parallel.zero_stage=3",
                                        'model.pp_split_points=["model.layers.1"]']),
        ("bf16_llama_tp2_zero2", llama + ["parallel.tp=2", "parallel.zero_stage=2",
                                          'parallel.mixed_precision="bf16"']),
        ("bf16_gpt2_zero3", gpt2 + ["parallel.dp_replicate=2", "parallel.zero_stage=3",
                                    'parallel.mixed_precision="bf16"']),
    ]}, timeout=600)
    return {**w2[0], **w4[0], "_w4": w4}


@pytest.mark.compat
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hf_models_match_a_plain_transformers_loop(model, configs, runs):
    ref = reference_losses(configs[model])
    names = [n for n in runs if n.startswith(model)]
    assert len(names) >= 3
    for name in names:
        assert_close(name, runs[name]["losses"], ref)
    # Every rank agrees (the loss is all-reduced), TP and HSDP included.
    for rank_res in runs["_w4"]:
        for name in rank_res:
            assert rank_res[name]["losses"] == runs[name]["losses"]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hf_models_train_in_bf16(model, configs, runs):
    """bf16 compute with fp32 masters (TP x ZeRO-2, HSDP x ZeRO-3): within 2e-2 of the fp32 plain loop, which
    is bf16's rounding (8 bits of mantissa) carried through a few steps."""
    ref = reference_losses(configs[model])
    (name,) = [n for n in runs if n.startswith(f"bf16_{model}")]
    for step, (a, b) in enumerate(zip(runs[name]["losses"], ref)):
        assert abs(a - b) <= 2e-2 * abs(b), f"{name} step {step + 1}: {a} vs plain fp32 loop {b}"


@pytest.mark.compat
def test_checkpoints_keep_the_models_own_names(configs, tmp_path):
    """A ZeRO-3 + TP checkpoint of the HF Llama names its tensors as transformers does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    url = f"file://{tmp_path}/ckpt"
    llama = hf(configs["llama"])
    res = run_ranks("tests.ckpt_jobs:run_plan", 4, {"base": TRAIN + llama + [f'checkpoint.url="{url}"'], "actions": [
        {"layout": ["parallel.tp=2", "parallel.zero_stage=3"], "train": 1, "save": "names", "state": True}]})
    saved = {k[len("model."):] for k in res[0][0]["state"] if k.startswith("model.")}
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(configs["llama"]))
    assert saved == {n for n, _ in ref.named_parameters()}
    assert res[0][0]["saves"] == [(1, "committed", "")]


CUSTOM = ['model.source="python"', 'model.factory="tests.custom_model:build"', "model.args={width = 48, depth = 3}"]


def test_python_factory_trains_checkpoints_and_resumes_at_another_world_size(tmp_path):
    """World 2 (ZeRO-3) trains 3 steps and commits; world 1 resumes and trains 2 more: the same losses and
    weights as 5 uninterrupted steps at world 1."""
    base = TRAIN + CUSTOM + [f'checkpoint.url="file://{tmp_path}/ckpt"', 'model.loss="tests.custom_model:smoothed_loss"']
    first = run_ranks("tests.ckpt_jobs:run_plan", 2, {"base": base, "actions": [
        {"layout": ["parallel.zero_stage=3"], "train": 3, "save": "custom", "state": False}]})
    resumed = run_ranks("tests.ckpt_jobs:run_plan", 1, {"base": base, "actions": [
        {"load": "custom", "train": 2},
        {"train": STEPS}]})[0]
    assert first[0][0]["saves"] == [(3, "committed", "")]
    again, straight = resumed
    assert again["loaded_step"] == 3
    assert again["losses"] == pytest.approx(straight["losses"][3:], rel=1e-4)
    assert first[0][0]["losses"] == pytest.approx(straight["losses"][:3], rel=1e-4)
    for k, v in straight["state"].items():
        torch.testing.assert_close(again["state"][k], v, rtol=1e-4, atol=1e-6, msg=k)
    assert {k.split(".")[1] for k in straight["state"] if k.startswith("model.")} == {
        "embed", "trunk", "final_norm", "head"}


def test_python_factory_with_its_own_tp_plan_matches_world_1():
    res = run_ranks("tests.jobs:train_layouts", 2, {"base": TRAIN + CUSTOM, "steps": 3, "layouts": [
        ("tp2", ["parallel.tp=2", "parallel.zero_stage=0", 'model.tp_plan="tests.custom_model:tp_plan"'])]})
    ref = run_ranks("tests.jobs:train_layouts", 1, {"base": TRAIN + CUSTOM, "steps": 3, "layouts": [("ref", [])]})
    assert res[0]["tp2"]["losses"] == pytest.approx(ref[0]["ref"]["losses"], rel=1e-4)


BAD = [
    (['model.source="python"', 'model.factory="no_such_pkg.models:build"'],
     "model.factory='no_such_pkg.models:build': module 'no_such_pkg.models' does not import"),
    (['model.source="python"', 'model.factory="tests.custom_model:not_a_module"'],
     "returned dict, not a torch.nn.Module"),
    (['model.source="python"', 'model.factory="tests.custom_model:missing"'], "has no attribute 'missing'"),
    (['model.source="hf"', 'model.hf_config="/nonexistent/llama"'], "model.hf_config='/nonexistent/llama' does not exist"),
    (CUSTOM + ["parallel.tp=2"], "the model declares no tensor-parallel plan"),
    (CUSTOM + ["parallel.pp=2"], "not from a python factory's model"),
]


def test_bad_models_exit_2_before_any_process_group():
    """Each case a real `python -m trainer` (WORLD_SIZE=2, no peer: one that got as far as a process group
    would hang, not exit 2); run side by side."""
    import subprocess

    from tests.checkpointing.test_input_safety import PY, ROOT

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    procs = []
    for overrides, message in BAD:
        args = [a for o in overrides for a in ("--set", o)]
        procs.append((subprocess.Popen([PY, "-m", "trainer", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True), message))
    for p, message in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 2, err
        assert message in err, err


@pytest.mark.slow  # about 12 s: trainer processes, each importing transformers
def test_hf_model_without_a_plan_refuses_tp_and_vocab_must_fit(configs, tmp_path):
    r = run_module("trainer", ["--set", 'model.source="hf"', "--set", f'model.hf_config="{configs["gpt2"]}"',
                               "--set", "parallel.tp=2"])
    assert r.returncode == 2 and "GPT2LMHeadModel has no _tp_plan" in r.stderr, r.stderr
    r = run_module("trainer", ["--set", 'model.source="hf"', "--set", f'model.hf_config="{configs["llama"]}"',
                               "--set", "parallel.pp=2", "--set", 'model.pp_split_points=["model.layers.7"]'])
    assert r.returncode == 2 and "model.pp_split_points: ['model.layers.7'] are not blocks" in r.stderr, r.stderr
    small = dict(LLAMA, vocab_size=128)
    (tmp_path / "config.json").write_text(json.dumps(small))
    r = run_module("trainer", ["--set", 'model.source="hf"', "--set", f'model.hf_config="{tmp_path}"',
                               "--set", "data.max_bytes=100000"])
    assert r.returncode == 2 and "is smaller than the vocabulary of data.tokenizer='bytes', which has 256 ids" in r.stderr, r.stderr
