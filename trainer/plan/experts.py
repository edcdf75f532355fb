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

Under context parallelism a rank routes its ``seq_len / cp`` positions, and the experts' FSDP units shard over
the cp ranks too (``dp_shard / ep x cp``: :data:`~trainer.parallel.dims.EXPERT_SHARD_CP`); under pipeline
parallelism a rank holds (and dispatches for) the MoE layers of its stages only, per pipeline micro-batch.
"""

from __future__ import annotations

from ..config import RunConfig
from ..models import spec_for
from ..parallel.dims import EXPERT_SPLIT, Axis, ParallelDims

# The axes step_comm adds for expert parallelism; the experts' own FSDP units shard over
# ParallelDims.expert_shard_axis (dp_shard / ep, x cp under context parallelism).
MOE_AXES = (Axis.EP.value, EXPERT_SPLIT[0])


def stage_moe_layers(cfg: RunConfig, dims: ParallelDims, rank: int) -> tuple[int, int]:
    """(routed experts' parameters, MoE layers) of ``rank``'s pipeline stages (the whole model's unpipelined)."""
    m = spec_for(cfg.model).shape()
    n_stages, stages = dims.stages(rank, cfg.parallel.pp_stages_per_rank)
    experts = m.stage_experts(stages, n_stages)
    return experts, (m.moe_layers * experts // m.experts if m.experts else 0)


def expert_counts(cfg: RunConfig, dims: ParallelDims, rank: int = 0) -> dict:
    """Expert parameters (of ``rank``'s pipeline stages: the whole model's unpipelined) and the whole model's
    dense ones, the ways each is sharded on a rank and what it then holds (``*_held``), and the experts a rank
    gathers to compute (``gathered``: all of its ``n_experts / ep``). All zero for a dense model's experts."""
    m = spec_for(cfg.model).shape()
    experts, layers = stage_moe_layers(cfg, dims, rank)
    dense_shards = dims.shard_ranks if dims.uses_fsdp else 1
    # under ep the experts are FSDP units of their own at every ZeRO stage (trainer.zero.hybrid below 3)
    expert_shards = dims.shard_ranks if dims.ep > 1 else dense_shards
    return {"experts": experts, "dense": m.dense_params, "moe_layers": layers, "ep": dims.ep,
            "n_experts": cfg.model.n_experts,
            "expert_shards": expert_shards, "dense_shards": dense_shards,
            "expert_held": experts // expert_shards, "dense_held": m.dense_params // dense_shards,
            "gathered": experts // dims.ep}


def all_to_all_per_step(cfg: RunConfig, dims: ParallelDims, act_b: int, rank: int = 0) -> tuple[float, float, int]:
    """(bytes into the all-to-alls, bus bytes, calls) of ``rank``'s step (the module docstring's formula);
    zeros at ep 1."""
    m, mcfg = spec_for(cfg.model).shape(), cfg.model
    moe_layers = stage_moe_layers(cfg, dims, rank)[1]
    if dims.ep == 1 or not moe_layers:
        return 0.0, 0.0, 0
    full = cfg.parallel.activation_checkpoint == "full"
    mb = dims.microbatches(cfg)
    tokens = dims.local_batch(cfg) // mb * cfg.data.seq_len // dims.cp  # a micro-batch's, of this cp rank
    slots = (6 if full else 4) * tokens * mcfg.top_k * m.dim * act_b
    counts = (2 if full else 1) * 8 * mcfg.n_experts
    size = mb * moe_layers * (slots + counts)
    return size, size * (dims.ep - 1) / dims.ep, mb * moe_layers * (8 if full else 5)


def moe_comm(cfg: RunConfig, dims: ParallelDims, act_b: int, rank: int = 0) -> list[tuple[str, str, float, int, int]]:
    """(kind, axis, bus bytes, calls, ranks) of expert parallelism's all-to-alls in ``rank``'s step."""
    _, bus, calls = all_to_all_per_step(cfg, dims, act_b, rank)
    return [("all_to_all", Axis.EP.value, bus, calls, dims.ep)] if calls else []
