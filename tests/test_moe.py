"""The built-in Mixture-of-Experts decoder (trainer/models/moe.py): its router and experts against a
per-token loop, its config checks, and the trainer at world 1 against a plain PyTorch loop, bit for bit."""

from __future__ import annotations

import pytest
import torch

from checkpointing.errors import ConfigError
from tests.harness import run_ranks
from trainer.config_load import load_config

# moe-tiny made narrow for two CPU cores: 4 experts of 64, top 2, every other block MoE, a shared expert.
BASE = [
    'model.preset="moe-tiny"', "model.dim=64", "model.ffn_hidden=64", "model.n_experts=4", "model.moe_every=2",
    "model.n_shared_experts=1", "model.aux_loss_coef=0.01",
    "data.max_bytes=2000000", "data.seq_len=32",
    "train.global_batch=8", "train.micro_batch=2", "train.warmup_steps=0", "train.lr=3e-3", "train.grad_clip=0.5",
    'parallel.mixed_precision="fp32"',
]
STEPS = 5


def naive_moe(moe, x: torch.Tensor, cap: int | None = None) -> torch.Tensor:
    """Token by token: the top-k experts by score (+ bias), their renormalized scores, each expert's
    SwiGLU; an expert past its capacity (in token order) contributes nothing."""
    import torch.nn.functional as F

    t = x.reshape(-1, x.shape[-1])
    scores = F.linear(t, moe.router.weight).softmax(-1)
    taken = [0] * moe.n_experts
    out = []
    for i in range(t.shape[0]):
        chosen = (scores[i] + moe.expert_bias).topk(moe.top_k).indices.tolist()
        w = scores[i][chosen] / scores[i][chosen].sum()
        y = torch.zeros_like(t[i])
        for e, we in zip(chosen, w):
            taken[e] += 1
            if cap is not None and taken[e] > cap:
                continue
            ex = moe.experts
            y = y + we * ((F.silu(ex.w1[e] @ t[i]) * (ex.w3[e] @ t[i])) @ ex.w2[e].t())
        out.append(y + (moe.shared(t[i]) if moe.shared is not None else 0))
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_moe_layer_matches_a_per_token_loop(capacity):
    from trainer.models.decoder import Transformer

    cfg = load_config(None, BASE + [f"model.capacity_factor={capacity}"])
    model = Transformer(cfg.model)
    model.init_weights(3)
    moe = model.layers["1"].feed_forward
    moe.expert_bias.copy_(torch.tensor([0.0, 0.3, 0.0, -0.2]))  # the bias changes the choice, not the weights
    x = torch.randn(2, 16, 64)
    got = moe(x)
    cap = None if capacity == 0 else -(-int(capacity * 32 * 2) // 4)
    assert torch.allclose(got, naive_moe(moe, x, cap), atol=1e-6)
    assert (moe.dropped > 0) == (capacity > 0)  # a bias this skewed overflows an even capacity
    assert moe.tokens_per_expert.sum() == 32 * 2
    got.sum().backward()  # gradients reach the router (through the weights) and every used expert
    assert moe.router.weight.grad.abs().sum() > 0 and moe.experts.w1.grad.abs().sum() > 0


@pytest.mark.parametrize("override, field", [
    ("model.top_k=5", "model.top_k"), ("model.moe_every=9", "model.moe_every"),
    ("model.capacity_factor=-1", "model.capacity_factor"), ("model.n_experts=-2", "model.n_experts"),
])
def test_moe_config_refusals_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, BASE + [override])


def test_moe_refuses_tensor_parallelism():
    from trainer.models import model_preflight

    with pytest.raises(ConfigError, match=r"parallel\.tp=2"):
        model_preflight(load_config(None, BASE + ["parallel.tp=2"]))


def test_world1_matches_plain_pytorch_bitwise():
    """The trainer at world 1 (its ZeRO-0 buffer, clipping, AdamW, the aux loss joined to the loss)
    gives the plain loop's losses and parameters bit for bit, and reports the aux loss beside the loss."""
    plain = run_ranks("tests.test_parity:reference_loop", 1, {"base": BASE, "steps": STEPS})[0]
    res = run_ranks("tests.moe_jobs:train_moe", 1, {"base": BASE, "steps": STEPS, "params": True,
                                                    "layouts": [("world1", ["parallel.zero_stage=0"])]})[0]["world1"]
    assert res["losses"] == plain["losses"]
    assert res["params"].keys() == plain["params"].keys()
    differ = [n for n, p in plain["params"].items() if not torch.equal(res["params"][n], p)]
    assert not differ, f"parameters differ after {STEPS} steps: {differ}"
    assert plain["losses"][-1] < plain["losses"][0]
    assert all(0 < a < 0.1 for a in res["aux"]), res["aux"]  # about coef x 2 layers x 1 (balanced)
    assert all(i >= 1.0 for i in res["imbalance"]), res["imbalance"]
