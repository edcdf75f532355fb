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
  forward and one of their gradients in backward.

``ranks``: the group's size. ``overlaps``: "compute" where the collective can hide behind computation (FSDP's prefetched
all-gathers, ZeRO-2's bucketed reduce-scatter during backward), "none" where the step waits for it.

The bubble (Narayanan et al. 2021, section 2.2): ``(p - 1) / (v m)`` of the ideal time for ``p``
stages, ``m`` micro-batches and ``v`` stages per rank, i.e. ``(p - 1) / (v m + p - 1)`` of the step.
"""

from __future__ import annotations

from ..config import RunConfig
from ..memory import local_param_count
from ..models import spec_for
from ..parallel.dims import Axis, Mesh, ParallelDims


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
    grads, params = 4 * count, act_b * count
    stage = dims.zero_stage
    n, r = dims.dp_shard, dims.dp_replicate
    mb = dims.pp_microbatches(cfg) if dims.pp > 1 else max(1, dims.local_batch(cfg) // cfg.train.micro_batch)
    out: list[dict] = []

    sizes = {Mesh.DP: dims.dp, Axis.DP_SHARD: n, Axis.DP_REPLICATE: r, Axis.TP: dims.tp, Axis.PP: 2}

    def add(kind: str, axis: str, size: float, calls: int, overlaps: str = "none") -> None:
        if size > 0:
            out.append({"kind": kind, "axis": str(axis), "bytes": round(size), "calls": calls, "overlaps": overlaps,
                        "ranks": sizes[axis]})

    buckets = max(1, round(grads / max(1.0, p.bucket_mb * 2**20)))
    if stage == 0:
        add("all_reduce", Mesh.DP, _ring("all_reduce", dims.dp, grads), buckets)
    elif stage in (1, 2):
        add("reduce_scatter", Axis.DP_SHARD, _ring("reduce_scatter", n, grads), buckets,
            "compute" if stage == 2 else "none")
        add("all_reduce", Axis.DP_REPLICATE, _ring("all_reduce", r, grads / n), buckets)
        add("all_gather", Axis.DP_SHARD, _ring("all_gather", n, params), buckets)
    else:
        n_stages, stages = dims.stages(rank, p.pp_stages_per_rank)
        blocks = sum(len(m.stage_layers(n_stages)[s]) for s in stages)
        gathers = 2 if dims.pp > 1 else 2 * mb
        add("all_gather", Axis.DP_SHARD, gathers * _ring("all_gather", n, params), gathers * (blocks + 1), "compute")
        rs = mb if p.reduce_every_microbatch else 1
        add("reduce_scatter", Axis.DP_SHARD, rs * _ring("reduce_scatter", n, grads), rs * (blocks + 1), "compute")
        add("all_reduce", Axis.DP_REPLICATE, _ring("all_reduce", r, grads / n), blocks + 1)
    if dims.tp > 1:
        n_stages, stages = dims.stages(rank, p.pp_stages_per_rank)
        split = m.stage_layers(n_stages)
        layers = sum(len(split[s]) for s in stages)
        per_block = 4 + (2 if p.activation_checkpoint == "full" else 0)
        if p.activation_checkpoint == "every_k":
            per_block += 2 * sum(1 for s in stages for i in split[s] if i % p.ac_every_k == 0) / max(1, layers)
        act = cfg.train.micro_batch * cfg.data.seq_len * m.dim * act_b
        calls = round(per_block * layers * mb)
        # "selective" keeps the all-reduce and reduce-scatter results but gathers the inputs of the first
        # linears again (trainer.models.blocks.saved_ops): two all-gathers per block under sequence parallelism.
        regather = 2 * layers * mb if p.activation_checkpoint == "selective" else 0
        if p.sequence_parallel:
            add("all_gather", Axis.TP, (calls / 2 + regather) * _ring("all_gather", dims.tp, act),
                calls // 2 + regather)
            add("reduce_scatter", Axis.TP, calls / 2 * _ring("reduce_scatter", dims.tp, act), calls // 2)
        else:
            add("all_reduce", Axis.TP, calls * _ring("all_reduce", dims.tp, act), calls)
    if dims.pp > 1:
        boundary = cfg.train.micro_batch * cfg.data.seq_len * m.dim * act_b
        hops = 2 * p.pp_stages_per_rank  # every stage this rank runs sends forward and receives backward
        add("send_recv", Axis.PP, hops * mb * boundary, hops * mb)
    return sorted(out, key=lambda c: -c["bytes"])
