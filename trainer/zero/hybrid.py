"""Expert parallelism under ZeRO 0-2: the dense parameters by the ZeRO stage, the experts by FSDP.

    opt = HybridOptimizer(parts, cfg, dims, mesh, rank)    # parts.expert_units: the experts' FSDP units

Under ``parallel.ep > 1`` every MoE layer's experts are split over the ep ranks and sharded over the
data-parallel ranks outside ep by FSDP units of their own (:mod:`trainer.parallel.expert`), whatever the ZeRO
stage; their gradients are reduced there, divided by the whole data-parallel size. At ZeRO 0-2 the other
parameters keep the stage's treatment (:class:`~trainer.zero.stages.ZeroOptimizer`), and the experts are
stepped as ZeRO-3 steps its shards (:class:`~trainer.zero.fsdp.FSDPOptimizer`). This class drives both
through the one interface the step loop knows; their checkpoint states are disjoint (by FQN) and merge.
In bf16 the stage keeps fp32 masters of the dense parameters, and the experts' units keep fp32 shards that
compute in bf16 (FSDP's mixed-precision policy; trainer.parallel.parallelize casts them back after the
model's cast).
"""

from __future__ import annotations

import torch

from ..config import RunConfig
from ..parallel.dims import ParallelDims
from ..parallel.parallelize import ModelParts
from .fsdp import FSDPOptimizer
from .stages import ZeroOptimizer


class _Part:
    """What an optimizer reads of :class:`ModelParts`: some of its parameters, the modules it steers."""

    def __init__(self, named: list, modules: list):
        self._named, self.modules, self.pipeline = named, modules, None

    def named_parameters(self):
        yield from self._named


class HybridOptimizer:
    """ZeRO 0-2 for the dense parameters, FSDP's optimizer for the experts' units (module docstring)."""

    def __init__(self, parts: ModelParts, cfg: RunConfig, dims: ParallelDims, mesh, rank: int):
        mine = {id(p) for m in parts.expert_units for p in m.parameters()}
        named = list(parts.named_parameters())
        self.dense = ZeroOptimizer(_Part([(n, p) for n, p in named if id(p) not in mine], parts.modules), cfg,
                                   dims, mesh, rank)
        self.experts = FSDPOptimizer(_Part([(n, p) for n, p in named if id(p) in mine], parts.expert_units), cfg,
                                     dims, rank)
        self.optimizer = self.dense.optimizer  # the dense AdamW (StepMemory's count of state tensors)
        self._both = (self.dense, self.experts)

    def before_backward(self, final: bool) -> None:
        for o in self._both:
            o.before_backward(final)

    def after_backward(self, final: bool) -> None:
        for o in self._both:
            o.after_backward(final)

    def local_norm_sq(self) -> torch.Tensor:
        return self.dense.local_norm_sq() + self.experts.local_norm_sq()

    def step(self, lr: float, clip_coef: float) -> None:
        for o in self._both:
            o.step(lr, clip_coef)

    def zero_grad(self) -> None:
        for o in self._both:
            o.zero_grad()

    def checkpoint_state(self) -> dict:
        a, b = (o.checkpoint_state() for o in self._both)
        return {"model": {**a["model"], **b["model"]}, "optim": {**a["optim"], **b["optim"]}}

    def after_load(self) -> None:
        for o in self._both:
            o.after_load()

    def memory_bytes(self) -> dict[str, int]:
        a, b = (o.memory_bytes() for o in self._both)
        return {k: a[k] + b[k] for k in a}
