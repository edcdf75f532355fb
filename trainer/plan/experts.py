"""A Mixture of Experts in the planner: expert and dense parameters, each with its own sharding, and the
all-to-all of expert parallelism.

    counts = expert_counts(cfg, dims)          # {"experts", "dense", "expert_shards", "dense_shards", ...}
    for kind, axis, size, calls, ranks in moe_comm(cfg, dims, act_b): ...

The routed experts (``ModelShape.experts``, counted on the meta device) are split ``ep`` ways on the expert
dim and sharded further over the ``dp_shard / ep`` data-parallel ranks outside ep by FSDP units of their own
(:mod:`trainer.parallel.expert`), at every ZeRO stage; the dense parameters (everything else: attention,
router, shared experts, embeddings) follow the ZeRO stage as in a dense model (ZeRO-3: over ``dp_shard``).
The resident ZeRO-3 shard of either
is ``1 / dp_shard`` of it; what ``ep`` divides is what a rank gathers and computes with (``gathered``:
``n_experts / ep`` experts per layer) and the experts' all-gather and reduce-scatter traffic.

All-to-all, per MoE layer and micro-batch of ``T`` tokens routed to ``top_k`` experts each (``dim`` wide,
``b`` bytes an element): forward sends the ``T top_k`` slots to their experts' ranks and takes the outputs
back, backward the reverse, so ``4 T top_k dim b`` bytes go in (6 with full activation checkpointing, whose
recomputation dispatches again), of which ``(ep - 1) / ep`` leave the rank under even routing, the bus
convention of :mod:`trainer.plan.comm` and of the communication meter (which counts an all-to-all's input);
plus the even all-to-all of the ``n_experts`` int64 counts (forward, and again when recomputed). Calls: 5 (8
with full recomputation). Capacity (``capacity_factor > 0``) can only lower the slots.
"""

from __future__ import annotations

from ..config import RunConfig
from ..models import spec_for
from ..parallel.dims import EXPERT_SPLIT, Axis, ParallelDims

MOE_AXES = (Axis.EP.value, EXPERT_SPLIT[0])  # the axes step_comm adds for expert parallelism


def expert_counts(cfg: RunConfig, dims: ParallelDims) -> dict:
    """Whole-model expert and dense parameters, the ways each is sharded on a rank and what it then holds
    (``*_held``), and the experts a rank gathers to compute (``gathered``: all of its ``n_experts / ep``).
    All zero for a dense model's experts."""
    m = spec_for(cfg.model).shape()
    dense_shards = dims.dp_shard * dims.cp if dims.uses_fsdp else 1
    # under ep the experts are FSDP units of their own at every ZeRO stage (trainer.zero.hybrid below 3)
    expert_shards = dims.dp_shard if dims.ep > 1 else dense_shards
    return {"experts": m.experts, "dense": m.dense_params, "moe_layers": m.moe_layers, "ep": dims.ep,
            "n_experts": cfg.model.n_experts,
            "expert_shards": expert_shards, "dense_shards": dense_shards,
            "expert_held": m.experts // expert_shards, "dense_held": m.dense_params // dense_shards,
            "gathered": m.experts // dims.ep}


def all_to_all_per_step(cfg: RunConfig, dims: ParallelDims, act_b: int) -> tuple[float, float, int]:
    """(bytes into the all-to-alls, bus bytes, calls) of one rank's step (the module docstring's formula);
    zeros at ep 1."""
    m, mcfg = spec_for(cfg.model).shape(), cfg.model
    if dims.ep == 1 or not m.moe_layers:
        return 0.0, 0.0, 0
    full = cfg.parallel.activation_checkpoint == "full"
    mb = max(1, dims.local_batch(cfg) // cfg.train.micro_batch)
    tokens = cfg.train.micro_batch * cfg.data.seq_len
    slots = (6 if full else 4) * tokens * mcfg.top_k * m.dim * act_b
    counts = (2 if full else 1) * 8 * mcfg.n_experts
    size = mb * m.moe_layers * (slots + counts)
    return size, size * (dims.ep - 1) / dims.ep, mb * m.moe_layers * (8 if full else 5)


def moe_comm(cfg: RunConfig, dims: ParallelDims, act_b: int) -> list[tuple[str, str, float, int, int]]:
    """(kind, axis, bus bytes, calls, ranks) of expert parallelism's all-to-alls in one step."""
    _, bus, calls = all_to_all_per_step(cfg, dims, act_b)
    return [("all_to_all", Axis.EP.value, bus, calls, dims.ep)] if calls else []
