"""Mixture-of-Experts functions run inside real process groups (tests.harness.run_ranks)."""

from __future__ import annotations

from tests.jobs import CPU, trainers
from trainer.world import World, init_distributed, shutdown_distributed


def train_moe(payload: dict) -> dict:
    """Each layout of ``payload["layouts"]`` for ``payload["steps"]`` steps: its losses, aux losses,
    imbalance ratios and (``payload["params"]``, world 1) the trained parameters."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        out = {}
        for name, _, trainer in trainers(world, payload["base"], payload["layouts"]):
            stats = [trainer.train_step() for _ in range(payload["steps"])]
            out[name] = {"losses": [s.loss for s in stats], "aux": [s.aux_loss for s in stats],
                         "imbalance": [s.moe_imbalance for s in stats]}
            if payload.get("params"):
                out[name]["params"] = {n: p.detach().clone() for n, p in trainer.parts.named_parameters()}
            del trainer
        return out
    finally:
        shutdown_distributed()
