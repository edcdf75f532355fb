"""Tensor parallelism of the built-in decoder, and the language-model loss.

    apply_tp(model, tp_mesh)               # Megatron-style column/row-parallel blocks (DTensor plans)
    loss = lm_loss(logits, targets)        # mean next-token cross-entropy in fp32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from .model import Transformer


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism with DTensor plans.

    Attention q/k/v and the SwiGLU gate/up projections are column-wise (each
    rank owns whole heads / hidden units); the output projections are
    row-wise, so each block needs one all-reduce in forward and one in
    backward. The embedding is sharded by vocabulary rows, the output head by
    vocabulary columns with its logits gathered. Norms stay replicated.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if plan:
        parallelize_module(model, tp_mesh, plan)
    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
