"""Checkpoint jobs that tests run inside real multi-process groups (see tests.harness).

Each job trains, saves and loads through the real Trainer and
CheckpointManager, and returns every tensor of the training state gathered to
its full, unsharded form, so a test can compare layouts bitwise.
"""

from __future__ import annotations

import gc
import logging
import os
import time

import torch
from torch.distributed.tensor import DTensor

from trainer.config.load import load_config
from trainer.data.corpus import load_corpus
from trainer.checkpoints import checkpoint_manager
from trainer.loop import Trainer
from trainer.world import World, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor this rank holds, as full tensors (collective)."""
    out = {}
    state = trainer.optimizer.checkpoint_state()
    for fqn, t in state["model"].items():
        out[f"model.{fqn}"] = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    for fqn, st in state["optim"].items():
        for k, t in st.items():
            out[f"optim.{fqn}.{k}"] = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    return {k: v.clone() for k, v in out.items()}


def _trainer(base, overrides, world, corpus):
    cfg = load_config(None, base + overrides)
    return cfg, Trainer(cfg, world, corpus=corpus, device=CPU)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_plan(payload: dict) -> list[dict]:
    """Run a list of actions in one world; one result dict per action.

    Actions: {"layout": [...overrides], "load": run_id or None, "load_step": int|None,
              "train": n_steps, "save": run_id or None, "state": bool}
    """
    world = World.from_env()
    init_distributed(world, CPU)
    capture = _Capture()
    logging.getLogger("etrain").addHandler(capture)
    results = []
    try:
        base = payload["base"]
        corpus = load_corpus(load_config(None, base).data)
        for act in payload["actions"]:
            overrides = act.get("layout", [])
            res: dict = {}
            capture.messages = []
            if act.get("load"):
                cfg, trainer = _trainer(base, overrides + [f'run_id="{act["load"]}"'], world, corpus)
                mgr = checkpoint_manager(cfg, world)
                manifest = trainer.load_checkpoint(mgr, step=act.get("load_step"))
                res["loaded_step"] = manifest.step if manifest else None
            else:
                cfg, trainer = _trainer(base, overrides, world, corpus)
            if act.get("state_before_train"):
                res["state_loaded"] = full_state(trainer)
            res["losses"] = [trainer.train_step().loss for _ in range(act.get("train", 0))]
            res["samples_consumed"] = trainer.samples_consumed
            if act.get("save"):
                cfg2 = load_config(None, base + overrides + act.get("save_overrides", []) + [f'run_id="{act["save"]}"'])
                mgr = checkpoint_manager(cfg2, world)
                t0 = time.monotonic()
                trainer.save_checkpoint(mgr)
                mgr.wait()
                res["save_seconds"] = time.monotonic() - t0
                res["saves"] = [(r.step, r.status, r.error) for r in mgr.poll()]
                if mgr.storage.faults is not None:
                    res["faults_injected"] = dict(mgr.storage.faults.injected)
            if act.get("state", True):
                res["state"] = full_state(trainer)
            res["warnings"] = list(capture.messages)
            results.append(res)
            del trainer
            gc.collect()
        return results
    finally:
        logging.getLogger("etrain").removeHandler(capture)
        shutdown_distributed()


def crash_during_save(payload: dict) -> dict:
    """Train, commit one checkpoint, then die on rank 1 after its shards are uploaded but
    before the manifest of the next one exists."""
    from checkpointing.dcp import writer as dcp_io

    world = World.from_env()
    init_distributed(world, CPU)
    base = payload["base"]
    cfg, trainer = _trainer(base, [], world, load_corpus(load_config(None, base).data))
    mgr = checkpoint_manager(cfg, world)
    trainer.train_step()
    trainer.save_checkpoint(mgr)
    mgr.wait()
    first = [(r.step, r.status) for r in mgr.poll()]
    trainer.train_step()
    if world.rank == 1:
        original = dcp_io.EtrainWriter.upload

        def upload_then_die(self):
            original(self)  # every shard of this rank is in storage...
            os._exit(17)  # ...and the rank dies before its marker, so there is no manifest

        dcp_io.EtrainWriter.upload = upload_then_die
    trainer.save_checkpoint(mgr)
    mgr.wait()
    second = [(r.step, r.status, r.error) for r in mgr.poll()]
    return {"first": first, "second": second}


def busy_saves(payload: dict) -> dict:
    """Two saves back to back while the first is still uploading (slow storage)."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        out = {}
        for policy in ("skip", "wait"):
            cfg = load_config(None, payload["base"] + [f'checkpoint.when_busy="{policy}"', f'run_id="{policy}"',
                                                       'checkpoint.faults={delay_s = 0.3, ops = ["put"]}'])
            trainer = Trainer(cfg, world, corpus=load_corpus(cfg.data), device=CPU)
            mgr = checkpoint_manager(cfg, world)
            trainer.train_step()
            trainer.save_checkpoint(mgr)
            trainer.train_step()
            trainer.save_checkpoint(mgr)
            mgr.wait()
            out[policy] = sorted((r.step, r.status) for r in mgr.poll())
            out[f"{policy}_committed"] = mgr.committed_steps()
        return out
    finally:
        shutdown_distributed()
