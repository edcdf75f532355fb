"""ZeRO++'s block quantization: int8 values with one fp32 scale per block, packed as the bytes one rank sends.

    wire = row_bytes(numel, block)              # bytes per row: int8 values (padded to whole blocks) + scales
    quantize_rows(x, block, out)                # x [rows, numel] float -> out [rows, wire] uint8
    dequantize_rows(packed, numel, block, out)  # back into out [rows, numel] (any float dtype)

A row's bytes are its values rounded to int8 (``round(x / s)``, ``s = absmax / 127`` per block of
``block`` consecutive elements, the last block padded with zeros), then the block scales as fp32. Each
element is off by at most half its block's step: ``|x - dq(q(x))| <= absmax(block) / 254``. A block of
zeros has scale 0 and comes back as zeros. Symmetric rounding to nearest, as DeepSpeed's qwZ/qgZ kernels.

The collectives that send these rows are in :mod:`trainer.zero.collectives` (ZeRO 1-2) and
:mod:`trainer.zero.fsdp_comm` (ZeRO-3, FSDP2's custom all-gather and reduce-scatter).
"""

from __future__ import annotations

import torch

QMAX = 127.0
SCALE_BYTES = 4  # fp32


def blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def row_bytes(numel: int, block: int) -> int:
    """Bytes of one quantized row of ``numel`` elements: whole blocks of int8, then one fp32 scale per block."""
    nb = blocks(numel, block)
    return nb * block + SCALE_BYTES * nb


def _parts(packed: torch.Tensor, numel: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of ``packed`` [rows, row_bytes]: int8 values [rows, nb, block] and fp32 scales [rows, nb]."""
    nb = blocks(numel, block)
    rows = packed.shape[0]
    q = packed[:, : nb * block].view(torch.int8).view(rows, nb, block)
    scales = packed[:, nb * block :].view(torch.float32)
    return q, scales


@torch.no_grad()
def quantize_rows(x: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """Each row of ``x`` ([rows, numel], any float dtype) quantized into ``out`` ([rows, row_bytes], uint8)."""
    rows, numel = x.shape
    nb = blocks(numel, block)
    xf = x.float()
    if nb * block != numel:
        xf = torch.nn.functional.pad(xf, (0, nb * block - numel))
    xb = xf.view(rows, nb, block)
    q, scales = _parts(out, numel, block)
    scales.copy_(xb.abs().amax(dim=2).div_(QMAX))
    step = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
    q.copy_(torch.round(xb / step).clamp_(-QMAX, QMAX))


@torch.no_grad()
def dequantize_rows(packed: torch.Tensor, numel: int, block: int, out: torch.Tensor) -> None:
    """The rows of ``packed`` ([rows, row_bytes], uint8) as values, into ``out`` ([rows, numel])."""
    q, scales = _parts(packed, numel, block)
    rows = packed.shape[0]
    values = (q.float() * scales.unsqueeze(2)).view(rows, -1)
    out.copy_(values[:, :numel])


def quantize(x: torch.Tensor, block: int) -> torch.Tensor:
    """One flat tensor's packed row (a fresh uint8 tensor of ``row_bytes(x.numel(), block)``)."""
    out = torch.empty(1, row_bytes(x.numel(), block), dtype=torch.uint8, device=x.device)
    quantize_rows(x.reshape(1, -1), block, out)
    return out.view(-1)


def dequantize(packed: torch.Tensor, numel: int, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A packed row back as a flat tensor of ``numel`` elements of ``dtype``."""
    out = torch.empty(1, numel, dtype=dtype, device=packed.device)
    dequantize_rows(packed.view(1, -1), numel, block, out)
    return out.view(-1)
