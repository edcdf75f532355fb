"""What every ZeRO stage shares: the optimizer interface, AdamW and its state, local tensors, byte counts.

    class MyOptimizer(Optimizer): ...     # the interface trainer.loop drives (see Optimizer)
    opt = make_adamw(groups, cfg.train)   # torch's AdamW: fused on GPUs, foreach elsewhere (train.optimizer_impl)
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from ..config import TrainConfig
from ..models.spec import dtensor_like
from ..parallel.dims import DATA_AXES, DERIVED, EXPERT_SHARD_CP, EXPERT_SPLIT, Axis, ParallelDims


class Optimizer(Protocol):
    """What the step loop (``trainer.loop.Trainer``) asks of an optimizer, whatever the stage:

    for each micro-batch ``before_backward(final)``, backward, ``after_backward(final)``; then
    ``local_norm_sq()`` (all-reduced by the caller for the global norm), ``step(lr, clip_coef)``,
    ``zero_grad()``. ``checkpoint_state()`` is the state dict a checkpoint saves and loads in place
    (``after_load()`` then puts it to use); ``memory_bytes()`` what this rank holds, by kind."""

    optimizer: torch.optim.Optimizer

    def before_backward(self, final: bool) -> None: ...

    def after_backward(self, final: bool) -> None: ...

    def local_norm_sq(self) -> torch.Tensor: ...

    def step(self, lr: float, clip_coef: float) -> None: ...

    def zero_grad(self) -> None: ...

    def checkpoint_state(self) -> dict: ...

    def after_load(self) -> None: ...

    def memory_bytes(self) -> dict[str, int]: ...


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def tp_shard_dim(p: torch.Tensor) -> int | None:
    """The tensor dim that tensor parallelism shards, if any."""
    if isinstance(p, DTensor):
        for pl in p.placements:
            if pl.is_shard():
                return pl.dim
    return None


def dtensor_replicas(t: DTensor, dims: ParallelDims) -> int:
    """World-wide identical copies of a DTensor's local shard (for the global norm).

    Every data-parallel or tensor-parallel axis counts that is Replicate in its
    placements or absent from its mesh; pipeline stages hold different tensors.
    """
    names = t.device_mesh.mesh_dim_names or ()
    reps = 1
    for axis in (*DATA_AXES, Axis.CP, Axis.TP):
        if axis in (Axis.DP_SHARD, Axis.CP) and EXPERT_SHARD_CP in names:
            # the experts' own FSDP units under cp shard over dp_shard / ep x cp flattened, split over ep
            if axis == Axis.DP_SHARD:
                reps *= math.prod(t.device_mesh.size(names.index(n)) for n in (EXPERT_SHARD_CP, Axis.EP.value)
                                  if t.placements[names.index(n)].is_replicate())
            continue
        if axis == Axis.DP_SHARD and all(n in names for n in EXPERT_SPLIT):
            # the expert mesh splits dp_shard in two dimensions (ParallelDims.expert_mesh): each counts alone
            reps *= math.prod(t.device_mesh.size(names.index(n)) for n in EXPERT_SPLIT
                              if t.placements[names.index(n)].is_replicate())
            continue
        # a flattened mesh dimension (dp_shard_cp) places each of its axes as it places itself
        dim = next((i for i, n in enumerate(names) if n == axis or axis in DERIVED.get(n, ())), None)
        if dims.size(axis) > 1 and (dim is None or t.placements[dim].is_replicate()):
            reps *= dims.size(axis)
    return reps


def decays(fqn: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices (linear and embedding weights), not on norms."""
    return p.ndim >= 2


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state now (it is otherwise made at the first step), so a checkpoint can load into it.

    Zeros with step 0 are exactly what AdamW would create itself.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                # The fused kernels read the step count on the parameter's device, as AdamW makes it.
                on_device = group.get("fused") or group.get("capturable")
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else None)
                st["exp_avg"] = zeros_like(p)
                st["exp_avg_sq"] = zeros_like(p)


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.zeros_like(t)``, a DTensor made from its local tensor (``dtensor_like``: no sharding propagation
    inside a standby's restore)."""
    return dtensor_like(t, torch.zeros_like(local_tensor(t), memory_format=torch.preserve_format))


def adam_entries(st: dict, wrap) -> dict:
    return {"exp_avg": wrap(st["exp_avg"]), "exp_avg_sq": wrap(st["exp_avg_sq"]), "step": st["step"]}


def adamw_impl(ocfg: TrainConfig, params: list[torch.Tensor]) -> str:
    """``train.optimizer_impl`` resolved for ``params``: "auto" is "fused" when they all live on a GPU, else
    "foreach" (CPU has fused kernels too, but they gain little there over foreach)."""
    if ocfg.optimizer_impl != "auto":
        return ocfg.optimizer_impl
    on_gpu = bool(params) and all(local_tensor(p).device.type == "cuda" for p in params)
    return "fused" if on_gpu else "foreach"


def make_adamw(groups: list[dict], ocfg: TrainConfig) -> torch.optim.AdamW:
    live = [g for g in groups if g["params"]]
    impl = adamw_impl(ocfg, [p for g in live for p in g["params"]])
    return torch.optim.AdamW(
        live,
        lr=ocfg.lr,
        betas=(ocfg.beta1, ocfg.beta2),
        eps=ocfg.eps,
        foreach=impl == "foreach",
        fused=impl == "fused",
    )


def storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = local_tensor(t).untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total
