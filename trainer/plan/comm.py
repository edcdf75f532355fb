"""Communication of one training step, per rank: bytes by collective kind and mesh axis, the pipeline bubble.

    for c in step_comm(cfg, dims, rank, mixed):   # {"kind", "axis", "bytes", "calls", "overlaps"}
        ...
    bubble_fraction(cfg, dims)                    # the share of a step a pipeline rank waits

Volumes are what one rank sends (= receives) under ring algorithms, the NCCL tests' "bus"
convention: an all-reduce of S bytes over n ranks moves 2 (n - 1) / n S, an all-gather or a
reduce-scatter of S (the whole tensor) (n - 1) / n S, a send/recv its bytes. What is reduced and
gathered is what this trainer reduces and gathers (:mod:`trainer.zero`, :mod:`trainer.parallel.parallelize`):

* ZeRO-0: one all-reduce of the fp32 gradients over the data-parallel axis, after the last backward;
* ZeRO-1/2: a reduce-scatter of the fp32 gradients over ``dp_shard`` (stage 2 during backward,
  bucket by bucket), an all-reduce of this rank's shard over ``dp_replicate``, and an all-gather
  of the updated parameters after the step;
* ZeRO-3 (FSDP2): an all-gather of the parameters (compute dtype) in forward and again in backward,
  per micro-batch (once per step under pipeline parallelism, which keeps them gathered), a
  reduce-scatter of the fp32 gradients per step (per micro-batch with
  ``parallel.reduce_every_microbatch``), and the HSDP all-reduce across ``dp_replicate``;
* tensor parallelism (Megatron-LM, Shoeybi et al. 2019): two all-reduces of a micro-batch's
  activations per block in forward and two in backward (two more when the block is recomputed);
  sequence parallelism turns each into an all-gather plus a reduce-scatter of the same volume;
* pipeline parallelism: one send/recv of a micro-batch's boundary activations per micro-batch in
  forward and one of their gradients in backward;
* context parallelism (:mod:`trainer.parallel.cp_attention`), per layer and micro-batch, with ``K`` one
  rank's K and V (``n_kv_heads`` heads of ``seq / cp`` positions) and ``E`` its q: the ring sends K
  ``cp - 1`` times forward, ``cp - 1`` times backward and its gradient ``cp`` times (``3 cp - 2``
  point-to-point sends, overlapped with the block attention); allgather all-gathers K (``cp`` K out)
  and reduce-scatters its gradient; ulysses makes four all-to-alls of ``3 E + E`` both ways. Full
  activation checkpointing repeats the forward's. The cp ranks hold the same parameters: ZeRO shards
  over ``dp_shard x cp`` and ZeRO-0 all-reduces over ``dp x cp``;
* expert parallelism (:mod:`trainer.plan.experts`): each MoE layer's ``n_experts / ep`` experts are
  FSDP units of their own over ``dp_shard_mod_ep`` at every ZeRO stage (gathered and reduced as ZeRO-3
  does), the stage's collectives carry the dense parameters, and the tokens travel to their experts and
  back by all-to-all over ``ep``;
* ZeRO++ (``parallel.quantized_weights`` / ``quantized_gradients`` / ``hpz_partition_size``,
  :mod:`trainer.zero.quantize`): a quantized all-gather moves ``1 + 4 / quantization_block`` bytes per
  parameter (int8 and one fp32 scale per block) instead of 2 (bf16) or 4 (fp32); qgZ's reduce-scatter
  becomes an all-to-all of the same ``1 + 4 / block`` bytes per gradient element instead of 4 (fp32).
  hpZ moves ZeRO-3's backward all-gathers to the ``hpz`` groups (``hpz_partition_size`` consecutive
  shard ranks; unquantized: they gather the dequantized forward weights).

``ranks``: the group's size. ``overlaps``: "compute" where the collective can hide behind computation (FSDP's prefetched
all-gathers, ZeRO-2's bucketed reduce-scatter during backward), "none" where the step waits for it.

The bubble (Narayanan et al. 2021, section 2.2): ``(p - 1) / (v m)`` of the ideal time for ``p``
stages, ``m`` micro-batches and ``v`` stages per rank, i.e. ``(p - 1) / (v m + p - 1)`` of the step.
"""

from __future__ import annotations

from ..config import RunConfig
from ..models import spec_for
from ..observe.device_memory import local_param_count
from ..parallel.dims import Axis, Mesh, ParallelDims
from .experts import MOE_AXES, expert_counts, moe_comm


def _ring(kind: str, n: int, size: float) -> float:
    if n <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n * size


def bubble_fraction(cfg: RunConfig, dims: ParallelDims) -> float:
    if dims.pp == 1:
        return 0.0
    m, v = dims.pp_microbatches(cfg), cfg.parallel.pp_stages_per_rank
    return (dims.pp - 1) / (v * m + dims.pp - 1)


def step_comm(cfg: RunConfig, dims: ParallelDims, rank: int, mixed: bool) -> list[dict]:
    """Every collective of ``rank``'s step (module docstring), largest first; empty entries left out."""
    p, m = cfg.parallel, spec_for(cfg.model).shape()
    act_b = 2 if mixed else 4
    count = local_param_count(cfg, dims, rank)
    stage = dims.zero_stage
    # Expert parallelism: the experts in FSDP units of their own at every stage (trainer.plan.experts); below
    # ZeRO-3 the stage's collectives carry the dense parameters only.
    ex = expert_counts(cfg, dims, rank) if dims.ep > 1 else None
    experts = ex["experts"] if ex else 0
    n, r = dims.shard_ranks, dims.dp_replicate  # the cp ranks hold the same parameters
    mb = dims.microbatches(cfg)
    out: list[dict] = []

    shard_axis, dp_axis = dims.shard_axis, dims.loss_mesh
    sizes = {Mesh.DP: dims.dp, Axis.DP_SHARD: n, Axis.DP_REPLICATE: r, Axis.TP: dims.tp, Axis.PP: 2,
             Mesh.DP_SHARD_CP: n, Mesh.DP_CP: dims.grad_ranks, Axis.CP: dims.cp,
             MOE_AXES[0]: dims.ep, dims.expert_shard_axis: dims.expert_shard_ranks}

    def add(kind: str, axis: str, size: float, calls: int, overlaps: str = "none") -> None:
        if size > 0:
            out.append({"kind": kind, "axis": str(axis), "bytes": round(size), "calls": calls, "overlaps": overlaps,
                        "ranks": sizes[axis]})

    sizes["hpz"] = p.hpz_partition_size
    wire = 1 + 4 / p.quantization_block  # bytes per element of an int8 row with its scales
    dense = count - experts  # what the stage's own collectives carry (the experts have FSDP units of their own)
    grads = 4 * dense
    gathered = dense * wire if p.quantized_weights and stage else act_b * dense
    rs_kind, reduced = (("all_to_all", dense * wire) if p.quantized_gradients and stage
                        else ("reduce_scatter", 4 * dense))
    buckets = max(1, round(grads / max(1.0, p.bucket_mb * 2**20)))
    if stage == 0:
        add("all_reduce", dp_axis, _ring("all_reduce", dims.grad_ranks, grads), buckets)
    elif stage in (1, 2):
        add(rs_kind, shard_axis, _ring(rs_kind, n, reduced), buckets, "compute" if stage == 2 else "none")
        add("all_reduce", Axis.DP_REPLICATE, _ring("all_reduce", r, grads / n), buckets)
        add("all_gather", shard_axis, _ring("all_gather", n, gathered), buckets)
    n_stages, stages = dims.stages(rank, p.pp_stages_per_rank)
    blocks = sum(len(m.stage_layers(n_stages)[s]) for s in stages)
    gathers = 2 if dims.pp > 1 else 2 * mb
    rs = mb if p.reduce_every_microbatch else 1
    if stage == 3:  # the model's FSDP units (the dense parameters' under ep)
        hpz = p.hpz_partition_size if 1 < p.hpz_partition_size < n and dims.pp == 1 else 0
        g = gathers
        if hpz:  # the backward half within the hpz groups, over the secondary shard (the forward's weights)
            g //= 2
            add("all_gather", "hpz", g * _ring("all_gather", hpz, act_b * dense), g * blocks, "compute")
        add("all_gather", shard_axis, g * _ring("all_gather", n, gathered), g * (blocks + 1) + (g if hpz else 0),
            "compute")
        add(rs_kind, shard_axis, rs * _ring(rs_kind, n, reduced), rs * (blocks + 1), "compute")
        add("all_reduce", Axis.DP_REPLICATE, _ring("all_reduce", r, 4 * dense / n), blocks + 1)
    if experts:  # under ep at every stage the experts' units, n_experts / ep per layer, over the ranks outside ep
        held, axis, calls = ex["gathered"], dims.expert_shard_axis, ex["moe_layers"]
        ranks = sizes[axis]
        add("all_gather", axis, gathers * _ring("all_gather", ranks, act_b * held), gathers * calls, "compute")
        add("reduce_scatter", axis, rs * _ring("reduce_scatter", ranks, 4 * held), rs * calls, "compute")
        add("all_reduce", Axis.DP_REPLICATE, _ring("all_reduce", r, 4 * held / ranks), calls)
    for kind, axis, size, calls, _ in moe_comm(cfg, dims, act_b, rank):
        add(kind, axis, size, calls)
    if dims.tp > 1:
        n_stages, stages = dims.stages(rank, p.pp_stages_per_rank)
        split = m.stage_layers(n_stages)
        layers = sum(len(split[s]) for s in stages)
        per_block = 4 + (2 if p.activation_checkpoint == "full" else 0)
        if p.activation_checkpoint == "every_k":
            per_block += 2 * sum(1 for s in stages for i in split[s] if i % p.ac_every_k == 0) / max(1, layers)
        act = cfg.train.micro_batch * cfg.data.seq_len // dims.cp * m.dim * act_b  # a cp rank's positions
        # A Mixture-of-Experts layer runs whole on every tp rank (trainer.models.decoder.tp): its feed-forward region
        # (half a block's) has no all-reduce; under sequence parallelism two all-gathers (its input forward, its
        # output's gradient backward) and one more where recomputed.
        moe = sum(1 for s in stages for i in split[s] if m.is_moe_layer(i))
        calls = round(per_block * (layers - moe / 2) * mb)
        moe_gathers = round(moe * mb * per_block / 2)
        # "selective" keeps the all-reduce and reduce-scatter results but gathers the inputs of the first
        # linears again (trainer.models.blocks.saved_ops): two all-gathers per block under sequence parallelism.
        regather = 2 * layers * mb if p.activation_checkpoint == "selective" else 0
        if p.sequence_parallel:
            add("all_gather", Axis.TP, (calls / 2 + regather + moe_gathers) * _ring("all_gather", dims.tp, act),
                calls // 2 + regather + moe_gathers)
            add("reduce_scatter", Axis.TP, calls / 2 * _ring("reduce_scatter", dims.tp, act), calls // 2)
        else:
            add("all_reduce", Axis.TP, calls * _ring("all_reduce", dims.tp, act), calls)
    if dims.pp > 1:
        boundary = cfg.train.micro_batch * cfg.data.seq_len // dims.cp * m.dim * act_b
        hops = 2 * p.pp_stages_per_rank  # every stage this rank runs sends forward and receives backward
        add("send_recv", Axis.PP, hops * mb * boundary, hops * mb)
    if dims.cp > 1:
        for kind, size, calls, overlaps in cp_comm(cfg, dims, act_b):
            add(kind, Axis.CP, size * mb, round(calls * mb), overlaps)
    return sorted(out, key=lambda c: -c["bytes"])


def cp_comm(cfg: RunConfig, dims: ParallelDims, act_b: int) -> list[tuple[str, float, float, str]]:
    """(kind, bytes, calls, overlaps) of context parallelism's attention per micro-batch, all layers (module
    docstring): what one rank sends."""
    p, m, n = cfg.parallel, spec_for(cfg.model).shape(), dims.cp
    e = cfg.train.micro_batch * cfg.data.seq_len // n * m.dim // dims.tp * act_b  # one rank's q (its tp heads)
    kv = 2 * e * m.n_kv_heads // m.n_heads  # its K and V
    layers, full = m.n_layers, p.activation_checkpoint == "full"
    if p.cp_style == "ring":
        fwd = (n - 1) * (2 if full else 1)
        return [("send_recv", layers * kv * (fwd + 2 * n - 1), layers * (fwd + 2 * n - 1), "compute")]
    if p.cp_style == "allgather":
        return [("all_gather", layers * (2 if full else 1) * _ring("all_gather", n, n * kv), layers * (1 + full),
                 "none"), ("reduce_scatter", layers * _ring("reduce_scatter", n, n * kv), layers, "none")]
    a2a = (2 if full else 1) * 4 * e + 4 * e  # forward: q, k, v in, the output back; backward the same
    return [("all_to_all", layers * _ring("all_gather", n, a2a), layers * (4 + 2 * full), "none")]


def zeropp_savings(cfg: RunConfig, dims: ParallelDims, rank: int, mixed: bool) -> dict[str, dict]:
    """What each ZeRO++ setting of ``cfg`` saves per step: ``{"qwZ"|"qgZ"|"hpZ": {"bytes_saved",
    "shard_axis_bytes_saved"}}`` against the same config with that one setting off (bytes one rank sends;
    the shard-axis figure is what stops crossing the data-parallel shard group, the slow link)."""
    import dataclasses

    p = cfg.parallel
    total = lambda c: sum(e["bytes"] for e in c)
    shard = lambda c: sum(e["bytes"] for e in c if e["axis"] in (Axis.DP_SHARD, Mesh.DP_SHARD_CP))
    now = step_comm(cfg, dims, rank, mixed)
    out = {}
    for name, key, off in (("qwZ", "quantized_weights", False), ("qgZ", "quantized_gradients", False),
                           ("hpZ", "hpz_partition_size", 0)):
        if not getattr(p, key):
            continue
        without = step_comm(dataclasses.replace(cfg, parallel=dataclasses.replace(p, **{key: off})), dims, rank,
                            mixed)
        out[name] = {"bytes_saved": total(without) - total(now), "shard_axis_bytes_saved": shard(without) - shard(now)}
    return out
