"""Functions that tests/test_memory.py and bench/memory.py run inside real process groups (tests.harness).

    run_ranks("tests.memory_jobs:peak_layouts", 4, {"base": [...], "layouts": [(name, overrides, steps, measure)]})
"""

from __future__ import annotations

import gc

import torch

from trainer import memory
from trainer.config_load import load_config
from trainer.data import Corpus, load_corpus
from trainer.loop import Trainer
from trainer.telemetry import comm_meter
from trainer.world import World, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def measure_step(trainer: Trainer) -> dict:
    """:func:`trainer.memory.measure_step`, with the collectives the step made per "kind/axis"."""
    meter = comm_meter()
    meter.name_axes(trainer.mesh)
    before = {(c["kind"], c["axis"]): c["calls"] for c in meter.snapshot()}
    res = memory.measure_step(trainer)
    calls = {f"{c['kind']}/{c['axis']}": c["calls"] - before.get((c["kind"], c["axis"]), 0)
             for c in meter.snapshot()}
    return {**res, "calls": {k: v for k, v in calls.items() if v}}


def _train(cfg, world: World, corpus: Corpus, steps: int, measure: bool) -> dict:
    """``steps`` steps of a fresh trainer; with ``measure`` the second one (the first after AdamW made
    its state) runs under StepMemory."""
    gc.collect()  # the previous layout's trainer (its gradient hooks make cycles)
    trainer = Trainer(cfg, world, corpus=corpus, device=CPU)
    losses = [trainer.train_step().loss]
    res = measure_step(trainer) if measure else {"loss": trainer.train_step().loss}
    losses.append(res["loss"])
    losses += [trainer.train_step().loss for _ in range(steps - 2)]
    return {**res, "losses": losses}


def peak_layouts(payload: dict) -> dict:
    """Per layout ``(name, overrides, steps, measure)`` (steps >= 2): its losses and its measured step."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        base = payload["base"]
        corpus = load_corpus(load_config(None, base).data)
        return {name: _train(load_config(None, base + overrides), world, corpus, steps, measure)
                for name, overrides, steps, measure in payload["layouts"]}
    finally:
        shutdown_distributed()
