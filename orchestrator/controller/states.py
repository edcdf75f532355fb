"""The controller's states: one class per state, carrying its own data.

    state = Initializing()
    while not state.terminal:
        state = state.step(ctl)             # what Controller.step does, with the status write after it

``State.step(ctl)`` does one bounded piece of work on the controller
(:class:`orchestrator.controller.controller.Controller`: its membership, its group calls,
its observers) and returns the next state, often itself. A state never
writes the store or the metrics itself: it calls the controller, and the
controller's observers hear of it (``orchestrator.controller.observers``).

Invariants:

* The state names are :class:`orchestrator.phase.Phase` members (Requeuing is
  SUSPENDING: it commits and gives the workers back, then waits QUEUED); a terminal
  state (SUSPENDED, FINISHED, FAILED) carries the reason and cannot step.
* A failure becomes a :class:`Recovering` in one place, :meth:`Recovering.now`
  (and :meth:`Recovering.after` for a :class:`GroupFailure`): a group call
  that fails and that a state does not handle itself propagates to
  ``Controller.step``, which converts it the same way.
* Running's checks (train calls, durability, hang, scaling) live here, beside
  the state that acts on them; the controller only gathers what they read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from checkpointing.manager import group_rank_errors
from checkpointing.names import redact

from .drain import DrainCommit, DrainShrink
from ..workers.hang_probe import HangProbe
from ..service.demand import size_reason
from .pending import PendingRecovery, PendingResize
from ..phase import Phase
from .run_policy import Fail, FailureRecord, Resize, ScalingStatus
from ..workers.group import GroupFailure, WorkerLost
from .protocols import StateContext

log = logging.getLogger("etrain")


class State:
    name: ClassVar[Phase]
    terminal: ClassVar[bool] = False

    def step(self, c: StateContext) -> State:
        raise NotImplementedError(f"{type(self).__name__}.step: not a state the controller knows")


@dataclass
class Initializing(State):
    name = Phase.INITIALIZING

    def step(self, c: StateContext) -> State:
        c.take_lease()
        c.event("started", workers=c.spec.workers, min_workers=c.spec.min_workers, max_workers=c.spec.max_workers,
                controller_id=c.controller_id)
        c.observers.on_start(c)  # the lease renewed from now on, a resumed run's history, the metrics endpoint
        return Queued("starting", timeout=True).step(c)  # QUEUED only when the gang is not admitted at once


@dataclass
class Queued(State):
    """Wait until the run's gang (``min_workers`` reserved together) is admitted; while the allocator holds
    the run (``spec.requeue``) hold nothing and wait. ``queue_timeout_s`` bounds both waits: the first
    admission (``timeout``: the run fails) and a requeued run's (it ends SUSPENDED, its checkpoint
    committed when it was requeued: `etrain resume` continues it)."""

    reason: str
    timeout: bool = False
    since: float | None = None
    announced: bool = False  # the `queued` event written (the gang was not admitted at once)
    name = Phase.QUEUED

    def step(self, c: StateContext) -> State:
        now = c.clock()
        self.since = now if self.since is None else self.since
        if c.spec.suspended or c.suspend_cause:
            return suspending(c, "while queued")
        if c.spec.stop:
            return Finishing("stop requested while queued")
        if c.spec.requeue:  # held by the allocator: not even the gang is reserved
            c.release_workers()
            c.sleep(c.opts.poll_s)
        else:
            c.group.reserve_gang(c.spec.min_workers)
            if c.group.gang_ready(timeout=c.opts.poll_s if self.announced else c.opts.admit_wait_s):
                return c.admitted(self.since if self.announced else None)
        if not self.announced:
            self.announced = True
            c.queued(self.reason, self.since)
        waited = c.clock() - self.since
        if c.spec.requeue and c.opts.queue_timeout_s and waited > c.opts.queue_timeout_s:
            why = (f"requeued by the cluster's allocator and not re-admitted within elastic.queue_timeout_s="
                   f"{c.opts.queue_timeout_s:g} s")
            c.event("suspended", step=c.last_completed_step(), reason=why, cause="queue_timeout",
                    checkpoint_committed=c.committed_step == c.last_completed_step())
            return Suspended(f"{why}; `etrain resume` continues it at step {c.last_completed_step()}")
        if self.timeout and c.opts.queue_timeout_s and waited > c.opts.queue_timeout_s:
            c.release_workers()
            return Failed(f"not admitted within elastic.queue_timeout_s={c.opts.queue_timeout_s:g} s: the cluster "
                          f"could not reserve the run's {c.spec.min_workers} min_workers together; raise "
                          "elastic.queue_timeout_s (0: wait for ever), lower elastic.min_workers or add capacity")
        c.refresh_spec_throttled()
        return self


@dataclass
class Requeuing(State):
    """The allocator asked for the run's workers back (``spec.requeue``): commit a durable checkpoint at the
    step boundary, give every worker and the gang back and wait in QUEUED; not a failure."""

    name = Phase.SUSPENDING

    def step(self, c: StateContext) -> State:
        c.stop_at_boundary()
        saved = c.save_now()
        if not saved and c.cfg.checkpoint.url:  # tried again at the next poll; check_durability bounds it
            log.warning("requeue postponed: the boundary checkpoint did not commit")
            return Running()
        c.release_workers()
        c.event("preempted", action="suspend", step=c.last_completed_step(), checkpoint_committed=saved,
                reason="requeued by the cluster's allocator (spec.requeue)")
        return Queued("requeued by the cluster's allocator")


@dataclass
class Scheduling(State):
    """Start workers and wait until enough are up to form a valid group."""

    target: int
    reason: str
    since: float | None = None
    name = Phase.SCHEDULING

    def step(self, c: StateContext) -> State:
        now = c.clock()
        self.since = self.since if self.since is not None else now
        if c.spec.suspended or c.suspend_cause:
            return suspending(c, "while scheduling")
        if c.spec.requeue:  # no group trains: nothing to commit
            c.release_workers()
            c.event("preempted", action="suspend", step=c.last_completed_step(), checkpoint_committed=False,
                    reason="requeued by the cluster's allocator (spec.requeue) while scheduling")
            return Queued("requeued by the cluster's allocator")
        c.ensure_workers(self.target)
        candidates = c.members + c.spares
        ready = c.group.ready(candidates, timeout=c.opts.poll_s)
        waited = now - self.since
        size = c.formable(ready, candidates, self.target, waited)
        if size is not None:
            c.form(size, ready)
            return Running()
        if waited > c.opts.start_timeout_s:  # give everything back and wait for the gang again
            status = ScalingStatus(current=0, requested=self.target, available=len(ready), valid_sizes=c.valid_sizes)
            decision = c.scaling.decide(status, now)
            c.release_workers()
            return Queued(f"workers did not start within {c.opts.start_timeout_s:.0f} s: {decision.reason}")
        c.refresh_spec_throttled()
        return self


@dataclass
class Running(State):
    probe: HangProbe = field(default_factory=HangProbe)  # the members pinged ahead of the hang deadline
    name = Phase.RUNNING

    def step(self, c: StateContext) -> State:
        if not c.train_calls:
            c.launch_training()
        ended = check_training(c)
        if ended is not None:
            return ended
        c.poll_progress()
        undurable = check_durability(c)
        if undurable is not None:
            return undurable
        c.observers.on_poll(c)
        c.count_standbys()
        c.refresh_spec_throttled()
        if c.spec.suspended or c.suspend_cause:
            return suspending(c)
        if c.spec.stop:
            return Finishing("stop requested", stopping=True)
        if c.spec.requeue:
            return Requeuing()
        hang = check_hang(c, self.probe)
        if hang is not None:
            return hang
        return check_drain(c) or check_scaling(c) or self


@dataclass
class Recovering(State):
    failure: FailureRecord
    suspects: tuple[str, ...] = ()
    detected_at: float = 0.0  # controller clock
    name = Phase.RECOVERING

    @classmethod
    def now(cls, c: StateContext, kind: str, message: str, suspects: Iterable[str] = (),
            step: int | None = None) -> Recovering:
        """A recovery from a failure detected now, at the last completed step unless ``step`` is given."""
        t = c.clock()
        return cls(FailureRecord(kind, c.last_completed_step() if step is None else step, message, t),
                   tuple(suspects), t)

    @classmethod
    def after(cls, c: StateContext, e: GroupFailure, step: int | None = None) -> Recovering:
        """The recovery from a failed group call."""
        return cls.now(c, e.kind, str(e), e.suspects, step)

    def step(self, c: StateContext) -> State:
        decision = c.opts.failure.decide(c.failures.add(self.failure), c.clock())
        detected = self.detected_at or c.clock()  # detection is measured from the last sign of progress
        c.observers.on_failure(c, self.failure, max(0.0, detected - c.progress_at))
        c.event("failure", failure_kind=self.failure.kind, step=self.failure.step, message=self.failure.message,
                decision=decision.reason, world_size=len(c.members))
        log.warning("failure: %s", decision.reason)
        if isinstance(decision, Fail):
            return Failed(decision.reason)
        if decision.delay_s:
            c.sleep(decision.delay_s)
        world_before = len(c.members)
        t0 = c.clock()
        c.poll_progress(timeout=0.5)  # rank 0's last steps (history, saves) before anyone is killed
        last_step = c.last_completed_step()  # the newest step trained: what a restore to an older one loses
        survivors = c.settle_after_failure(self.suspects)
        # Replacements for lost members start now; new standbys only once the group trains again,
        # so that their boot does not compete with the recovery for the machine.
        c.ensure_workers(c.desired(), standby=False)
        t_settled = c.clock()
        poll = 0.0  # look first without waiting: a ready standby means the group can form now
        while True:
            candidates = survivors + c.spares
            ready = c.group.ready(candidates, timeout=poll)
            poll = c.opts.poll_s
            waited = c.clock() - t_settled
            # Survivors do not wait for new processes to boot: they go on at the best size ready now,
            # and the group grows back at a step boundary once the replacements are up.
            size = c.formable(ready, candidates, c.desired(), waited, wait_booting=False)
            if size is not None or waited >= c.opts.replace_wait_s:
                break
        c.begin_recovery(PendingRecovery(detected_at=self.detected_at or t0, last_step=last_step,
                                         world_before=world_before, failure_kind=self.failure.kind,
                                         failure_time_unix=time.time() - (c.clock() - self.failure.time),
                                         settled_at=t_settled, phases={"settle_s": t_settled - t0}))
        if size is None:  # below min_workers: wait for capacity; the recovery completes when a group forms
            return Scheduling(c.desired(), "waiting for capacity after a failure")
        try:
            c.form(size, ready)
        except GroupFailure as e:  # at the step this recovery started from
            return Recovering.after(c, e, last_step)
        return Running()


@dataclass
class Resizing(State):
    target: int
    reason: str
    requested_at: float = 0.0
    leaving: tuple[str, ...] = ()  # members that must not stay (on a draining node: orchestrator.controller.drain)
    name = Phase.RESIZING

    def step(self, c: StateContext) -> State:
        t0 = c.clock()
        c.stop_at_boundary()
        t1 = c.clock()
        # From memory when every member holds the current step there, else through a durable checkpoint.
        in_memory = c.memory_flush()
        saved = in_memory or c.save_now()
        t2 = c.clock()
        if not saved:
            log.warning("resize to %d postponed: the boundary checkpoint did not commit", self.target)
            c.grow_check_in(c.opts.grow_check_s)
            return Running()
        before = len(c.members)
        ready = [w for w in c.group.ready(c.members + c.spares, timeout=0) if w not in self.leaving]
        c.form(self.target, ready)
        for w in self.leaving:  # off the draining node; their replacements start below, elsewhere
            c.group.kill(w)
        requested = self.requested_at or t0
        c.begin_resize(PendingResize(requested_at=requested, from_workers=before, to_workers=self.target,
                                     reason=self.reason, tier=c.restored_tier,
                                     phases={"notice_s": t0 - requested, "stop_s": t1 - t0,
                                             ("memory_flush_s" if in_memory else "save_s"): t2 - t1,
                                             **c.form_phases}), leaving=self.leaving)
        c.ensure_workers(c.desired(), standby=False)  # a shrink leaves old members as spares: stop the surplus
        return Running()


def suspending(c: StateContext, when: str = "") -> Suspending:
    """The suspend asked for: by the driver (``c.suspend_cause``: SIGTERM) or by the spec (a request)."""
    if c.suspend_cause:
        return Suspending(f"suspended by {c.suspend_cause}{' ' + when if when else ''}", cause=c.suspend_cause)
    return Suspending(f"suspend requested{' ' + when if when else ''}")


@dataclass
class Suspending(State):
    reason: str
    cause: str = "request"  # what asked for it: "request" (the spec: etrain suspend, the API), "SIGTERM"
    name = Phase.SUSPENDING

    def step(self, c: StateContext) -> State:
        step = c.last_completed_step()
        try:
            c.stop_at_boundary()
            saved = c.save_now()
        except GroupFailure as e:
            saved = False
            log.warning("suspending after a failure at step %d: %s", step, e)
        c.release_workers()
        c.event("suspended", step=c.last_completed_step(), checkpoint_committed=bool(saved), reason=self.reason,
                cause=self.cause)
        return Suspended(f"{self.reason} at step {c.last_completed_step()}")


@dataclass
class Finishing(State):
    reason: str
    stopping: bool = False
    name = Phase.FINISHING

    def step(self, c: StateContext) -> State:
        try:
            if self.stopping:
                c.stop_at_boundary()
            if not c.save_now() and c.cfg.checkpoint.url and c.members:
                # The storage refused the last checkpoint (not a member's death): the
                # run's final state is not durable, and it must say so.
                c.release_workers()
                return Failed(f"the final checkpoint (step {c.last_completed_step()}) failed: "
                              f"{c.last_save_error or 'see the checkpoint_failed events'}")
        except GroupFailure as e:
            # A member died during the final save: recover like any failure (Controller.step), so that the
            # last steps are trained again (if they must be) and the final checkpoint commits; never finish
            # without it.
            log.warning("the final checkpoint failed: %s", e)
            raise
        c.release_workers()
        c.event("finished", step=c.last_completed_step(), reason=self.reason)
        return Finished(self.reason)


@dataclass
class Terminal(State):
    reason: str
    terminal = True

    def step(self, c: StateContext) -> State:
        raise RuntimeError(f"{self.name} is terminal")


class Suspended(Terminal):
    name = Phase.SUSPENDED


class Finished(Terminal):
    name = Phase.FINISHED


class Failed(Terminal):
    name = Phase.FAILED


# --- Running's checks -------------------------------------------------------------------


def check_training(c: StateContext) -> State | None:
    """React to train calls that returned: done, stopped, failed, or a dead worker."""
    calls = list(c.train_calls.values())
    t0 = c.clock()
    # Whichever call returns first is looked at at once: a dead worker is noticed without waiting out the poll.
    done = c.group.wait(calls, timeout=c.opts.poll_s, first=True)
    if not done:
        return None
    results, lost = _train_results(c, done)
    if not lost and all(r.kind == "collective_failed" for r in results.values() if r.failed) and \
            len(done) < len(calls):
        # A rank that finished (or stopped) first, or one whose collective failed (an echo: the cause, a
        # dead or failing peer, comes next): the others are waited for, not spun on.
        done = c.group.wait(calls, timeout=max(0.0, c.opts.poll_s - (c.clock() - t0)))
        results, lost = _train_results(c, done)
    if lost:
        # Name ranks, not worker ids: a replacement gets a new id, and the crash-loop rule compares messages.
        ranks = ",".join(str(c.members.index(w)) for w, _ in lost if w in c.members)
        log.warning("workers lost: %s", "; ".join(m for _, m in lost))
        return Recovering.now(c, "actor_died", f"worker died: rank {ranks}", tuple(w for w, _ in lost))
    if any(r.status == "faulty" for r in results.values()):  # [health]: a fault that follows one rank
        return c.faults.respond(c, [call for call in calls if call not in done], results)
    failed = {w: r for w, r in results.items() if r.failed}
    if failed:
        # The cause before its echoes: peers of a failing rank only see their collective fail.
        # The message groups the culprits by error ("ranks 1,3: X"), named by rank.
        culprits = {w: r for w, r in failed.items() if r.kind != "collective_failed"} or failed
        kind = next(iter(culprits.values())).kind
        message = group_rank_errors({c.members.index(w): r.error for w, r in culprits.items()})
        return Recovering.now(c, kind, message)
    if len(results) == len(c.train_calls) and all(r.status == "done" for r in results.values()):
        c.poll_progress()  # the last steps' figures (loss), which the final status reports
        c.reached(max(r.step for r in results.values()))
        return Finishing("all steps done")
    return None  # "stopped" results are collected by stop_at_boundary


def _train_results(c: StateContext, done: list) -> tuple[dict, list]:
    """The returned train calls' results by worker, and the workers lost (with why)."""
    results, lost = {}, []
    for call in done:
        try:
            results[call.wid] = c.group.result(call)
        except WorkerLost as e:
            lost.append((call.wid, str(e)))
    return results, lost


def check_durability(c: StateContext) -> State | None:
    """Failed once ``checkpoint.max_consecutive_failures`` saves failed in a row: the run's work
    is no longer being made durable, and training on would only hide that."""
    limit = c.cfg.checkpoint.max_consecutive_failures
    if c.saves_failed_in_a_row < limit:
        return None
    try:
        c.stop_at_boundary()
    except GroupFailure as e:
        log.warning("stopping after %d failed checkpoints: %s", c.saves_failed_in_a_row, e)
    return Failed(f"{c.saves_failed_in_a_row} checkpoints in a row failed (last: {c.last_save_error}); "
                  f"the run stops because its work is not being made durable: fix the storage at "
                  f"{redact(c.cfg.checkpoint.url)} and `etrain resume {c.run_id}`, or raise "
                  "checkpoint.max_consecutive_failures")


def check_hang(c: StateContext, probe: HangProbe) -> State | None:
    """Recovering when no step completed within the hang deadline, naming the members that do not answer
    (pinged ahead of the deadline: :mod:`orchestrator.workers.hang_probe`)."""
    hung = probe.look(c.group, c.members, c.progress_at, c.clock, c.hang_deadline())
    if hung is None:
        return None
    idle = c.clock() - c.progress_at
    msg = (f"no step completed for {idle:.0f} s (deadline {c.hang_deadline():.0f} s); "
           + (f"{len(hung)} worker(s) unresponsive" if hung else "every worker answers: a collective hang"))
    return Recovering.now(c, "hang", msg, hung or tuple(c.members))


def check_drain(c: StateContext) -> State | None:
    """A node hosting members is draining (``orchestrator.controller.drain``): shrink off it at this step boundary,
    or commit a checkpoint before its deadline when the run cannot shrink; not a failure."""
    decision = c.drains.check(c)
    if isinstance(decision, DrainShrink):
        return Resizing(decision.size, decision.reason, c.clock(), leaving=decision.leaving)
    if isinstance(decision, DrainCommit):
        c.stop_at_boundary()
        c.save_now()  # the members train on from this boundary (Running relaunches them)
    return None


def check_scaling(c: StateContext) -> State | None:
    """Resize requests, shrink requests, and growth when spares are up.

    Missing workers are started at most every ``grow_check_s``; spares
    already started are looked at on every poll, and the group grows once
    every spare that holds resources is up (one re-formation, not one per
    worker), or when the rest have booted for longer than ``boot_timeout_s``.
    """
    current, want = len(c.members), c.desired()
    requested_at = c.resize_requested_at or c.clock()
    if (want == current and c.opts.standby and c.pending_recovery is None and c.pending_resize is None
            and c.clock() >= c.next_grow_check):  # top the standbys up once the group trains again
        c.grow_check_in(min(c.opts.grow_check_s, 5.0))
        c.ensure_workers(want)
    if want < current:
        size = c.scaling.target(ScalingStatus(current, want, current, c.valid_sizes))
        if size is not None and size != current:
            return Resizing(size, f"shrinking {current} -> {size} workers: {size_reason(c.spec)}", requested_at)
        return None
    if want > current:
        now = c.clock()
        if now >= c.next_grow_check:
            c.grow_check_in(min(c.opts.grow_check_s, 5.0))
            c.ensure_workers(want)
        if not c.spares:
            return None
        ready = c.group.ready(c.spares, timeout=0)
        booting = [w for w in c.group.placed(c.spares) if w not in ready]
        if booting and len(ready) < want - current and c.boot_wait(now) < c.opts.boot_timeout_s:
            return None
        c.boot_done()
        decision = c.scaling.decide(ScalingStatus(current, want, current + len(ready), c.valid_sizes), now)
        if isinstance(decision, Resize) and decision.workers > current:
            return Resizing(decision.workers, f"growing {current} -> {decision.workers} workers: "
                                              f"{size_reason(c.spec)}", requested_at)
    return None
