"""A group's restore from the memory tier, on each of its workers (``TrainWorker.restore(plan)``).

    plan = MemoryRestore(SnapshotKey(step, epoch), {file name: holder worker id}, {worker id: actor})
    asked = ask_header(worker.memory_view(), plan)      # at the form, before the group builds its model
    reason, state = restore_from_memory(worker, plan, asked)  # collective; "" when restored (state: the
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
were never in it (:class:`RayFetchTransport`); the copies to peers while training use a gloo
group of their own (``PeerCopyTransport``): two implementations of one interface,
:class:`checkpointing.recovery.transport.SnapshotTransport`.

Each rank loads its part alone (DCP's load plans are not exchanged: the global load plan is
every rank's own), then every rank agrees on the outcome (one small all-reduce), so a read
that failed on any rank sends the whole group to the durable checkpoint together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from checkpointing.manifest import METADATA_NAME
from checkpointing.recovery.restore import SnapshotKey, load_from_memory
from checkpointing.recovery.snapshot import MemorySnapshot, check_trainer_state
from checkpointing.recovery.transport import TransportError
from checkpointing.storage.retry import describe

log = logging.getLogger("etrain")

FETCH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class MemoryRestore:
    """A group's restore from the memory tier, as the controller planned it (``orchestrator.workers.tier_plan``):
    the snapshot ``key`` (step, epoch), the live worker that gives each of its files, and those workers'
    actor handles."""

    key: SnapshotKey
    where: dict[str, str]  # file name -> holder worker id
    handles: dict[str, Any] = field(default_factory=dict)  # holder worker id -> its actor

    @property
    def step(self) -> int:
        return self.key.step


def ask_header(view, plan: MemoryRestore | None):
    """A worker that will restore ``plan`` without holding its snapshot asks a holder for the snapshot's
    header (its table, DCP metadata and trainer state) now, when its group starts forming: the answer
    travels while the group builds its model (a standby in a lost rank's place waited 8-15 ms for it
    inside the restore here). {snapshot key: the request (a Ray object ref)} for :func:`restore_from_memory`."""
    if plan is None or view.snapshot(plan.key) is not None:
        return {}
    try:
        return {plan.key: RayFetchTransport(plan).ask_header(plan.key)}
    except Exception as e:  # the restore asks again, and reports
        log.debug("asking for the header of step %d: %s", plan.step, describe(e))
        return {}


def restore_from_memory(worker, plan: MemoryRestore, asked: dict | None = None) -> tuple[str, dict]:
    """Restore ``plan.key`` into ``worker.trainer`` (collective on the training group): ("", the
    snapshot's trainer state) when done, else (the reason it was not, {}), the same on every rank: the
    caller then loads the durable checkpoint. ``asked``: the header asked for at the form
    (:func:`ask_header`)."""
    key = plan.key
    tr = worker.trainer
    reason = ""
    try:
        transport = RayFetchTransport(plan)
        view = worker.memory_view()
        snap = view.snapshot(key)
        if snap is None:  # a worker new to that step: the table and metadata from a holder, checked
            snap = transport.header(key, (asked or {}).get(key))
        # What the trainer will apply, checked before any rank loads (a bad one falls back on every rank).
        state = check_trainer_state(snap.trainer_state, snap.step, f"the trainer state of step {snap.step}",
                                    required=True)
        local = view.sources(key)
        # In the snapshot's own layout a rank reads the files its rank wrote (a standby in a lost rank's
        # place: that rank's files): those are fetched at once, beside DCP's planning; others when read.
        same_layout = snap.world_size == tr.world.size
        mine = {n for n, r in snap.owners.items() if r == tr.world.rank} if same_layout else set()
        sources = {name: local[name] if name in local else transport.fetcher(key, name, now=name in mine)
                   for name in plan.where if name != METADATA_NAME}
    except Exception as e:
        reason = f"rank {tr.world.rank}: {describe(e)}"
    if not reason:
        try:  # each rank reads alone (no exchange of DCP's load plans); the ranks agree on the outcome after
            load_from_memory(tr.optimizer.checkpoint_state(), sources, snap, collective=False)
        except Exception as e:
            reason = f"rank {tr.world.rank}: {describe(e)}"
    if not everyone(not reason, device=tr.device)[0]:
        return reason or "another rank could not read the snapshot from memory", {}
    try:
        tr.optimizer.after_load()
        tr.load_train_state(state)
    except Exception as e:
        reason = f"rank {tr.world.rank}: {describe(e)}"
    if not everyone(not reason, device=tr.device)[0]:  # the durable load then overwrites what was loaded
        return reason or "another rank could not apply the snapshot's state", {}
    log.info("restored step %d from the memory tier", snap.step)
    return "", state


def warm_up() -> None:
    """A snapshot and a restore of one small tensor through the memory tier, in this process and without a
    process group (at a worker's boot): the first use of DCP's planners, writer and reader in a process
    costs tens of milliseconds, which a standby's first restore would otherwise pay inside a recovery."""
    import warnings

    from checkpointing.recovery.tier import MemoryTier

    tier = MemoryTier(0, 1, replicas=0)
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in a single process: it does, on purpose
            warnings.simplefilter("ignore")
            res = tier.take(0, {"w": torch.zeros(4, 4)}, {"step": 0, "samples_consumed": 0})
            if res.ok:
                load_from_memory({"w": torch.empty(4, 4)}, dict(res.snapshot.files), res.snapshot)
    finally:
        tier.close()


def everyone(*flags: bool, device) -> list[bool]:
    """Each flag, true only where it is true on every rank of the training group (collective), so
    that every rank takes the same branch."""
    t = torch.tensor([int(bool(f)) for f in flags], device=device, dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


class RayFetchTransport:
    """The restore's transport (:class:`checkpointing.recovery.transport.SnapshotTransport`): each file of
    the planned snapshot fetched from the live worker the plan names for it, by a Ray actor call; it pulls
    only (the copies to peers while training are pushed by ``PeerCopyTransport``)."""

    def __init__(self, plan: MemoryRestore, timeout_s: float = FETCH_TIMEOUT_S):
        self.where, self.handles, self.timeout_s = plan.where, plan.handles, timeout_s

    def send(self, snapshot: MemorySnapshot) -> dict[int, MemorySnapshot]:
        raise TransportError("a restore fetches files from their holders; copies to peers are pushed while "
                             "training through checkpointing.recovery.transport.PeerCopyTransport")

    def fetch(self, key: SnapshotKey, name: str) -> bytes:
        return self._call(self.where[name], "memory_file", key, name)

    def ask_header(self, key: SnapshotKey):
        return self._ask(self.where[METADATA_NAME], "memory_header", key)

    def header(self, key: SnapshotKey, asked=None) -> MemorySnapshot:
        """The snapshot's header from its holder, checked (``asked``: the request made already)."""
        holder = self.where[METADATA_NAME]
        return MemorySnapshot.from_bytes(self._get(asked if asked is not None else self.ask_header(key)),
                                         f"the memory snapshot of step {key[0]} from {holder}")

    def fetcher(self, key: SnapshotKey, name: str, now: bool = False):
        """A source for the reader: fetches ``name`` when DCP reads it (``now``: asked for at once, taken
        when DCP reads it)."""
        if not now:
            return lambda: self.fetch(key, name)
        ref = self._ask(self.where[name], "memory_file", key, name)
        return lambda: self._get(ref)

    def _call(self, holder, method: str, *args) -> bytes:
        return self._get(self._ask(holder, method, *args))

    def _ask(self, holder, method: str, *args):
        return getattr(self.handles[holder], method).remote(*args)

    def _get(self, ref) -> bytes:
        import ray

        return ray.get(ref, timeout=self.timeout_s)
