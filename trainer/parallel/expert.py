"""Expert parallelism (``[parallel] ep``): each group of ``ep`` data-parallel ranks (along ``dp_shard``) splits
the experts of every Mixture-of-Experts layer (:mod:`trainer.models.moe`) between them.

    layers = spec.expert_layers(model)              # the model family's MoE layers (trainer.models.spec)
    meshes = expert_meshes(dims, mesh)              # once per rank (collective), whatever its stages hold
    apply_ep(layers, dims, meshes)                  # before AC and FSDP (trainer.parallel.parallelize's order)
    shard_experts(layers, dims, meshes, ...)        # before the blocks' fully_shard

A layer is what its family says (:meth:`~trainer.models.spec.ModelSpec.expert_layers`): ``experts``, a module
whose own parameters stack the experts on dim 0, ``n_experts``, and ``ep``, set here to the layer's
:class:`ExpertParallel` (the layer then sends its routed slots through :meth:`ExpertParallel.run`).

A rank of the group computes experts ``[ep_rank * n/ep, (ep_rank + 1) * n/ep)`` for the tokens of every
rank of the group: the routed slots, sorted by expert, travel to their experts' ranks by
``all_to_all_single`` with uneven splits (the counts first, by an even all-to-all), are regrouped by
expert, computed, and travel back the same way; :class:`AllToAll` carries gradients backward by the
reverse all-to-all.

Each rank holds only its own experts: the stacked expert weights become DTensors sharded on the expert dim
(``Shard(0)``) over the ``ep`` dimension of the expert mesh (:meth:`ParallelDims.expert_mesh`: ``dp_shard``
split into ``dp_shard / ep`` x ``ep``). They keep their global shapes and names, so DCP reshards a
checkpoint to any ep and world size. ZeRO-3 shards them further, by a ``fully_shard`` of their own over the
data-parallel ranks outside ep (``dp_shard / ep``, x ``dp_replicate`` as HSDP), and the cp ranks under
context parallelism: those ranks hold the same experts, each computed on its own ep group's tokens (a cp
rank's: its share of the sequences), so their summed gradient is divided by the whole data-parallel size x cp
(``grad_ranks``), not by the size of that mesh (FSDP's default, which would give ``ep`` times the world-1
gradient). The experts get those units at every ZeRO stage: under ZeRO 0-2 the other
parameters keep the stage's treatment and the experts are stepped as ZeRO-3 shards (trainer.zero.hybrid).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..world import name_group
from .dims import Axis


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


# torch's FSDP2 warns of every FSDP-wrapped module that returns a view: an in-place op on it would skip the
# pre-backward hook. The experts' fully_shard (shard_experts) returns one, grouped GEMM's identity with a
# contiguous gradient (trainer.models.grouped: ``x.view_as(x)`` of a fresh product), and ExpertParallel.run
# uses it out of place only (index_copy into a new tensor), so the warning does not apply there.
_VIEW_WARNING = re.escape("FSDP2-wrapped module (") + r"[^)]*" + re.escape(") returned a view tensor.")


class ExpertParallel:
    """One rank's place in its ep group: dispatch, local experts, combine (:meth:`run`)."""

    def __init__(self, group, rank: int, size: int, n_experts: int):
        self.group, self.rank, self.size = group, rank, size
        self.n_local = n_experts // size

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
        with warnings.catch_warnings():  # this call's view warning only (_VIEW_WARNING: it does not apply)
            warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)
            out = experts(got[order], recv.sum(0).tolist())  # this rank's experts only
        out = torch.zeros_like(out).index_copy(0, order, out)  # out of place: the view is never written
        return AllToAll.apply(out, in_splits, out_splits, self.group)


@dataclass(frozen=True)
class ExpertMeshes:
    """The meshes and the group of expert parallelism on this rank (:func:`expert_meshes`)."""

    emesh: DeviceMesh  # the expert mesh (ParallelDims.expert_mesh): the weights' ep dimension
    group: dist.ProcessGroup  # this rank's ep group, for the all-to-alls
    fsdp: DeviceMesh  # what the experts' own FSDP units shard over (ParallelDims.expert_fsdp_mesh)


def expert_meshes(dims, mesh) -> ExpertMeshes | None:
    """The expert mesh, the ep groups and the experts' FSDP mesh (None at ep 1). Collective: every rank calls
    it once, in the same order, whether or not its pipeline stages hold MoE layers."""
    emesh = dims.expert_mesh(mesh)
    if emesh is None:
        return None
    ep_mesh = emesh[Axis.EP.value]
    # The exchanges run on a group of their own (the mesh may share its ep group with dp_shard's, whose
    # collectives are metered under that name): the same ranks, in the same order.
    # Every ep group of the mesh, enumerated alike on every rank (under tp or cp an ep group is strided).
    ep_dim = emesh.mesh_dim_names.index(Axis.EP.value)
    groups = emesh.mesh.movedim(ep_dim, -1).reshape(-1, dims.ep).tolist()
    group, _ = dist.new_subgroups_by_enumeration(groups)
    if dist.get_rank(group) != ep_mesh.get_local_rank():
        raise RuntimeError(f"rank {dist.get_rank()}: ep group rank {dist.get_rank(group)} is not its expert "
                           f"mesh's {ep_mesh.get_local_rank()}")
    name_group(group, "ep")  # etrain_comm_*{kind="all_to_all", axis="ep"}
    fsdp_mesh = dims.expert_fsdp_mesh(emesh)
    if fsdp_mesh.size(fsdp_mesh.ndim - 1) > 1:
        name_group(fsdp_mesh.get_group(fsdp_mesh.ndim - 1), fsdp_mesh.mesh_dim_names[-1])
    return ExpertMeshes(emesh, group, fsdp_mesh)


def apply_ep(layers: list, dims, meshes: ExpertMeshes | None) -> ExpertMeshes | None:
    """Give every MoE layer (on the meta device, or built whole: its weights kept) its ep group and make its
    expert weights ``Shard(0)`` DTensors over the expert mesh's ``ep`` dimension; returns ``meshes`` (None at
    ep 1 or without MoE layers)."""
    if meshes is None or not layers:
        return None
    ep_mesh = meshes.emesh[Axis.EP.value]
    for moe in layers:
        moe.ep = ExpertParallel(meshes.group, ep_mesh.get_local_rank(), dims.ep, moe.n_experts)
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            mine = p.detach().chunk(dims.ep, dim=0)[moe.ep.rank]
            shard = DTensor.from_local(mine.clone(), ep_mesh, [Shard(0)], run_check=False,
                                       shape=p.shape, stride=p.stride())
            setattr(moe.experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
    return meshes


def shard_experts(layers: list, dims, meshes: ExpertMeshes, reshard: bool, **policies) -> None:
    """The ep-split experts sharded (at every ZeRO stage): a ``fully_shard`` per MoE layer's experts over the
    data-parallel ranks outside ep, x the cp ranks (:meth:`ParallelDims.expert_fsdp_mesh`), before the blocks'
    own ``fully_shard`` (which then leaves them out). They shard on dim 1 (the local expert count may be
    smaller than that mesh), and their gradient is divided by the whole data-parallel size x cp (the module
    docstring)."""
    from torch.distributed.fsdp import fully_shard

    fsdp_mesh = meshes.fsdp
    shards = fsdp_mesh.size(fsdp_mesh.ndim - 1)
    for moe in layers:
        dim = 1 if all(p.shape[1] % shards == 0 for p in moe.experts.parameters()) else 0
        fully_shard(moe.experts, mesh=fsdp_mesh, reshard_after_forward=reshard,
                    shard_placement_fn=lambda p, dim=dim: Shard(dim), **policies)
        moe.experts.set_gradient_divide_factor(float(dims.grad_ranks))
        # Plain sums on the wire, one division after: the factor is no group's size, and gloo has no
        # pre-multiplied sum (with a single shard FSDP divides while copying, and must not divide again).
        moe.experts.set_force_sum_reduction_for_comms(shards > 1)
