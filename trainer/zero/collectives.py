"""Every collective ZeRO 0-2 makes, in one place: where a compressed or quantized collective plugs in.

    all_reduce(flat_fp32, dp_group)                  # stage 0: whole gradients
    reduce_scatter(my_chunks, packed, shard_group)   # stages 1-2: gradients, bucket by bucket
    all_gather(full, my_chunks, shard_group)         # stages 1-2: updated parameters, bucket by bucket

Each takes flat tensors (a bucket's rows, rank by rank) and a process group; ``None`` for the group means
a group of one (nothing to exchange). Stage 3 is FSDP2's, which makes its own collectives (ZeRO++ plugs
into them in :mod:`trainer.zero.fsdp_comm`). The collectives torch names differently across releases go
through :mod:`trainer.compat`.

ZeRO++ (``block`` > 0, :mod:`trainer.zero.quantize`): ``all_gather`` sends each rank's row as int8 with
one scale per ``block`` elements (qwZ) and every rank, the sender too, takes the dequantized rows, so
replicas never drift apart; ``reduce_scatter`` becomes an all-to-all of int8 rows, each rank
dequantizing the rows meant for it and summing them in fp32 (qgZ).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import compat
from .quantize import dequantize_rows, quantize_rows, row_bytes


def all_reduce(t: torch.Tensor, group) -> None:
    """``t`` summed over ``group``, in place."""
    if group is not None:
        dist.all_reduce(t, group=group)


def reduce_scatter(out: torch.Tensor, packed: torch.Tensor, group, block: int = 0) -> None:
    """``packed`` (one row per rank of ``group``) summed over ``group``; this rank's row into ``out``
    (as int8 rows with ``block`` > 0: qgZ)."""
    if group is None:
        out.copy_(packed)
    elif block:
        quantized_reduce_scatter(out, packed, group, block)
    else:
        compat.reduce_scatter_single(out, packed, group=group)


def all_gather(full: torch.Tensor, mine: torch.Tensor, group, block: int = 0) -> None:
    """Every rank's ``mine`` into ``full``, row by rank (int8 on the wire with ``block`` > 0: qwZ; then
    this rank's own row in ``full`` is its dequantized ``mine`` too)."""
    if block and group is not None:
        quantized_all_gather(full, mine, group, block)
    else:
        compat.all_gather_single(full, mine, group=group)


def quantized_all_gather(full: torch.Tensor, mine: torch.Tensor, group, block: int) -> None:
    """qwZ: ``mine`` quantized, the packed rows all-gathered (one collective), every row dequantized into ``full``."""
    n, m = dist.get_world_size(group), mine.numel()
    wire = row_bytes(m, block)
    send = torch.empty(1, wire, dtype=torch.uint8, device=mine.device)
    quantize_rows(mine.view(1, m), block, send)
    recv = torch.empty(n, wire, dtype=torch.uint8, device=mine.device)
    compat.all_gather_single(recv.view(-1), send.view(-1), group=group)
    dequantize_rows(recv, m, block, full.view(n, m))


def quantized_reduce_scatter(out: torch.Tensor, packed: torch.Tensor, group, block: int) -> None:
    """qgZ: every rank's row r quantized and sent to rank r by one all-to-all; the n rows received are
    dequantized and summed in fp32 into ``out``."""
    n, m = dist.get_world_size(group), out.numel()
    wire = row_bytes(m, block)
    send = torch.empty(n, wire, dtype=torch.uint8, device=out.device)
    quantize_rows(packed.view(n, m), block, send)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.view(-1), group=group)
    rows = torch.empty(n, m, dtype=torch.float32, device=out.device)
    dequantize_rows(recv, m, block, rows)
    out.copy_(rows.sum(dim=0))
