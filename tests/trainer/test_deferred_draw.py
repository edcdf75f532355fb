"""A group that re-forms to restore builds its model without drawing the initial weights
(``Trainer(draw_weights=False)``); when nothing is loaded, they are drawn at the first step. Those must be
the weights a build that drew them holds, bit for bit, in every layout that casts, shards or splits them
differently: real gloo groups."""

import pytest

from tests.harness import run_ranks

BASE = ["model.dim=32", "model.n_layers=2", "model.ffn_hidden=64", "data.max_bytes=60000", "data.seq_len=16",
        "train.global_batch=4", "train.micro_batch=1", "train.warmup_steps=1", "metrics.enabled=false"]
MOE = ['model.preset="moe-tiny"', "model.dim=32", "model.ffn_hidden=32", "model.n_experts=4", "model.moe_every=2",
       "model.n_shared_experts=1"]


def check(results: list) -> None:
    for rank, per_layout in enumerate(results):
        for name, r in per_layout.items():
            where = f"rank {rank}, {name}"
            assert r["zero_before"], f"{where}: the undrawn build drew weights"
            assert r["state_diff"] == 0.0 and r["param_diff"] == 0.0, (where, r)
            assert r["losses"][0] == r["losses"][1], (where, r["losses"])


def test_weights_drawn_at_first_use_equal_those_drawn_at_build_world1():
    layouts = [("zero0-fp32", ['parallel.mixed_precision="fp32"', "parallel.zero_stage=0"]),
               ("zero0-bf16", ['parallel.mixed_precision="bf16"', "parallel.zero_stage=0"])]
    check(run_ranks("tests.jobs:deferred_draw", 1, {"base": BASE, "layouts": layouts, "steps": 2}))


@pytest.mark.slow
def test_weights_drawn_at_first_use_equal_those_drawn_at_build_world2():
    layouts = [("zero1-bf16", ['parallel.mixed_precision="bf16"', "parallel.zero_stage=1"]),
               ("zero3-bf16", ['parallel.mixed_precision="bf16"', "parallel.zero_stage=3"]),
               ("tp2", ['parallel.mixed_precision="fp32"', "parallel.tp=2", "parallel.zero_stage=0"]),
               ("pp2", ['parallel.mixed_precision="fp32"', "parallel.pp=2", "parallel.zero_stage=0"]),
               ("moe-ep2", [*MOE, 'parallel.mixed_precision="fp32"', "parallel.ep=2", "parallel.zero_stage=1"])]
    check(run_ranks("tests.jobs:deferred_draw", 2, {"base": BASE, "layouts": layouts, "steps": 2}))
