"""The group's membership, the part of :class:`orchestrator.controller.controller.Controller` that starts workers,
forms a group from them (a new epoch, restored from the memory tier or the durable checkpoint) and
settles after a failure. Mixed into the controller; it reads and writes the controller's members,
spares, epoch and the figures of the forming.

    target = ctl.desired()                       # the valid size to aim for
    ctl.ensure_workers(target)                   # start workers (and warm standbys), stop extra spares
    size = ctl.formable(ready, candidates, target, waited)   # None: wait for more
    step = ctl.form(size, ready)                 # a new epoch of `size` members; the step it restored
    survivors = ctl.settle_after_failure(suspects)
"""

from __future__ import annotations

import logging
import secrets

from trainer.parallel.dims import ParallelDims

from ..config import GroupTier
from .run_policy import ScalingStatus
from ..workers.tier_plan import flush_outcome, group_restore_plan, restore_outcome
from ..workers.tier_fetch import MemoryRestore
from ..store.run_store import HistoryRow
from ..workers.group import GroupFailure

log = logging.getLogger("etrain")


def desired_size(workers: int, target: int, min_workers: int, max_workers: int, allowed) -> int:
    """``target`` (the allocator's, when > 0) or else ``workers``, clamped to [min_workers, max_workers] and
    snapped down to the largest ``allowed`` size not above it (the smallest allowed one when none is)."""
    want = max(min_workers, min(target if target > 0 else workers, max_workers))
    allowed = sorted(n for n in allowed if min_workers <= n <= max_workers)
    fits = [n for n in allowed if n <= want]
    return fits[-1] if fits else (allowed[0] if allowed else want)


class Membership:
    """Who is in the run's group (mixed into the Controller)."""

    def desired(self) -> int:
        """The size to aim for: the allocator's target when it set one, else the requested workers, snapped
        to the allowed sizes (:func:`desired_size`)."""
        return desired_size(self.spec.workers, self.spec.target, self.spec.min_workers, self.spec.max_workers,
                            self.scaling.allowed(self.valid_sizes))

    def ensure_workers(self, target: int, standby: bool = True) -> None:
        """Start workers until members plus spares are ``target`` plus the warm standbys (without
        ``standby``: ``target``, starting no new standby); stop spares beyond ``target`` plus standbys."""
        keep = target + self.opts.standby
        want = keep if standby else target
        lost = [w for w in self.spares if w not in self.group.workers]
        if lost:  # died while starting (the group forgot them when their first call failed): start others
            log.warning("workers %s died while starting; starting others in their place", ",".join(lost))
            self.spares = [w for w in self.spares if w in self.group.workers]
        have = len(self.members) + len(self.spares)
        if have < want:
            self.spares += self.group.start(want - have)
        elif have > keep and self.spares:
            room = max(0, keep - len(self.members))
            for wid in self.spares[room:]:
                self.group.kill(wid)
            self.spares = self.spares[:room]

    def release_workers(self) -> None:
        """Stop every worker: the run is leaving its group for good."""
        self.group.shutdown()
        self.members, self.spares, self.train_calls = [], [], {}

    def formable(self, ready: list[str], candidates: list[str], target: int, waited: float,
                 wait_booting: bool = True) -> int | None:
        """The size to form a group at now from ``ready`` workers, or None to wait for more.

        The largest valid size up to ``target`` as soon as that many are ready.
        Otherwise, after ``replace_wait_s``, the largest valid size that is
        ready, unless (``wait_booting``) workers that already hold resources
        (booting: a new process importing torch) would make it larger; those
        are waited for up to ``boot_timeout_s``. Workers without resources
        (no capacity in the cluster) are not waited for past ``replace_wait_s``.
        A candidate the group no longer has (it died while starting) raises
        :class:`GroupFailure`: the state recovers from it like from any failure.
        """
        lost = tuple(w for w in candidates if w not in self.group.workers)
        if lost:  # capacity lost before the group formed is a failure like any other: recovered and replaced
            raise GroupFailure("a worker died while starting, before it joined the group", "actor_died", lost)
        full = self.scaling.target(ScalingStatus(0, target, target, self.valid_sizes))
        size = self.scaling.target(ScalingStatus(0, target, len(ready), self.valid_sizes))
        if size is not None and size == full:
            return size
        if size is None or waited < self.opts.replace_wait_s:
            return None
        if wait_booting and waited < self.opts.boot_timeout_s:
            placed = self.group.placed(candidates)
            could = self.scaling.target(ScalingStatus(0, target, len(placed), self.valid_sizes))
            if could is not None and could > size:
                return None
        return size

    def form(self, size: int, ready: list[str]) -> int:
        """Make ``size`` of the ``ready`` workers the group of a new epoch; returns the restored step."""
        kept = [w for w in self.members if w in ready]
        if len(kept) > size:  # a shrink keeps the gang's members (in rank order): their bundles stay reserved
            gang = [w for w in kept if self.group.in_gang(w)][:size]
            others = [w for w in kept if w not in gang][: size - len(gang)]
            kept = [w for w in kept if w in gang or w in others]
        chosen = kept[:size]
        chosen += [w for w in ready if w not in chosen][: size - len(chosen)]
        if len(chosen) < size:
            raise GroupFailure(f"only {len(chosen)} of {size} workers are ready", "error")
        self.spares = [w for w in self.members + self.spares if w not in chosen]
        self.members = chosen
        self.train_calls = {}
        self.epoch = self.until_store(lambda: self.store.bump_epoch(self.run_id, self.lease, self.epoch),
                                      "moving the run to a new epoch")
        rank0 = chosen[0]
        addr = self.group.info(rank0).get("ip", "127.0.0.1")
        port = self._group_call([rank0], "rendezvous_port")[rank0]
        if self.storage_faults is not None:  # chaos: replacements get the injected storage faults too
            self._group_call(chosen, "set_storage_faults", self.storage_faults)
        t0 = self.clock()
        recovery = None
        if self.recovery.enabled:
            recovery = GroupTier(self.recovery, tuple(self.group.info(w).get("node_id", "") for w in chosen))
        # Planned before the form: a member that restores a snapshot it does not hold asks for it as it forms.
        plan, why = self.memory_plan(chosen)
        t_plan = self.clock()
        key = secrets.token_hex(16)  # the epoch's rendezvous keys, known only to its members (TrainWorker.form)
        # Each member restores as soon as it formed (restore=True): one call, no member waiting for the slowest.
        calls = [self.group.submit(w, "form", self.epoch, r, size, addr, port, recovery, key, plan, True)
                 for r, w in enumerate(chosen)]
        formed = self._collect(calls, "form")
        restored = {w: f.restored for w, f in formed.items()}
        form_s = max(f.seconds for f in formed.values())  # the slowest member's form; the rest of the call restores
        self.form_phases = {"plan_s": t_plan - t0, "form_s": form_s,
                            "restore_s": max(0.0, self.clock() - t_plan - form_s)}
        for r in formed.values():  # the slowest rank's time in each part of forming
            for k, v in r.phases.items():
                self.form_phases[k] = max(v, self.form_phases.get(k, 0.0))
        first = restored[rank0]
        step = first.step
        tier = self.restored_tier = first.tier
        why, tier_events, budget = restore_outcome([first, *(r for w, r in restored.items() if w != rank0)], why,
                                                   self.pending_recovery is not None)
        row = first.history_row
        if tier == "memory" and step > self.last_completed_step() and isinstance(row, list):
            self.observers.on_history(self, [HistoryRow.of(row)])  # trained, never reported: its rank 0 died
        if step != self.last_completed_step():  # the figures (loss, lr) of the step it resumes at stay
            self.progress = {"step": step}
        self.progress_at = self.clock()
        if tier != "memory":  # a restore from memory leaves the newest commit where it was
            self.committed_step = first.from_step
        self.observers.on_formed(self)
        if self.pending_recovery is not None and not self.pending_recovery.formed_yet:
            r = self.pending_recovery
            r.formed(step=step, world=size, tier=tier, tier_reason=why, phases=self.form_phases,
                     waited_s=t0 - r.settled_at)
        # A Mixture of Experts: the group's expert-parallel degree (parallel.ep=0 chooses one per size).
        moe = {"ep": ParallelDims.from_config(self.cfg, size).ep} if self.cfg.model.is_moe else {}
        self.event("formed", epoch=self.epoch, world_size=size, step=step, restored_from=first.from_step,
                   tier=tier, tier_reason=why, memory_tier=budget, **moe,
                   rendezvous=f"{addr}:{port}",
                   members=[self.group.info(w).get("node_id", "")[:8] for w in chosen],
                   nodes=[self.group.info(w).get("node_id", "") for w in chosen],
                   pids=[self.group.info(w).get("pid") for w in chosen])
        for e in tier_events:
            self.event("memory_tier", **e)
        return step

    def memory_plan(self, chosen: list[str]) -> tuple[MemoryRestore | None, str]:
        """Where the new group restores from in the memory tier (:func:`group_restore_plan`), asking the
        members and the spares that are up; (None, why) when it restores from storage instead."""
        if not self.recovery.enabled:
            return None, "the memory tier is off ([recovery] memory_every_steps = 0)"
        holders = chosen + self.group.ready([w for w in self.spares if w in self.group.workers], timeout=0)
        return group_restore_plan(self.group, holders, self.committed_step)

    def memory_flush(self) -> bool:
        """Every member holds the current step in memory and a restore of it can be planned (a resize
        restores from it); False when not: the resize then commits a durable checkpoint first, so that it
        loses no step."""
        if not self.recovery.enabled or self.recovery.resize_through_storage or not self.members:
            return False
        step = self.last_completed_step()
        why, events = flush_outcome(self._group_call(self.members, "memory_flush"), step)
        if not why:
            plan, why = self.memory_plan(self.members)
            if plan is not None:
                why = "" if plan.step == step else f"the newest step held completely is {plan.step}"
        for e in events:
            self.event("memory_tier", **e)
        if why:
            log.info("resize through storage: the memory tier cannot serve step %d (%s)", step, why)
            self.event("memory_tier", action="fallback", step=step, reason=f"the resize commits a checkpoint: {why}")
        return not why

    def settle_after_failure(self, suspects: tuple[str, ...]) -> list[str]:
        """Kill the culprits, let survivors' train calls return, and keep the survivors that answer."""
        for w in suspects:
            self.group.kill(w)
        members = [w for w in self.members if w not in suspects]
        pending = [c for w, c in self.train_calls.items() if w in members]
        for call in pending:  # blocked in a collective with a member that is gone: released now (NCCL)
            self.group.submit(call.wid, "abort_collectives")
        deadline = self.clock() + max(self.opts.settle_s, self.opts.poll_s)
        while pending and self.clock() < deadline:
            for call in self.group.wait(pending, timeout=0.5):
                pending.remove(call)
        for call in pending:  # still blocked in a collective: cannot rejoin
            self.group.kill(call.wid)
        stuck = {c.wid for c in pending}
        survivors = [w for w in members if w not in stuck and self.group.alive(w, timeout=5.0)]
        for w in members:
            if w not in survivors:
                self.group.kill(w)
        self.spares = [w for w in self.spares if w in self.group.workers]
        self.members = survivors
        self.train_calls = {}
        return survivors
