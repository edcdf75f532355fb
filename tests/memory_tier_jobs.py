"""Memory-tier jobs that tests/checkpointing/test_memory_tier.py and bench/memory_tier.py run inside real process groups
(tests.harness): the real Trainer, the state the CheckpointManager saves (``optimizer.checkpoint_state()``),
a durable checkpoint of the same step beside each memory snapshot.

    run_ranks("tests.memory_tier_jobs:snapshot", 2, {"base": [...], "layout": [...], "train": 2, "run_id": "a"})
    run_ranks("tests.memory_tier_jobs:restore", 3, {"base": [...], "snapshot": blob, "sources": {...}, ...})
"""

from __future__ import annotations

import gc
import time

import torch

from checkpointing.recovery.restore import load_from_memory
from checkpointing.recovery.snapshot import MemorySnapshot, MemoryStorage
from checkpointing.recovery.tier import MemoryTier
from tests.ckpt_jobs import full_state
from trainer.config.load import load_config
from trainer.data.corpus import load_corpus
from trainer.checkpoints import checkpoint_manager
from trainer.loop import Trainer
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
        out: dict = {}
        for _ in range(payload.get("train", 2) - 1):
            trainer.train_step()
            if payload.get("async"):  # a snapshot after each step before the last: the last reuses their plan
                res = tier.take_async(trainer.step, trainer.optimizer.checkpoint_state(), trainer.train_state())
                out.setdefault("first", (res.result().status, res.result().planned))
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
    out.update(status=res.status, reason=res.reason, planned=res.planned, phases=res.phases, in_place=res.in_place)
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


def hostile_copy(payload: dict) -> dict:
    """Two ranks take a snapshot of one step and copy it to each other, rank 1 as a broken or hostile peer:
    ``mode`` "table": its snapshot lists rank 0's file with another crc32c (consistent in itself);
    "size": it announces a copy of 2**62 bytes and sends nothing. Each rank's outcome of ``replicate``:
    "ok", or the error's type and message."""
    from checkpointing.manifest import FileEntry
    from checkpointing.recovery.peer_copy import replicate

    world = World.from_env()
    init_distributed(world, CPU)
    tier = MemoryTier(world.rank, world.size, replicas=1, timeout_s=30)
    try:
        g = torch.Generator().manual_seed(world.rank)
        res = tier.take(1, {f"w{world.rank}": torch.randn(64, 8, generator=g)}, {"step": 1, "samples_consumed": 12})
        assert res.ok, res.reason
        snap = res.snapshot
        if world.rank == 1 and payload["mode"] == "size":
            dist = torch.distributed
            # (size, pid, memory file, offset): what peer_copy.replicate announces
            dist.send(torch.tensor([1 << 62, 0, -1, 0], dtype=torch.int64), dst=0, group=tier.replica_group)
            dist.recv(torch.zeros(4, dtype=torch.int64), src=0, group=tier.replica_group)
            return {"outcome": "sent a size only"}
        if world.rank == 1:
            other = next(p for p, o in snap.owners.items() if o == 0)
            snap.table[other] = FileEntry(other, snap.table[other].size, "00000000")
        try:
            replicate(snap, tier.replica_group, tier.peers)
        except Exception as e:
            return {"outcome": f"{type(e).__name__}: {e}"}
        return {"outcome": "ok"}
    finally:
        tier.close()
        shutdown_distributed()


def bad_trainer_state(payload: dict) -> dict:
    """Each rank restores from its own memory snapshot through ``TrainWorker.restore``'s path
    (``orchestrator.workers.tier_fetch.restore_from_memory``) after the snapshot's trainer state was replaced
    by ``payload["trainer_state"]`` (if given), and rank ``payload["flip_rank"]``'s own files had a byte
    flipped (if given): the reason it gave (""=restored) and the trainer's step and cursor."""
    from types import SimpleNamespace

    from checkpointing.recovery.held import HeldView
    from checkpointing.recovery.restore import SnapshotKey
    from orchestrator.workers.tier_fetch import MemoryRestore, restore_from_memory

    world = World.from_env()
    init_distributed(world, CPU)
    tier = MemoryTier(world.rank, world.size)
    try:
        trainer = _trainer(payload, world)
        trainer.train_step()
        res = tier.take(trainer.step, trainer.optimizer.checkpoint_state(), trainer.train_state())
        assert res.ok, res.reason
        res.snapshot.trainer_state = payload.get("trainer_state", res.snapshot.trainer_state)
        if "flip_rank" in payload:  # every rank holds every file (a replica of each other's), one rank's own bad
            import torch.distributed as dist

            every = [None] * world.size
            dist.all_gather_object(every, {n: bytes(b) for n, b in res.snapshot.files.items()})
            own = set(res.snapshot.files)
            res.snapshot.files = {n: b for files in every for n, b in files.items()}
            for name in own if world.rank == payload["flip_rank"] else ():
                bad = bytearray(res.snapshot.files[name])
                bad[len(bad) // 2] ^= 0xFF
                res.snapshot.files[name] = bytes(bad)
        key = SnapshotKey(res.snapshot.step, 0)
        worker = SimpleNamespace(trainer=_trainer(payload, world),
                                 memory_view=lambda: HeldView({key: (res.snapshot, {})}))
        plan = MemoryRestore(key, {n: "w0" for n in res.snapshot.file_table()})
        reason, state = restore_from_memory(worker, plan)
        return {"reason": reason, "state": state, "step": worker.trainer.step,
                "samples_consumed": worker.trainer.samples_consumed}
    finally:
        tier.close()
        shutdown_distributed()


def replan_one(payload: dict) -> dict:
    """Two snapshots at world 2; before the second, rank 1 has lost the plan the first left (rank 0, which
    still holds it, has laid out and copied by it): every rank plans anew. Each snapshot's (status, planned,
    reason)."""
    world = World.from_env()
    init_distributed(world, CPU)
    tier = MemoryTier(world.rank, world.size, replicas=1, timeout_s=30)
    try:
        out = []
        for step in (1, 2):
            if step == 2 and world.rank == 1:
                tier._plans.clear()
            g = torch.Generator().manual_seed(step * 10 + world.rank)
            res = tier.take_async(step, {"w": torch.randn(64, 8, generator=g)},
                                  {"step": step, "samples_consumed": 12 * step}).result()
            out.append((res.status, res.planned, res.reason))
        return {"out": out}
    finally:
        tier.close()
        shutdown_distributed()


def shared_copies(payload: dict) -> dict:
    """Two snapshots of a small state with copies to peers (replicas 1) on this one host: whether each copy
    this rank holds is a mapping of its sender's memory file, the restorable step, and whether each copy's
    files are byte for byte the sender's own."""
    import mmap

    from checkpointing.recovery import local_copy

    world = World.from_env()
    init_distributed(world, CPU)
    tier = MemoryTier(world.rank, world.size, replicas=1, timeout_s=60)
    publish, made = local_copy.publish, []  # a memory file made apart for a copy (not the files' own)
    local_copy.publish = lambda parts: made.append(1) or publish(parts)
    try:
        g = torch.Generator().manual_seed(world.rank)
        for step in (1, 2, 3):
            res = tier.take_async(step, {f"w{world.rank}": torch.randn(256, 64, generator=g)},
                                  {"step": step, "samples_consumed": 12 * step}).result()
            assert res.ok and res.replication.ok, (res.reason, res.replication)
        own = {n: bytes(v) for n, v in tier.snapshots[3].files.items()}
        everyone: list = [None] * world.size
        torch.distributed.all_gather_object(everyone, own)
        copies = tier.copies[3]
        return {"mapped": [all(isinstance(v.obj, mmap.mmap) for v in c.files.values()) for c in copies.values()],
                "own_mapped": all(isinstance(v.obj, mmap.mmap) for v in tier.snapshots[3].files.values()),
                "memory_files": len(tier._arena.regions), "made_apart": len(made), "restorable": tier.restorable,
                "same_bytes": all({n: bytes(v) for n, v in c.files.items()} == everyone[src]
                                  for src, c in copies.items())}
    finally:
        local_copy.publish = publish
        tier.close()
        shutdown_distributed()


def in_place(payload: dict) -> dict:
    """Seven snapshots at world 3 (replicas 1, one host) of a state changed in place between them: whether each
    went in place, whether each rank's copies of the last are byte for byte its sender's files (mapped from
    its memory file), and whether the last restores this rank's state from this rank's files."""
    import mmap

    world = World.from_env()
    init_distributed(world, CPU)
    tier = MemoryTier(world.rank, world.size, replicas=1, timeout_s=60)
    try:
        g = torch.Generator().manual_seed(world.rank)
        state = {f"w{world.rank}": torch.randn(256, 64, generator=g), f"n{world.rank}": torch.tensor(0)}
        went = []
        for step in range(1, 8):
            state[f"w{world.rank}"].normal_(generator=g)
            state[f"n{world.rank}"].fill_(step)
            res = tier.take_async(step, state, {"step": step, "samples_consumed": 12 * step}).result()
            assert res.ok and res.replication.ok, (res.reason, res.replication)
            went.append(res.in_place)
        own = {n: bytes(v) for n, v in tier.snapshots[7].files.items()}
        everyone: list = [None] * world.size
        torch.distributed.all_gather_object(everyone, own)
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        load_from_memory(back, tier.sources(7), tier.snapshots[7], collective=False)
        copies = tier.copies[7]
        return {"in_place": went, "restorable": tier.restorable,
                "restored": all(torch.equal(back[k], state[k]) for k in state),
                "mapped": [all(isinstance(v.obj, mmap.mmap) for v in c.files.values()) for c in copies.values()],
                "same_bytes": all({n: bytes(v) for n, v in c.files.items()} == everyone[src]
                                  for src, c in copies.items())}
    finally:
        tier.close()
        shutdown_distributed()
