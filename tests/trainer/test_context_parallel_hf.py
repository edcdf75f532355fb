"""Context parallelism for a transformers Llama (model.source="hf"): its attention routed through etrain's
(trainer.models.hf.cp, transformers' attention interface) with global position ids for its rotary embedding.
Each cp_style at cp 2 (and, in the slow tier, cp 4) trains as cp 1 does: the first 5 losses within 1e-4 and the first step's reduced
gradients within 1e-5 (fp32); models whose attention cannot be routed are refused with the reason (exit 2).
"""

from __future__ import annotations

import json

import pytest

from checkpointing.errors import ConfigError
from tests.harness import run_ranks
from tests.trainer.test_context_parallel import STYLES, check, cp
from trainer.config.load import load_config
from trainer.models import model_preflight

SEQ = 256
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": SEQ, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def write_config(path, **changes) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return str(path)


def base(hf_dir: str) -> list[str]:
    return ['model.source="hf"', f'model.hf_config="{hf_dir}"', "data.max_bytes=2000000", f"data.seq_len={SEQ}",
            "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=0", "train.lr=3e-3",
            "train.grad_clip=0.5"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def runs(hf_dir):
    payload = {"base": base(hf_dir)}
    ref = run_ranks("tests.cp_jobs:train_with_grads", 1, {**payload, "layouts": [("cp1", [], 5)]}, timeout=600)[0]
    layouts = [(f"cp2_{s}", cp(2, s, "parallel.zero_stage=0"), 5) for s in STYLES]
    layouts.append(("cp2_ring_zero3", cp(2, "ring"), 5))
    got = run_ranks("tests.cp_jobs:train_with_grads", 2, {**payload, "layouts": layouts}, timeout=600)[0]
    return ref["cp1"], got


@pytest.mark.parametrize("name", [f"cp2_{s}" for s in STYLES] + ["cp2_ring_zero3"])
def test_hf_llama_at_cp2_trains_as_cp1(name, runs):
    ref, got = runs
    check(got[name], ref)
    # its attention went through etrain's: the cp axis carried its exchanges
    assert any(k.endswith("/cp") and not k.startswith("all_reduce") for k in got[name]["comm"]), got[name]["comm"]


@pytest.mark.slow  # 4 processes, 3 layouts
def test_hf_llama_at_cp4_trains_as_cp1(hf_dir, runs):
    """cp 4 in each style (ulysses: one head per rank of the 4), seq 256: as cp 1, as at cp 2."""
    ref, _ = runs
    layouts = [(f"cp4_{s}", cp(4, s), 5) for s in STYLES]
    got = run_ranks("tests.cp_jobs:train_with_grads", 4, {"base": base(hf_dir), "layouts": layouts}, timeout=900)[0]
    for name, _, _ in layouts:
        check(got[name], ref)


REFUSED = {
    "sliding_window": ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 64},
                       "sliding window of 64 positions"),
    "attention_dropout": ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    "not_llama_like": ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2,
                        "n_head": 4, "n_positions": SEQ}, "cannot route it"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unroutable_attention_is_refused_with_the_reason(case, tmp_path):
    changes, reason = REFUSED[case]
    cfg = load_config(None, base(write_config(tmp_path / case, **changes)) + cp(2))
    with pytest.raises(ConfigError, match="parallel.cp=2") as e:
        model_preflight(cfg)
    assert reason in str(e.value) and "set parallel.cp=1" in str(e.value), str(e.value)


def test_ulysses_needs_heads_divisible_by_cp(hf_dir):
    cfg = load_config(None, base(hf_dir) + cp(8, "ulysses"))
    with pytest.raises(ConfigError, match='cp_style="ring"'):
        model_preflight(cfg)
