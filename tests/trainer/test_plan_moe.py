"""etrain plan for a Mixture of Experts (trainer/plan/experts.py): expert and dense parameters counted apart,
each with its own sharding, the all-to-all volume, and ep searched. Pure logic, no process group; the
all-to-all formula is checked against the meter on real gloo groups in tests/trainer/test_moe.py."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_moe import BASE
from trainer.config.load import load_config
from trainer.plan.accounting import Layout, rank_memory
from trainer.plan.comm import step_comm
from trainer.plan.cost import DEVICES
from trainer.plan.experts import all_to_all_per_step, expert_counts
from trainer.plan.search import _normalize, enumerate_layouts, evaluate

MOE = BASE + ["train.micro_batch=1"]


def dims_at(overrides: list[str], world: int):
    from trainer.parallel.dims import ParallelDims

    cfg = load_config(None, MOE + overrides)
    return cfg, ParallelDims.from_config(cfg, world)


def test_expert_and_dense_parameters_are_counted_apart_with_their_own_sharding():
    from trainer.models.decoder.model import Transformer

    cfg, dims = dims_at(["parallel.ep=2"], 4)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    c = expert_counts(cfg, dims)
    assert (c["experts"], c["dense"], c["moe_layers"]) == (experts, total - experts, 2)
    # experts: split 2 ways by ep, then 2 ways over the ranks outside ep; dense: over dp_shard = 4
    assert (c["expert_shards"], c["dense_shards"]) == (4, 4)
    assert c["gathered"] == experts // 2 and c["expert_held"] == experts // 4
    mem = rank_memory(cfg, dims, 0, mixed=False)
    assert mem["moe_experts"] == experts and mem["param_count"] == total  # the model counted, not the formulas
    assert mem["params"] == 4 * total // 4  # fp32 bytes, ZeRO-3 over the 4 ranks
    # ZeRO-1 under ep: the dense parameters whole, the experts FSDP-sharded over all of dp_shard.
    cfg1, dims1z = dims_at(["parallel.ep=2", "parallel.zero_stage=1"], 4)
    assert rank_memory(cfg1, dims1z, 0, mixed=False)["params"] == 4 * (total - experts) + 4 * experts // 4
    # What ep saves under ZeRO-3: the experts a rank gathers (the unsharded block and accumulated gradients).
    _, dims1 = dims_at([], 4)
    assert rank_memory(cfg, dims, 0, mixed=False)["with_activations"] < rank_memory(
        cfg, dims1, 0, mixed=False)["with_activations"]


def test_the_all_to_all_volume_follows_the_formula():
    """Per micro-batch and MoE layer: 4 x tokens x top_k x dim x bytes of slots in (6 with full recomputation),
    plus the n_experts int64 counts; (ep - 1) / ep of it on the bus; 5 calls (8)."""
    cfg, dims = dims_at(["parallel.ep=2"], 2)
    mb, layers, tokens = 8 // 2 // 1, 2, 1 * 32
    size, bus, calls = all_to_all_per_step(cfg, dims, 4)
    assert size == mb * layers * (4 * tokens * 2 * 64 * 4 + 8 * 4) and bus == size / 2 and calls == mb * layers * 5
    a2a = [c for c in step_comm(cfg, dims, 0, mixed=False) if c["kind"] == "all_to_all"]
    assert a2a == [{"kind": "all_to_all", "axis": "ep", "bytes": round(bus), "calls": calls, "overlaps": "none",
                    "ranks": 2}]
    cfg_ac, dims_ac = dims_at(["parallel.ep=2", 'parallel.activation_checkpoint="full"'], 2)
    assert all_to_all_per_step(cfg_ac, dims_ac, 4)[2] == mb * layers * 8
    assert all_to_all_per_step(*dims_at([], 2), 4) == (0.0, 0.0, 0)
    # The experts' own FSDP traffic runs over the ranks outside ep (2 at world 4, ep 2), the dense over dp_shard.
    cfg4, dims4 = dims_at(["parallel.ep=2"], 4)
    axes = {(c["kind"], c["axis"]) for c in step_comm(cfg4, dims4, 0, mixed=False)}
    assert {("all_gather", "dp_shard_mod_ep"), ("all_gather", "dp_shard"), ("all_to_all", "ep")} <= axes


def test_the_search_offers_ep():
    """Every ep dividing dp_shard and n_experts, at every ZeRO stage."""
    cfg = load_config(None, MOE)
    layouts = enumerate_layouts(cfg, 4)
    assert {lay.ep for lay in layouts} == {1, 2, 4}
    assert {lay.zero_stage for lay in layouts if lay.ep == 2} == {0, 1, 2, 3}
    assert all(_normalize(cfg, lay) == lay for lay in layouts)
    assert _normalize(cfg, Layout(2, 2, 1, 1, 3, ep=4)).ep == 1  # ep must divide dp_shard
    zero1 = evaluate(cfg, Layout(1, 4, 1, 1, 1, ep=2), DEVICES["cpu"])
    assert zero1.valid and {c["axis"] for c in zero1.time["comm"]} >= {"dp_shard", "dp_shard_mod_ep", "ep"}
    good = evaluate(cfg, Layout(1, 4, 1, 1, 3, ep=4), DEVICES["cpu"])
    assert good.valid and "ep 4" in good.layout.describe()
    assert "ep" in good.time["comm_by_axis"]


def test_plan_prints_the_expert_split(tmp_path, capsys):
    from trainer.plan.cli import main

    toml = tmp_path / "moe.toml"
    toml.write_text('[model]\npreset = "moe-tiny"\n[data]\nseq_len = 64\n[train]\nglobal_batch = 16\n'
                    'micro_batch = 2\n[parallel]\nep = 2\n')
    assert main([str(toml), "--workers", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "experts " in out and "split ep " in out and "gathering " in out and "all_to_all ep" in out


def test_flops_count_the_routed_experts_only():
    from trainer.models import spec_for

    cfg, _ = dims_at([], 2)
    shape = spec_for(cfg.model).shape()
    assert shape.active_weight_params == pytest.approx(shape.weight_params - shape.experts * (1 - 2 / 4))


def test_the_search_offers_tp_with_the_moe_layers_whole_on_every_tp_rank():
    """tp (and sequence parallelism) for a Mixture of Experts: each tp rank holds a tp-th of the dense parts and
    every MoE layer whole (the trainer's own count, trainer.models.decoder.tp), computes the MoE layers whole, and
    their feed-forward regions add no tp all-reduce (two all-gathers under sequence parallelism)."""
    from trainer.models import spec_for
    from trainer.plan.cost import step_flops

    cfg = load_config(None, MOE)
    layouts = enumerate_layouts(cfg, 4)
    assert {lay.tp for lay in layouts} == {1, 2, 4} and any(lay.tp == 2 and lay.ep == 2 for lay in layouts)
    assert any(lay.tp == 2 and lay.sequence_parallel for lay in layouts)
    shape = spec_for(cfg.model).shape()
    cfg2, dims2 = dims_at(["parallel.tp=2", "parallel.zero_stage=0"], 2)
    _, dims1 = dims_at(["parallel.zero_stage=0"], 1)
    moe, norms = 2 * shape.moe_ffn, 9 * 64  # two MoE layers and the 9 norms: whole on each tp rank
    assert rank_memory(cfg2, dims2, 0, mixed=False)["param_count"] == (shape.n_params - moe - norms) // 2 + moe + norms
    # FLOPs: the MoE layers are computed whole on each tp rank, so tp 2 does more than half of world 1's work.
    assert step_flops(cfg2, dims2, 0) > step_flops(cfg2, dims1, 0) / 2
    tp_calls = {c["kind"]: c["calls"] for c in step_comm(cfg2, dims2, 0, mixed=False) if c["axis"] == "tp"}
    mb = 8 // 1
    assert tp_calls == {"all_reduce": 4 * (4 - 1) * mb}  # 2 of the 4 blocks have half their regions
    cfg_sp, dims_sp = dims_at(["parallel.tp=2", "parallel.sequence_parallel=true"], 2)
    sp_calls = {c["kind"]: c["calls"] for c in step_comm(cfg_sp, dims_sp, 0, mixed=False) if c["axis"] == "tp"}
    assert sp_calls == {"all_gather": 4 * 3 * mb // 2 + 2 * 2 * mb, "reduce_scatter": 4 * 3 * mb // 2}
    assert evaluate(cfg, Layout(1, 2, 2, 1, 3, ep=2), DEVICES["cpu"]).valid
