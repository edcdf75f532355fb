"""trainer.zero: data-parallel gradient reduction and AdamW, by ZeRO stage.

    opt = build_optimizer(parts, cfg, dims, mesh, rank)
    for each micro-batch: opt.before_backward(final=last); loss.backward(); opt.after_backward(final=last)
    norm_sq = opt.local_norm_sq()            # all-reduced over the world by the caller
    opt.step(lr, clip_coef); opt.zero_grad()

Stages 0-2 (:class:`ZeroOptimizer`) keep every parameter whole on each
data-parallel rank and differ in what they shard:

* 0: nothing (DDP semantics). Gradients live in one flat buffer (``p.grad`` are
  views into it, so autograd accumulates in place); one all-reduce per step.
* 1: the optimizer state. Same flat buffer; after the last micro-batch it is
  reduce-scattered in fp32, bucket by bucket, each rank updates its chunk of
  every parameter, and the chunks are all-gathered, bucket by bucket.
* 2: + gradients. Gradient hooks reduce-scatter them bucket by bucket
  (``parallel.bucket_mb``) while backward runs, adding this rank's chunks into
  an fp32 shard and dropping the whole gradients, so at most a bucket or two
  of them exist at once; every micro-batch accumulates into the shard.

Chunks follow DTensor's ``Shard`` rule (``torch.chunk`` along one dim: the
first dim that tensor parallelism does not already shard), so a chunk of the
optimizer state is exactly a DTensor shard and checkpoints reshard between
stages. Stage 3 (:class:`FSDPOptimizer`) is FSDP2: parameters, gradients and
state are DTensors sharded by ``fully_shard``.

One module per part: ``common`` (the :class:`Optimizer` interface the step loop drives,
AdamW, byte counts), ``buckets`` (chunks and buckets), ``collectives`` (every collective
of stages 0-2: where a quantized one plugs in), ``quantize`` (ZeRO++'s int8 blocks), ``stages`` (0-2),
``fsdp`` (3), ``fsdp_comm`` (ZeRO++'s collectives plugged into FSDP2), ``hybrid`` (expert parallelism
under 0-2: the experts by FSDP, the rest by the stage), ``offload`` and ``swapper`` (AdamW's state in a
file per rank: ``parallel.offload="nvme"``).
"""

from __future__ import annotations

from ..config import RunConfig
from ..parallel.dims import ParallelDims
from ..parallel.parallelize import ModelParts
from .buckets import chunk_bounds
from .common import Optimizer, ensure_adam_state, local_tensor
from .fsdp import FSDPOptimizer
from .hybrid import HybridOptimizer
from .stages import ZeroOptimizer

__all__ = ["FSDPOptimizer", "HybridOptimizer", "Optimizer", "ZeroOptimizer", "build_optimizer", "chunk_bounds",
           "ensure_adam_state", "local_tensor"]


def build_optimizer(parts: ModelParts, cfg: RunConfig, dims: ParallelDims, mesh, rank: int) -> Optimizer:
    """The optimizer of ``parts``' ZeRO stage: FSDP2's (stage 3) when the parts were sharded by ``fully_shard``."""
    if parts.uses_fsdp:
        return FSDPOptimizer(parts, cfg, dims, rank)
    if parts.expert_units:  # expert parallelism under ZeRO 0-2: the experts in FSDP units of their own
        return HybridOptimizer(parts, cfg, dims, mesh, rank)
    return ZeroOptimizer(parts, cfg, dims, mesh, rank)
