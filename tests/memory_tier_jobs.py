"""Memory-tier jobs that tests/test_memory_tier.py and bench/memory_tier.py run inside real process groups
(tests.harness): the real Trainer, the state the CheckpointManager saves (``optimizer.checkpoint_state()``),
a durable checkpoint of the same step beside each memory snapshot.

    run_ranks("tests.memory_tier_jobs:snapshot", 2, {"base": [...], "layout": [...], "train": 2, "run_id": "a"})
    run_ranks("tests.memory_tier_jobs:restore", 3, {"base": [...], "snapshot": blob, "sources": {...}, ...})
"""

from __future__ import annotations

import gc
import time

import torch

from checkpointing.memory_restore import load_from_memory
from checkpointing.memory_snapshot import MemorySnapshot, MemoryStorage
from checkpointing.memory_tier import MemoryTier
from tests.ckpt_jobs import full_state
from trainer.config_load import load_config
from trainer.data import load_corpus
from trainer.loop import Trainer, checkpoint_manager
from trainer.world import World, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def _trainer(payload: dict, world: World) -> Trainer:
    gc.collect()
    cfg = load_config(None, payload["base"] + payload.get("layout", []) + [f'run_id="{payload["run_id"]}"'])
    return Trainer(cfg, world, corpus=load_corpus(cfg.data), device=CPU)


def snapshot(payload: dict) -> dict:
    """Train ``train`` steps, commit a durable checkpoint of that step, then take a memory snapshot of the
    same state and copy it to the peers. ``fail_copy_on``: that rank's copy into memory fails."""
    world = World.from_env()
    init_distributed(world, CPU)
    put_parts = MemoryStorage.put_parts  # the rank processes are reused: any injected fault is undone
    try:
        trainer = _trainer(payload, world)
        tier = MemoryTier(world.rank, world.size, replicas=payload.get("replicas", 1),
                          memory_budget_bytes=payload.get("budget", 0), node_ids=payload.get("node_ids"),
                          timeout_s=payload.get("timeout_s", 300))
        for _ in range(payload.get("train", 2) - 1):
            trainer.train_step()
        out: dict = {}
        if payload.get("async"):  # one snapshot before the last step: the one after reuses its plan
            first = tier.take_async(trainer.step, trainer.optimizer.checkpoint_state(), trainer.train_state())
            out["first"] = (first.result().status, first.result().planned)
        trainer.train_step()
        if payload.get("durable", True):
            mgr = checkpoint_manager(trainer.cfg, world)
            t0 = time.monotonic()
            res = trainer.save_checkpoint(mgr)
            out["durable_blocking_s"] = res.blocking_s if res is not None else time.monotonic() - t0
            mgr.wait()
            out["saves"] = [(r.step, r.status, r.blocking_s) for r in mgr.poll()]
        if world.rank == payload.get("fail_copy_on"):
            def fail(self, rel, parts, *, exclusive=False):
                raise OSError("host memory copy failed (injected)")
            MemoryStorage.put_parts = fail
        if world.rank == payload.get("die_in_copy_on"):
            def die(self, rel, parts, *, exclusive=False):
                raise _Gone()
            MemoryStorage.put_parts = die
        state, train_state = trainer.optimizer.checkpoint_state(), trainer.train_state()
        try:
            return _snapshot_now(payload, trainer, tier, state, train_state, out)
        except _Gone:  # this rank leaves mid-copy: its group's connections close, as a killed rank's do
            shutdown_distributed()
            tier.close()
            return {"gone": True}
    finally:
        MemoryStorage.put_parts = put_parts
        shutdown_distributed()


class _Gone(BaseException):
    """A rank that dies mid-copy (raised through the tier, as nothing there catches it)."""


def _snapshot_now(payload, trainer, tier, state, train_state, out: dict) -> dict:
    """Take the snapshot the test asked for (after the durable one) and report what the tier holds."""
    if payload.get("async"):
        res = tier.take_async(trainer.step, state, train_state).result()
        rep = res.replication
    else:
        res = tier.take(trainer.step, state, train_state)
        rep = tier.replicate_async(res.snapshot).result() if res.ok else None
    out.update(status=res.status, reason=res.reason, planned=res.planned, phases=res.phases)
    if res.ok:
        out.update(replicated=rep.ok, replicate_reason=rep.reason, snapshot=res.snapshot.to_bytes(),
                   copies={s: c.to_bytes() for s, c in tier.copies.get(res.snapshot.step, {}).items()})
    out.update(held=tier.held_bytes(), holdings=tier.holdings(), needed=tier.needed(),
               restorable=tier.restorable, step=trainer.step)
    if payload.get("budget_after") and res.ok:  # a budget of that many times the largest snapshot
        biggest = torch.tensor([res.snapshot.nbytes])
        torch.distributed.all_reduce(biggest, op=torch.distributed.ReduceOp.MAX)
        tier.memory_budget_bytes = int(payload["budget_after"] * biggest.item())
        again = tier.take(trainer.step + 1, state, train_state)
        out["again"] = (again.status, again.reason, tier.held_bytes(), tier.restorable)
    if payload.get("state", True):
        out["state"] = full_state(trainer)
    tier.close()
    return out


def restore(payload: dict) -> dict:
    """Restore the training state from memory (``snapshot``: any rank's, for the agreed table and metadata;
    ``sources``: file name -> bytes) into this world's layout, then the durable checkpoint of ``run_id``
    into a second trainer of the same layout; each one's full state and the loss of one step after."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        snap = MemorySnapshot.from_bytes(payload["snapshot"])
        out: dict = {}
        trainer = _trainer(payload, world)
        try:
            load_from_memory(trainer.optimizer.checkpoint_state(), payload["sources"], snap)
        except Exception as e:  # a refused restore: every rank reports it
            return {"error": f"{type(e).__name__}: {e}"}
        trainer.optimizer.after_load()
        trainer.load_train_state(snap.trainer_state)
        out["memory"] = full_state(trainer)
        out["memory_step"] = trainer.step
        out["memory_loss"] = trainer.train_step().loss
        trainer = _trainer(payload, world)
        manifest = trainer.load_checkpoint(checkpoint_manager(trainer.cfg, world))
        out["durable_step"] = manifest.step
        out["durable"] = full_state(trainer)
        out["durable_loss"] = trainer.train_step().loss
        return out
    finally:
        shutdown_distributed()
