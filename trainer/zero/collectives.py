"""Every collective ZeRO 0-2 makes, in one place: where a compressed or quantized collective plugs in.

    all_reduce(flat_fp32, dp_group)                  # stage 0: whole gradients
    reduce_scatter(my_chunks, packed, shard_group)   # stages 1-2: gradients, bucket by bucket
    all_gather(full, my_chunks, shard_group)         # stages 1-2: updated parameters, bucket by bucket

Each takes flat tensors (a bucket's rows, rank by rank) and a process group; ``None`` for the group means
a group of one (nothing to exchange). Stage 3 is FSDP2's, which makes its own collectives. The
collectives torch names differently across releases go through :mod:`trainer.compat`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import compat


def all_reduce(t: torch.Tensor, group) -> None:
    """``t`` summed over ``group``, in place."""
    if group is not None:
        dist.all_reduce(t, group=group)


def reduce_scatter(out: torch.Tensor, packed: torch.Tensor, group) -> None:
    """``packed`` (one row per rank of ``group``) summed over ``group``; this rank's row into ``out``."""
    if group is not None:
        compat.reduce_scatter_single(out, packed, group=group)
    else:
        out.copy_(packed)


def all_gather(full: torch.Tensor, mine: torch.Tensor, group) -> None:
    """Every rank's ``mine`` into ``full``, row by rank."""
    compat.all_gather_single(full, mine, group=group)
