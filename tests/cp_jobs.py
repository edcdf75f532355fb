"""Context-parallel runs inside real process groups (tests.harness.run_ranks), for tests/trainer/test_context_parallel.py."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from tests.jobs import CPU, comm_per_step, metered_world, micro_batch_bytes, trainers
from trainer.world import World, init_distributed, shutdown_distributed


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train_with_grads(payload: dict) -> dict:
    """Per layout ``(name, overrides, steps)``: the losses of its steps, the reduced gradients of the first
    step (whole tensors, before clipping and the update), and the collectives per step after the first, by
    "kind/axis"."""
    with metered_world() as (world, meter):
        out = {}
        for name, rest, trainer in trainers(world, payload["base"], payload["layouts"]):
            meter.name_axes(trainer.mesh)
            grads = {}
            step = trainer.optimizer.step

            def capture(lr, coef, step=step, trainer=trainer):
                grads.update({n: _whole(p.grad) for n, p in trainer.parts.named_parameters() if p.grad is not None})
                trainer.optimizer.step = step
                return step(lr, coef)

            trainer.optimizer.step = capture
            losses = [trainer.train_step().loss]
            before = meter.snapshot()
            steps = rest[0]
            losses += [trainer.train_step().loss for _ in range(steps - 1)]
            out[name] = {"losses": losses, "grads": grads if world.rank == 0 else None,
                         "comm": comm_per_step(meter, before, steps - 1)}
            del trainer
        return out


def activation_peak(payload: dict) -> dict:
    """Per layout ``(name, overrides)``: the bytes one micro-batch's forward leaves for backward and the peak
    over its forward and backward on this rank (tests.jobs.LiveBytes), after one warm-up step."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        out = {}
        for name, _, trainer in trainers(world, payload["base"], payload["layouts"]):
            trainer.train_step()
            held, peak = micro_batch_bytes(trainer)
            out[name] = {"held": held, "peak": peak}
            del trainer
        return out
    finally:
        shutdown_distributed()
