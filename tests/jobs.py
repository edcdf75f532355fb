"""Functions that tests run inside real multi-process groups (see tests.harness)."""

from __future__ import annotations

import gc

import torch

from trainer.config_load import load_config
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


def comm_volume(payload: dict) -> dict:
    """Per-step collective bytes by (kind, axis) measured by the comm meter over a few steps, with
    the model's full parameter bytes and per-block bytes for the analytic FSDP volume."""
    from trainer.telemetry import comm_meter

    meter = comm_meter()
    meter.reset()
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        cfg = load_config(None, payload["overrides"])
        trainer = Trainer(cfg, world, device=CPU)
        meter.name_axes(trainer.mesh)
        trainer.train_step()  # warm-up (lazy init)
        before = {(c["kind"], c["axis"]): c for c in meter.snapshot()}
        steps = payload["steps"]
        for _ in range(steps):
            trainer.train_step()
        out = {}
        for c in meter.snapshot():
            b = before.get((c["kind"], c["axis"]), {"bytes": 0, "calls": 0, "seconds": 0.0, "bus_bytes": 0.0})
            out[f"{c['kind']}/{c['axis']}"] = {k: (c[k] - b[k]) / steps for k in ("bytes", "calls", "seconds",
                                                                                   "bus_bytes")}
        model = trainer.parts.modules[0]
        blocks = list(model.layers.values())
        full = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731 (DTensor numel is global)
        return {"per_step": out, "param_bytes": full(model.parameters()),
                "block_bytes": [full(b.parameters()) for b in blocks]}
    finally:
        shutdown_distributed()
