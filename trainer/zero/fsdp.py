"""ZeRO stage 3: AdamW over FSDP2's sharded DTensor parameters (:class:`FSDPOptimizer`)."""

from __future__ import annotations

import logging

import torch
from torch.distributed.fsdp import FSDPModule
from torch.optim.adam import adam

from ..config import RunConfig
from ..parallel.dims import ParallelDims
from ..parallel.parallelize import ModelParts
from .fsdp_comm import install_fsdp_comms
from .common import adam_entries, decays, dtensor_replicas, ensure_adam_state, local_tensor, make_adamw, storage_bytes
from .offload import make_offload

log = logging.getLogger("etrain")


class FSDPOptimizer:
    """ZeRO stage 3: AdamW over FSDP2's sharded DTensor parameters."""

    def __init__(self, parts: ModelParts, cfg: RunConfig, dims: ParallelDims, rank: int = 0):
        self.cfg = cfg.train
        self.dims = dims
        self.modules = [m for m in parts.modules if isinstance(m, FSDPModule)]
        # A pipeline schedule turns FSDP's gradient sync off and on itself (PipelineStage).
        self.sync_each = None if parts.pipeline is not None else cfg.parallel.reduce_every_microbatch
        if parts.pipeline is not None and cfg.parallel.reduce_every_microbatch and rank == 0:
            log.warning("parallel.reduce_every_microbatch has no effect under pipeline parallelism: the "
                        "schedule reduce-scatters once, after the last micro-batch")
        # ZeRO++'s quantized all-gather / reduce-scatter, on every FSDP2 module (each block, then the root).
        install_fsdp_comms([s for m in parts.modules for s in m.modules() if isinstance(s, FSDPModule)],
                           cfg.parallel, dims.zero_shards, rank)
        self.params = [p for _, p in parts.named_parameters()]
        self.fqns = [fqn for fqn, _ in parts.named_parameters()]
        groups = [{"params": [], "weight_decay": self.cfg.weight_decay}, {"params": [], "weight_decay": 0.0}]
        for fqn, p in parts.named_parameters():
            groups[0 if decays(fqn, p) else 1]["params"].append(p)
        self.optimizer = make_adamw(groups, self.cfg)
        self.offload = make_offload(self.optimizer, cfg, rank)  # parallel.offload="nvme": the state in a file

    def checkpoint_state(self) -> dict:
        """FSDP2's sharded parameters and AdamW state: DTensors of the global shapes."""
        if self.offload is None:
            ensure_adam_state(self.optimizer)
        states = self.optimizer.state if self.offload is None else self.offload.states()
        model = dict(zip(self.fqns, self.params))
        optim = {fqn: adam_entries(states[p], lambda t: t) for fqn, p in zip(self.fqns, self.params)}
        return {"model": model, "optim": optim}

    def after_load(self) -> None:
        """Nothing to do: DCP loaded straight into the sharded parameters and state."""

    def before_backward(self, final: bool) -> None:
        """Before each micro-batch: FSDP reduce-scatters in that backward only for the last micro-batch
        (gradients accumulate unsharded until then), or for every one with
        ``parallel.reduce_every_microbatch`` (sharded accumulation: less memory, more traffic)."""
        if self.sync_each is not None:
            for m in self.modules:
                m.set_requires_gradient_sync(final or self.sync_each)

    def after_backward(self, final: bool) -> None:
        """FSDP reduce-scatters inside backward; nothing to do here."""

    def local_norm_sq(self) -> torch.Tensor:
        device = local_tensor(self.params[0]).device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for p in self.params:
            if p.grad is not None:
                total += local_tensor(p.grad).float().pow(2).sum() / dtensor_replicas(p.grad, self.dims)
        return total

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float) -> None:
        """AdamW on the local shards: torch's own AdamW arithmetic (``torch.optim.adam.adam``, foreach or
        fused as ``train.optimizer_impl`` resolves), fed each DTensor's local tensor.

        AdamW is elementwise, so updating the shards is updating the parameters. Stepping the
        DTensors themselves makes DTensor propagate the sharding of every foreach op, and a process
        that joins a new group (which must forget those decisions, ``trainer.world.forget_meshes``)
        pays for that again in its first step: 0.7-0.8 s of the tiny model's first step after
        every re-formation, measured here.
        """
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        if clip_coef < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coef)
        if self.offload is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.offload.step()
            return
        ensure_adam_state(self.optimizer)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
            live = [p for p in g["params"] if p.grad is not None]
            if not live:
                continue
            states = [self.optimizer.state[p] for p in live]
            adam([local_tensor(p) for p in live], [local_tensor(p.grad) for p in live],
                 [local_tensor(st["exp_avg"]) for st in states], [local_tensor(st["exp_avg_sq"]) for st in states],
                 [], [st["step"] for st in states], foreach=g["foreach"], fused=g["fused"],
                 decoupled_weight_decay=True, amsgrad=False,
                 beta1=g["betas"][0], beta2=g["betas"][1], lr=lr, weight_decay=g["weight_decay"], eps=g["eps"],
                 maximize=False)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def memory_bytes(self) -> dict[str, int]:
        state = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        return {"params": storage_bytes(self.params), "grads": storage_bytes(p.grad for p in self.params),
                "optimizer": storage_bytes(state) + (self.offload.host_bytes if self.offload is not None else 0)}
