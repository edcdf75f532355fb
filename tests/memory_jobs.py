"""Functions that tests/trainer/test_memory.py and bench/memory.py run inside real process groups (tests.harness).

    run_ranks("tests.memory_jobs:peak_layouts", 4, {"base": [...], "layouts": [(name, overrides, steps, measure)]})
"""

from __future__ import annotations

import gc

import torch

from trainer.observe import device_memory as memory
from trainer.config.load import load_config
from trainer.data.corpus import Corpus, load_corpus
from trainer.loop import Trainer
from trainer.observe.telemetry import comm_meter
from trainer.world import World, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def measure_step(trainer: Trainer) -> dict:
    """:func:`trainer.observe.device_memory.measure_step`, with the collectives the step made per "kind/axis"."""
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


def build_peak(payload: dict) -> dict:
    """Per layout ``(name, overrides)``: the most bytes held at once while this rank builds its part of the
    model (``build_model_parts``, followed by ``StepMemory``), the bytes of its parameters after, the whole
    model's and its largest tensor's."""
    from torch.distributed.tensor import DTensor

    from trainer.models import spec_for
    from trainer.parallel.dims import ParallelDims
    from trainer.parallel.parallelize import build_model_parts

    world = World.from_env()
    init_distributed(world, CPU)
    try:
        out = {}
        for name, overrides in payload["layouts"]:
            cfg = load_config(None, payload["base"] + overrides)
            dims = ParallelDims.from_config(cfg, world.size)
            mesh = dims.build_mesh("cpu")
            whole = spec_for(cfg.model).build("meta")
            sizes = [p.numel() * p.element_size() for p in whole.parameters()]
            gc.collect()
            with memory.StepMemory([], torch.optim.SGD([torch.zeros(1, requires_grad=True)])) as mem:
                parts = build_model_parts(cfg, dims, mesh, world.rank, CPU)
            held = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for _, p in parts.named_parameters())
            out[name] = {"build_peak_bytes": mem.result()["total_peak_bytes"], "held_bytes": held,
                         "whole_bytes": sum(sizes), "largest_tensor_bytes": max(sizes)}
        return out
    finally:
        shutdown_distributed()
