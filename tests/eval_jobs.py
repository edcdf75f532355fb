"""Evaluation jobs run inside real multi-process groups (see tests.harness)."""

from __future__ import annotations

import torch

from trainer.config.load import load_config
from trainer.loop import Trainer
from trainer.world import World, init_distributed, shutdown_distributed


def train_with_eval(payload: dict) -> dict:
    """Train through run_steps with [eval] on, then evaluate once more by hand; the step stats and the
    extra evaluation."""
    world = World.from_env()
    init_distributed(world, torch.device("cpu"))
    try:
        out = {}
        for name, overrides in payload["runs"]:
            cfg = load_config(None, payload["base"] + overrides)
            trainer = Trainer(cfg, world, device=torch.device("cpu"))
            stats = [s.to_dict() for s in trainer.run_steps(cfg.train.steps)]
            out[name] = {"stats": stats, "again": trainer.evaluate() if trainer.val_batcher else None,
                         "val_tokens": trainer.val_corpus.n_tokens if trainer.val_corpus else 0,
                         "train_tokens": trainer.corpus.n_tokens}
        return out
    finally:
        shutdown_distributed()
