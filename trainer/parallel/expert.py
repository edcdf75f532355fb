"""Expert parallelism (``[parallel] ep``): each group of ``ep`` consecutive data-parallel ranks splits the
experts of every Mixture-of-Experts layer (:mod:`trainer.models.moe`) between them.

    apply_ep(model, dims, rank)      # before AC and FSDP (trainer.parallel.parallelize's order)

A rank of the group computes experts ``[ep_rank * n/ep, (ep_rank + 1) * n/ep)`` for the tokens of every
rank of the group: the routed slots, sorted by expert, travel to their experts' ranks by
``all_to_all_single`` with uneven splits (the counts first, by an even all-to-all), are regrouped by
expert, computed, and travel back the same way; :class:`AllToAll` carries gradients backward by the
reverse all-to-all.

The expert weights keep their whole shape on every rank (all ``n`` experts: the same FQNs and shapes at
every ep, so a checkpoint resumes at any ep and world size), and the gradient of an expert a rank does
not compute is zero there. The data-parallel average that every ZeRO stage already takes (the sum over the
``dp`` ranks / ``dp``) is then exactly the world-1 gradient: an expert's gradient is summed over the ranks
that computed it, each holding its group's tokens, and divided by ``dp``. ZeRO-3 shards those weights over
the data-parallel ranks like every other parameter; ZeRO 0-2 hold them whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallel:
    """One rank's place in its ep group: dispatch, local experts, combine (:meth:`run`)."""

    def __init__(self, group, rank: int, size: int, n_experts: int):
        self.group, self.rank, self.size = group, rank, size
        self.n_local = n_experts // size
        self.first = rank * self.n_local

    def run(self, experts: nn.Module, slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``slots`` sorted by (global) expert, ``counts[e]`` of them for expert e: the experts' outputs,
        in the same order, computed on the experts' ranks."""
        send = counts.view(self.size, self.n_local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        got = AllToAll.apply(slots, out_splits, in_splits, self.group)
        # got: by source rank, then local expert; regroup by local expert, then source rank.
        segments = torch.arange(self.size * self.n_local, device=slots.device)
        key = (segments % self.n_local) * self.size + segments // self.n_local
        order = key.repeat_interleave(recv.flatten()).argsort(stable=True)
        out = experts(got[order], recv.sum(0).tolist(), first=self.first)
        out = torch.zeros_like(out).index_copy(0, order, out)
        return AllToAll.apply(out, in_splits, out_splits, self.group)


def apply_ep(model: nn.Module, dims, rank: int) -> None:
    """Give every MoE layer of ``model`` this rank's ep group (nothing at ep 1). Collective: every rank
    creates every ep group, in the same order."""
    from ..models.moe import moe_layers

    layers = moe_layers(model)
    if dims.ep == 1 or not layers:
        return
    from ..telemetry import comm_meter

    group, _ = dist.new_subgroups(group_size=dims.ep)
    comm_meter().label_group(group, "ep")  # etrain_comm_*{kind="all_to_all", axis="ep"}
    for moe in layers:
        moe.ep = ExpertParallel(group, rank % dims.ep, dims.ep, moe.n_experts)
