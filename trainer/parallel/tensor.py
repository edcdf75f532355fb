"""Tensor parallelism: applied from the model's own plan, and what it needs of every model: gradients
in their parameters' placements, and the language-model loss.

    apply_tp(spec, model, tp_mesh, pcfg)  # the spec's TP (and sequence, loss) parallel plan over ``tp``
    grads_as_placed(model)              # ZeRO 0-2 read each DTensor gradient as its parameter's shard
    loss = lm_loss(logits, targets)     # mean next-token cross-entropy in fp32; vocab-sharded logits too

A model's own plan lives with its family (:mod:`trainer.models`: the built-in decoder's in
:mod:`trainer.models.decoder.tp`).

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
from torch.distributed.tensor import DTensor


def apply_tp(spec, model: nn.Module, tp_mesh, pcfg) -> None:
    """Shard ``model`` over ``tp_mesh`` with its spec's plan (:meth:`trainer.models.spec.ModelSpec.apply_tp`);
    nothing without a ``tp`` axis (``tp_mesh`` None)."""
    if tp_mesh is not None:
        spec.apply_tp(model, tp_mesh, pcfg)


def grads_as_placed(model: nn.Module) -> None:
    """Make every DTensor parameter's gradient arrive in the parameter's own placements, as FSDP2
    does for its own; ZeRO 0-2 (:mod:`trainer.zero`) read gradients as the parameter's local shard.

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
