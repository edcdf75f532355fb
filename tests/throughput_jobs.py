"""Rank jobs of tests/trainer/test_throughput.py (see tests.harness.run_ranks)."""

from __future__ import annotations

import torch

from trainer.config.load import load_config
from trainer.loop import Trainer
from trainer.world import World, forget_meshes, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def losses(payload: dict) -> dict[str, list[float]]:
    """Per ``(name, overrides)`` of ``payload["layouts"]``: the losses of ``payload["steps"]`` steps of
    ``payload["base"] + overrides`` in this world."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        out = {}
        for name, overrides in payload["layouts"]:
            forget_meshes()
            trainer = Trainer(load_config(None, payload["base"] + overrides), world, device=CPU)
            out[name] = [trainer.train_step().loss for _ in range(payload["steps"])]
            del trainer
        return out
    finally:
        shutdown_distributed()
