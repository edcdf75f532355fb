"""The experts' matmuls as grouped GEMMs: one call per projection for all of a rank's experts.

    y = expert_linear(x, w, counts)   # x (slots, in) sorted by expert, counts[e] slots for expert e,
                                      # w (experts, out, in): each expert's slots times w[e].T, in order
    expert_linear(x, w, counts, grouped=False)   # the same by a Python loop over the experts

torch's grouped GEMM (``F.grouped_mm``; ``torch._grouped_mm`` where that is all a release has) takes the
slots of every expert at once, delimited by int32 cumulative counts (an expert with no slots is an empty
group). It is taken where it runs for the device and dtype, found once per (device, dtype, weight shape) by
a small forward and backward (:func:`grouped_mm_runs`), with 16-byte-aligned operands (torch's kernels
require it on some releases); elsewhere, and while torch.compile traces, the loop. On CPU (torch 2.11 and
2.13, fp32 and bf16) torch runs it as a loop of matmuls in C++, one per expert: the same bits as the Python
loop forward and backward (tests/trainer/test_moe.py checks it), without a Python call and an autograd node per
expert. On CUDA, bf16 on Hopper and newer runs a fused kernel whose sums may differ from the loop's in the
last bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_RUNS: dict[tuple, bool] = {}


def grouped_mm():
    """torch's grouped GEMM function, None where the installed torch has none."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient: grouped GEMM's backward refuses an
    expanded one (the gradient of ``y.sum()`` has stride 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
    return _ContiguousGrad.apply(grouped_mm()(x, w.transpose(-2, -1), offs=offs))


def grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether grouped GEMM runs, forward and backward, for ``x``'s device and dtype and ``w``'s shape
    (probed once each on two small groups, one of them empty)."""
    if grouped_mm() is None or torch.compiler.is_compiling():
        return False
    key = (x.device, x.dtype, tuple(w.shape[1:]))
    if key not in _RUNS:
        try:
            with torch.inference_mode(False), torch.enable_grad():
                xs = torch.randn(3, w.shape[2], device=x.device, dtype=x.dtype, requires_grad=True)
                ws = torch.randn(2, *w.shape[1:], device=x.device, dtype=x.dtype, requires_grad=True)
                y = _grouped(xs, ws, [3, 0])
                torch.autograd.grad(y, (xs, ws), torch.randn_like(y))
            _RUNS[key] = True
        except (RuntimeError, NotImplementedError):
            _RUNS[key] = False
    return _RUNS[key]


def expert_linear(x: torch.Tensor, w: torch.Tensor, counts: list[int], grouped: bool = True) -> torch.Tensor:
    """``x[slots of e] @ w[e].T`` for every expert ``e`` in order (``sum(counts)`` rows of ``w.shape[1]``):
    by grouped GEMM where it runs (and ``grouped``), else by a loop over the experts."""
    if grouped and x.dtype == w.dtype and len(counts) == w.shape[0] and grouped_mm_runs(x, w) \
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0:
        return _grouped(x, w, counts)
    outs = [chunk @ w[e].t() for e, chunk in enumerate(x.split(counts))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])
