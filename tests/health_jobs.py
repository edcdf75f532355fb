"""Silent faults inside real process groups (tests.harness.run_ranks), for tests/trainer/test_health.py:
the same run trained twice in the same processes, once clean and once with ``[health] faults``."""

from __future__ import annotations

import os

import torch

from tests.ckpt_jobs import full_state
from trainer.config.load import load_config
from trainer.data.corpus import load_corpus
from trainer.loop import Trainer
from trainer.world import World, forget_meshes, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def _train(overrides: list[str], world: World) -> dict:
    cfg = load_config(None, overrides)
    forget_meshes()
    trainer = Trainer(cfg, world, corpus=load_corpus(cfg.data), device=CPU)
    events, losses, error = [], {}, None
    try:
        for s in trainer.run_steps(cfg.train.steps):
            losses[s.step] = s.loss
            events += s.health_events or []
    except Exception as e:  # noqa: BLE001 - the test reads which
        error = f"{type(e).__name__}: {e}"
        events += trainer.health.take_events()
    return {"trainer": trainer, "events": events, "losses": losses, "error": error,
            "fired": trainer.health.faults.log if trainer.health.faults else [],
            "train_state": trainer.train_state(), "pid": os.getpid()}


def clean_and_faulty(payload: dict) -> dict:
    """Train ``base`` then ``base + fault`` (and the reference ``base + ref`` if given instead of the clean
    one); whether every model and optimizer tensor ends bitwise equal, with the faulty run's events."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        ref = _train(payload["base"] + payload.get("ref", []), world)
        ref_state = full_state(ref["trainer"])
        pid = os.getpid()
        bad = _train(payload["base"] + payload["fault"], world)
        state = full_state(bad["trainer"]) if bad["error"] is None else None
        same = state is not None and all(torch.equal(ref_state[k], state[k]) for k in ref_state)
        return {"same": same, "error": bad["error"], "events": bad["events"], "fired": bad["fired"],
                "steps": (ref["trainer"].step, bad["trainer"].step), "same_process": pid == bad["pid"],
                "train_state": bad["train_state"], "ref_losses": ref["losses"], "losses": bad["losses"]}
    finally:
        shutdown_distributed()


def clean_only(payload: dict) -> dict:
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        r = _train(payload["base"], world)
        return {"events": r["events"], "error": r["error"], "step": r["trainer"].step,
                "checks": r["trainer"].health.totals["checks"]}
    finally:
        shutdown_distributed()
