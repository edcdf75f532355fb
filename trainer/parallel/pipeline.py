"""Pipeline parallelism: the cut into stages (asked of the model's spec, :meth:`ModelSpec.build_stage`) and
the schedule that runs them (:class:`Pipeline`, over ``torch.distributed.pipelining``).

    n_stages, stage_ids = dims.stages(rank, per_rank)      # which stages this rank holds
    stage = cut_stage(spec, cfg, s, n_stages, dims, device) # one stage: its module and its blocks
    pipe = Pipeline(modules, stage_ids, n_stages, device, dims.group(mesh, Axis.PP), schedule, n_mb)
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from ..config import RunConfig
from .dims import ParallelDims
from .tensor import lm_loss


def cut_stage(spec, cfg: RunConfig, stage_id: int, n_stages: int, dims: ParallelDims, device: torch.device):
    """Stage ``stage_id`` of the model cut into ``n_stages`` (the whole model without pipelining), keeping
    parameter names (FQNs): the spec's :class:`trainer.models.spec.Stage`."""
    return spec.build_stage(cfg, stage_id, n_stages if dims.pp > 1 else 1, device)


class Pipeline:
    """A ``torch.distributed.pipelining`` schedule over this rank's stages.

    Each micro-batch's loss is divided by the micro-batch count (and the
    schedule's own gradient scaling is off), so gradients are the mean over
    the local batch, as without pipelining.
    """

    def __init__(self, modules, stage_ids, n_stages, device, group, schedule: str, n_microbatches: int,
                 keep_state: Callable[[], Callable[[], None]] | None = None):
        """``keep_state``: snapshots what the stages' forward and backward count (a Mixture of Experts' routing
        figures) and returns its restore; the schedule's metadata inference (its first step, and after a switch
        between training and evaluation) runs the stages once more on the first micro-batch (and on
        uninitialized activations after the first stage), and is restored away."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.n_microbatches = n_microbatches
        self.has_first = 0 in stage_ids
        self.has_last = n_stages - 1 in stage_ids
        stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(modules, stage_ids)]
        if keep_state is not None:
            for stage in stages:
                for name in ("_prepare_forward_infra", "_prepare_backward_infra"):
                    setattr(stage, name, _restoring(getattr(stage, name), keep_state))
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[schedule]
        first = stages if schedule == "interleaved_1f1b" else stages[0]
        self.schedule = cls(first, n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets) / self.n_microbatches

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, backward: bool = True) -> torch.Tensor | None:
        """Forward and backward (or, with ``backward=False``, forward only) over the local batch; the
        summed loss on the last stage."""
        losses: list[torch.Tensor] = []
        # Contiguous: torch 2.11's stages check the input's strides against the ones they inferred
        # (the tokens are a view of rows one token longer).
        args = (inputs.contiguous(),) if self.has_first else ()
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, target=targets if self.has_last else None, losses=losses)
        if not self.has_last:
            return None
        return torch.stack([x.detach().float() for x in losses]).sum()


def _restoring(fn: Callable, keep_state: Callable[[], Callable[[], None]]) -> Callable:
    def run(*args, **kwargs):
        restore = keep_state()
        try:
            return fn(*args, **kwargs)
        finally:
            restore()
    return run
