"""A group's restore from the memory tier, on each of its workers (``TrainWorker.restore(plan)``).

    plan = {"key": (step, epoch), "where": {file name: holder worker id}, "handles": {worker id: actor}}
    reason, state = restore_from_memory(worker, plan)   # collective; "" when restored (state: the
                                                        # snapshot's trainer state), else why not

The controller plans (``Controller.memory_plan``): it gathers what every live
worker holds (``memory_holdings``) and picks the newest snapshot whose every file
some live worker holds (:func:`checkpointing.recovery.restore.plan_restore`). Each
rank of the new group then reads through the durable reader and load planner
(:func:`checkpointing.recovery.restore.load_from_memory`), so a restore into another
world size or layout reshards as a restore from storage does: the files it holds
itself are read in place, the others are fetched from their holder by a Ray actor
call (``memory_file``) when DCP reads them, and every byte is checked against the
step's agreed table first. Ray's object transfer moves a restore's files because
the group that made the snapshot is gone and the new one may include workers that
were never in it; the copies to peers while training use a gloo group of their own
(``checkpointing.recovery.peer_copy``).

Every rank agrees before loading (an all-reduce), and DCP raises a failed read on
every rank, so the whole group falls back to the durable checkpoint together.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from checkpointing.manifest import METADATA_NAME
from checkpointing.recovery.restore import load_from_memory
from checkpointing.recovery.snapshot import MemorySnapshot, check_trainer_state
from checkpointing.retry import describe

log = logging.getLogger("etrain")

FETCH_TIMEOUT_S = 120.0


def restore_from_memory(worker, plan: dict) -> tuple[str, dict]:
    """Restore ``plan["key"]`` into ``worker.trainer`` (collective on the training group): ("", the
    snapshot's trainer state) when done, else (the reason it was not, {}), the same on every rank: the
    caller then loads the durable checkpoint."""
    key = tuple(plan["key"])
    tr = worker.trainer
    reason = ""
    try:
        view = worker.memory_view()
        snap = view.snapshot(key)
        if snap is None:  # a worker new to that step: the table and metadata from a holder, checked
            holder = plan["where"][METADATA_NAME]
            snap = MemorySnapshot.from_bytes(_fetch(plan, key, METADATA_NAME, "memory_header"),
                                             f"the memory snapshot of step {key[0]} from {holder}")
        # What the trainer will apply, checked before any rank loads (a bad one falls back on every rank).
        state = check_trainer_state(snap.trainer_state, snap.step, f"the trainer state of step {snap.step}",
                                    required=True)
        local = view.sources(key)
        sources = {name: local[name] if name in local else _fetcher(plan, key, name)
                   for name in plan["where"] if name != METADATA_NAME}
    except Exception as e:
        reason = f"rank {tr.world.rank}: {describe(e)}"
    if not everyone(not reason, device=tr.device)[0]:
        return reason or "another rank could not prepare the restore from memory", {}
    try:
        load_from_memory(tr.optimizer.checkpoint_state(), sources, snap)
    except Exception as e:  # DCP raises a read that failed on any rank on every rank
        return describe(e), {}
    try:
        tr.optimizer.after_load()
        tr.load_train_state(state)
    except Exception as e:
        reason = f"rank {tr.world.rank}: {describe(e)}"
    if not everyone(not reason, device=tr.device)[0]:  # the durable load then overwrites what was loaded
        return reason or "another rank could not apply the snapshot's state", {}
    log.info("restored step %d from the memory tier", snap.step)
    return "", state


def everyone(*flags: bool, device) -> list[bool]:
    """Each flag, true only where it is true on every rank of the training group (collective), so
    that every rank takes the same branch."""
    t = torch.tensor([int(bool(f)) for f in flags], device=device, dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


def _fetch(plan: dict, key: tuple, name: str, method: str = "memory_file") -> bytes:
    import ray

    holder = plan["where"][name]
    actor = plan["handles"][holder]
    args = (key,) if method == "memory_header" else (key, name)
    return ray.get(getattr(actor, method).remote(*args), timeout=FETCH_TIMEOUT_S)


def _fetcher(plan: dict, key: tuple, name: str):
    return lambda: _fetch(plan, key, name)
