"""Functions that tests run inside real multi-process groups (see tests.harness)."""

from __future__ import annotations

import gc

import torch

from trainer.config import load_config
from trainer.data import load_corpus
from trainer.loop import Trainer
from trainer.world import World, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def train_layouts(payload: dict) -> dict:
    """Train each layout for a few steps in this world; losses and memory per layout."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        base = payload["base"]
        corpus = load_corpus(load_config(None, base).data)
        out = {}
        for name, overrides in payload["layouts"]:
            cfg = load_config(None, base + overrides)
            trainer = Trainer(cfg, world, corpus=corpus, device=CPU)
            losses = [trainer.train_step().loss for _ in range(payload["steps"])]
            out[name] = {"losses": losses, "memory": trainer.memory_measured,
                         "predicted": trainer.memory_predicted()}
            del trainer
            gc.collect()
        return out
    finally:
        shutdown_distributed()
