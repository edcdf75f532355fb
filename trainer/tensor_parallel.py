"""Tensor and sequence parallelism of the built-in decoder, and the language-model loss.

    apply_tp(model, tp_mesh, sequence_parallel=True, loss_parallel=True)   # DTensor plans
    loss = lm_loss(logits, targets)     # mean next-token cross-entropy in fp32; vocab-sharded logits too

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

Loss parallelism (``parallel.loss_parallel``, on by default under TP): the
output head keeps its logits split by vocabulary and the cross-entropy runs on
the shards (``torch.distributed.tensor.parallel.loss_parallel``: three
all-reduces of ``batch x seq`` values) instead of all-gathering
``batch x seq x vocab`` logits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

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
    # reduce-scatter back to the sequence shard, and the forward an all-gather (the rotary table
    # passes untouched).
    block_plan.update({
        "attention": PrepareModuleInput(input_layouts=(between, None), desired_input_layouts=(Replicate(), None)),
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
    })
    if sequence_parallel:
        block_plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
        if sequence_parallel:
            block.seq_shard = (tp_mesh.get_local_rank(), tp_mesh.size())


def grads_as_placed(model: nn.Module) -> None:
    """Make every DTensor parameter's gradient arrive in the parameter's own placements, as FSDP2
    does for its own; ZeRO 0-2 (:mod:`trainer.optim`) read gradients as the parameter's local shard.

    Call after any dtype conversion (``Module.to`` replaces DTensor parameters, and their hooks).
    DTensor's rules do not promise it: under sequence parallelism the norms' gradients arrive
    ``Partial`` (each rank saw its part of the sequence; an all-reduce over ``tp`` sums them), and the
    embedding's may arrive ``Replicate`` (in bf16 even without sequence parallelism; a local slice
    makes it the parameter's vocabulary shard).
    """
    for p in model.parameters():
        if isinstance(p, DTensor):
            p.register_hook(functools.partial(_as_placed, p.placements))


def _as_placed(placements, grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(placements):
        return grad.redistribute(placements=placements)
    return grad


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32.

    ``logits`` may be a DTensor split along the vocabulary (loss parallelism): the loss is then
    computed on the shards and comes back as a plain tensor, the same on every ``tp`` rank.
    """
    if isinstance(logits, DTensor):
        return _VocabParallelCrossEntropy.apply(logits, targets).to_local()
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy`` under ``loss_parallel()``, whose backward must run under that context too.

    The context swaps in DTensor's vocab-parallel log-softmax and NLL kernels (forward and
    backward), but the step loop calls ``backward()`` far from here; so the loss is computed on a
    graph of its own inside the context, and that graph is differentiated inside it again when the
    outer backward reaches this node.
    """

    @staticmethod
    def forward(ctx, logits: DTensor, targets: torch.Tensor) -> DTensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with torch.enable_grad(), loss_parallel():
            x = logits.detach().requires_grad_(True)
            loss = F.cross_entropy(x.flatten(0, 1).float(), targets.flatten())
        ctx.graph = (x, loss)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad: DTensor):
        from torch.distributed.tensor.parallel import loss_parallel

        x, loss = ctx.graph
        del ctx.graph
        with loss_parallel():
            (dx,) = torch.autograd.grad(loss, x, grad)
        return dx, None
