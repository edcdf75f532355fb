"""Tensor and sequence parallelism of the built-in decoder: its DTensor plan.

    apply_tp(model, tp_mesh, sequence_parallel=True, loss_parallel=True)   # in place

Tensor parallelism (Megatron-LM): attention q/k/v and the SwiGLU gate/up
projections are column-wise (each rank owns whole heads / hidden units), the
output projections row-wise; the embedding is split by vocabulary rows, the
output head by vocabulary columns.

Sequence parallelism (Megatron-LM v2, ``parallel.sequence_parallel``): between
the tensor-parallel regions the activations are split along the sequence, so
the norms, dropout and residual adds run on ``seq_len / tp`` positions per rank.
Each region starts with an all-gather along the sequence and ends with a
reduce-scatter, where plain TP has one all-reduce (the same bytes on the wire,
a tp-th of the activation memory outside the regions).

Loss parallelism keeps the head's logits split by vocabulary
(:func:`trainer.parallel.tensor.lm_loss` computes the loss on the shards).

A Mixture-of-Experts feed-forward (:class:`~trainer.models.moe.MoE`) is not split: its router, experts and
shared experts are replicated across the tp ranks, and each computes the whole layer on the same tokens
(expert parallelism splits the experts instead, over data-parallel ranks). Under sequence parallelism its
input is all-gathered along the sequence on entry and its output cut back to the rank's shard on exit;
every tp rank then holds the whole layer's gradient (the same on all), so nothing is summed over ``tp``.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..moe import MoE
from .model import Transformer


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> None:
    """Tensor parallelism with DTensor plans, in place; see the module docstring for the layouts.

    A block has two regions (attention, feed-forward). Plain TP all-reduces each region's output in
    forward and its input's gradient in backward. Sequence parallelism opens each region with an
    all-gather and closes it with a reduce-scatter, mirrored in backward; its norms' weights become
    replicated DTensors whose gradients are summed over ``tp``.
    """
    # Layout of the residual stream between regions: the whole sequence, or a tp-th of it.
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=between,
                                         output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
    # Each region's input enters as one replicated DTensor: in backward the gradients that q, k and v
    # (the gate and up projections) send it are summed locally and reduced once, where plain local
    # inputs would have each all-reduced on its own. Under sequence parallelism that reduction is the
    # reduce-scatter back to the sequence shard, and the forward an all-gather (the rotary table and the
    # document mask, over the whole sequence and every head, pass untouched).
    block_plan.update({
        "attention": PrepareModuleInput(input_layouts=(between, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
    })
    if sequence_parallel:
        block_plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    # A Mixture-of-Experts layer runs whole on every tp rank (module docstring): plain tensors in and out, of the
    # whole sequence; under sequence parallelism gathered on entry, its output cut to the rank's shard on exit.
    moe_plan = {k: v for k, v in block_plan.items() if not k.startswith("feed_forward")}
    if sequence_parallel:
        moe_plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(between,), use_local_output=True)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, moe_plan if isinstance(block.feed_forward, MoE) else block_plan)
        if sequence_parallel:
            block.seq_shard = (tp_mesh.get_local_rank(), tp_mesh.size())
