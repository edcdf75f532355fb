"""The run's controller: an explicit state machine over a group of TrainWorkers.

    ctl = Controller(spec, store, group)      # group: RayWorkerGroup, or a fake in tests
    ctl.run()                                 # step() until SUSPENDED, FINISHED or FAILED

One class per state, each carrying its own data; ``State.step(ctl)`` does one
bounded piece of work and returns the next state (often itself). ``run`` is
only the loop. The controller reads the desired state (the spec) from the
run store and writes the observed state (status, events) back; everything it
decides comes from the pure policies in ``orchestrator.policies``.

Recovery is in place: when a worker dies (actor death), a collective fails
because its peer vanished, or no step completes within the hang deadline,
the survivors keep their processes. The controller bumps the epoch (a
compare-and-swap in the store: a stale controller is fenced), picks the
largest valid group from survivors and ready spares, and every member
re-forms its process group and Trainer and restores the newest checkpoint,
resharded. Missing workers are started in the background and the group grows
back at a step boundary when they are up (the same path as a resize, which
loses no step).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from checkpointing.errors import EtrainError, FencedError
from checkpointing.manager import group_rank_errors
from checkpointing.names import redact
from checkpointing.retry import describe
from trainer.config import config_from_dict
from trainer.parallel import valid_world_sizes

from .phase import Phase
from .policies import Fail, FailureLog, FailurePolicy, FailureRecord, Resize, ScalingPolicy, ScalingStatus
from .store import RunSpec, RunStore, StoreUnavailable
from .worker_group import WorkerLost

log = logging.getLogger("etrain")

HISTORY_MAX = 100_000  # steps kept in the run's history (the newest)


@dataclass(kw_only=True)
class ControllerOptions:
    poll_s: float = 0.2  # how often RUNNING looks at calls, progress and the spec
    spec_every_s: float = 0.2  # how often the spec is re-read (a resize or suspend waits at most this)
    status_every_s: float = 1.0  # how often the status is written
    start_timeout_s: float = 600.0  # workers that cannot start (no capacity) within this fail the run
    replace_wait_s: float = 0.0  # how long to wait for workers that have no resources before forming smaller
    boot_timeout_s: float = 120.0  # how long a start or a grow waits for workers that are still booting
    standby: int = 0  # warm workers kept started beyond the group: a failure or a grow uses one at once
    hang_timeout_s: float = 0.0  # 0: derived, max(hang_min_s, hang_factor x median step time)
    hang_min_s: float = 30.0
    hang_factor: float = 20.0
    call_timeout_s: float = 180.0  # bound on form / restore / save calls
    # After a failure, how long survivors get to leave the collective they were in. Gloo frees a
    # rank blocked on a peer that errored out only when that peer's process exits, so a survivor
    # still blocked after this is replaced rather than waited for until the collective timeout.
    settle_s: float = 5.0
    grow_check_s: float = 5.0  # how often a smaller-than-requested group looks for capacity
    lease_ttl_s: float = 15.0
    store_wait_s: float = 300.0  # how long a write the run needs (epoch, final status) waits for the store
    failure: FailurePolicy = field(default_factory=FailurePolicy)


class GroupFailure(EtrainError):
    """A collective call on the group failed; carries what was seen."""

    def __init__(self, message: str, kind: str = "error", suspects: tuple = ()):
        super().__init__(message)
        self.kind = kind
        self.suspects = tuple(suspects)

    def __reduce__(self):
        return (GroupFailure, (str(self), self.kind, self.suspects))


# --- states ----------------------------------------------------------------------


class State:
    name = "STATE"
    terminal = False

    def step(self, c: Controller) -> State:
        raise NotImplementedError(f"{type(self).__name__}.step")


@dataclass
class Initializing(State):
    name = Phase.INITIALIZING

    def step(self, c: Controller) -> State:
        c.lease = c.store.acquire(c.run_id, c.controller_id, ttl_s=c.opts.lease_ttl_s)
        c.start_lease_keeper()
        c.epoch = c.store.current_epoch(c.run_id)
        c.history = c.store.get_history(c.run_id)  # a resumed run's steps so far
        c.event("started", workers=c.spec.workers, min_workers=c.spec.min_workers, max_workers=c.spec.max_workers,
                controller_id=c.controller_id)
        if c.metrics_url:
            c.event("metrics", url=c.metrics_url, file_sd=c.metrics_file_sd)
        return Scheduling(c.desired(), "starting")


@dataclass
class Scheduling(State):
    """Start workers and wait until enough are up to form a valid group."""

    target: int
    reason: str
    since: float | None = None
    name = Phase.SCHEDULING

    def step(self, c: Controller) -> State:
        now = c.clock()
        self.since = self.since if self.since is not None else now
        if c.spec.suspended:
            return Suspending("suspend requested while scheduling")
        c.ensure_workers(self.target)
        candidates = c.members + c.spares
        ready = c.group.ready(candidates, timeout=c.opts.poll_s)
        waited = now - self.since
        size = c.formable(ready, candidates, self.target, waited)
        if size is not None:
            c.form(size, ready)
            return Running()
        if waited > c.opts.start_timeout_s:
            status = ScalingStatus(current=0, requested=self.target, available=len(ready), valid_sizes=c.valid_sizes)
            decision = c.scaling.decide(status, now)
            return Failed(f"workers did not start within {c.opts.start_timeout_s:.0f} s: {decision.reason}")
        c.refresh_spec_throttled()
        return self


@dataclass
class Running(State):
    name = Phase.RUNNING

    def step(self, c: Controller) -> State:
        if not c.train_calls:
            c.launch_training()
        failure = c.check_training()
        if isinstance(failure, State):
            return failure
        c.poll_progress()
        undurable = c.check_durability()
        if undurable is not None:
            return undurable
        c.poll_telemetry()
        c.standby_ready = len(c.group.ready(c.spares, timeout=0)) if c.spares else 0
        c.refresh_spec_throttled()
        if c.spec.suspended:
            return Suspending("suspend requested")
        if c.spec.stop:
            return Finishing("stop requested", stopping=True)
        hang = c.check_hang()
        if hang is not None:
            return hang
        return c.check_scaling() or self


@dataclass
class Recovering(State):
    failure: FailureRecord
    suspects: tuple[str, ...] = ()
    detected_at: float = 0.0  # controller clock
    name = Phase.RECOVERING

    def step(self, c: Controller) -> State:
        decision = c.opts.failure.decide(c.failures.add(self.failure), c.clock())
        if c.metrics is not None:  # detection is measured from the last sign of progress
            detected = self.detected_at or c.clock()
            c.metrics.observe_failure(self.failure.kind, max(0.0, detected - c.progress_at))
        c.event("failure", failure_kind=self.failure.kind, step=self.failure.step, message=self.failure.message,
                decision=decision.reason, world_size=len(c.members))
        log.warning("failure: %s", decision.reason)
        if isinstance(decision, Fail):
            return Failed(decision.reason)
        if decision.delay_s:
            c.sleep(decision.delay_s)
        last_step = c.last_completed_step()
        world_before = len(c.members)
        t0 = c.clock()
        c.poll_progress(timeout=0.5)  # rank 0's last steps (history, saves) before anyone is killed
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
        c.pending_recovery = {"detected_at": self.detected_at or t0, "last_step": last_step,
                              "world_before": world_before, "failure_kind": self.failure.kind,
                              "failure_time_unix": time.time() - (c.clock() - self.failure.time),
                              "settled_at": t_settled, "phases": {"settle_s": t_settled - t0}}
        if size is None:  # below min_workers: wait for capacity; the recovery completes when a group forms
            return Scheduling(c.desired(), "waiting for capacity after a failure")
        try:
            c.form(size, ready)
        except GroupFailure as e:
            return Recovering(FailureRecord(e.kind, last_step, str(e), c.clock()), e.suspects, c.clock())
        return Running()


@dataclass
class Resizing(State):
    target: int
    reason: str
    requested_at: float = 0.0
    name = Phase.RESIZING

    def step(self, c: Controller) -> State:
        t0 = c.clock()
        try:
            c.stop_at_boundary()
            t1 = c.clock()
            saved = c.save_now()
        except GroupFailure as e:
            return Recovering(FailureRecord(e.kind, c.last_completed_step(), str(e), c.clock()), e.suspects,
                              c.clock())
        t2 = c.clock()
        if not saved:
            log.warning("resize to %d postponed: the boundary checkpoint did not commit", self.target)
            c.next_grow_check = c.clock() + c.opts.grow_check_s
            return Running()
        before = len(c.members)
        ready = c.group.ready(c.members + c.spares, timeout=0)
        try:
            c.form(self.target, ready)
        except GroupFailure as e:
            return Recovering(FailureRecord(e.kind, c.last_completed_step(), str(e), c.clock()), e.suspects,
                              c.clock())
        c.ensure_workers(c.desired(), standby=False)  # a shrink leaves old members as spares: stop the surplus
        requested = self.requested_at or t0
        c.pending_resize = {"requested_at": requested, "from": before, "to": self.target, "reason": self.reason,
                            "phases": {"notice_s": t0 - requested, "stop_s": t1 - t0, "save_s": t2 - t1,
                                       **c.form_phases}}
        return Running()


@dataclass
class Suspending(State):
    reason: str
    name = Phase.SUSPENDING

    def step(self, c: Controller) -> State:
        step = c.last_completed_step()
        try:
            c.stop_at_boundary()
            saved = c.save_now()
        except GroupFailure as e:
            saved = False
            log.warning("suspending after a failure at step %d: %s", step, e)
        c.group.shutdown()
        c.members, c.spares, c.train_calls = [], [], {}
        c.event("suspended", step=c.last_completed_step(), checkpoint_committed=bool(saved), reason=self.reason)
        return Suspended(f"{self.reason} at step {c.last_completed_step()}")


@dataclass
class Finishing(State):
    reason: str
    stopping: bool = False
    name = Phase.FINISHING

    def step(self, c: Controller) -> State:
        try:
            if self.stopping:
                c.stop_at_boundary()
            if not c.save_now():
                if c.cfg.checkpoint.url and c.members:
                    # The storage refused the last checkpoint (not a member's death): the
                    # run's final state is not durable, and it must say so.
                    c.group.shutdown()
                    c.members, c.spares, c.train_calls = [], [], {}
                    return Failed(f"the final checkpoint (step {c.last_completed_step()}) failed: "
                                  f"{c.last_save_error or 'see the checkpoint_failed events'}")
        except GroupFailure as e:
            # A member died during the final save: recover like any failure, so that the last steps are
            # trained again (if they must be) and the final checkpoint commits; never finish without it.
            log.warning("the final checkpoint failed: %s", e)
            return Recovering(FailureRecord(e.kind, c.last_completed_step(), str(e), c.clock()), e.suspects,
                              c.clock())
        c.group.shutdown()
        c.members, c.spares, c.train_calls = [], [], {}
        c.event("finished", step=c.last_completed_step(), reason=self.reason)
        return Finished(self.reason)


@dataclass
class Terminal(State):
    reason: str
    terminal = True

    def step(self, c: Controller) -> State:
        raise RuntimeError(f"{self.name} is terminal")


class Suspended(Terminal):
    name = Phase.SUSPENDED


class Finished(Terminal):
    name = Phase.FINISHED


class Failed(Terminal):
    name = Phase.FAILED


# --- the controller ------------------------------------------------------------------


class Controller:
    def __init__(self, spec: RunSpec, store: RunStore, group, opts: ControllerOptions | None = None,
                 clock=time.monotonic, controller_id: str | None = None, sleep=time.sleep, metrics=None):
        self.spec = spec
        self.run_id = spec.run_id
        self.store = store
        self.group = group
        self.opts = opts or ControllerOptions()
        self.clock = clock
        self.sleep = sleep
        self.controller_id = controller_id or f"ctl-{uuid.uuid4().hex[:8]}"
        self.cfg = config_from_dict(spec.config)
        self.total_steps = self.cfg.train.steps
        self.scaling = ScalingPolicy(min_workers=spec.min_workers, max_workers=spec.max_workers)
        self.valid_sizes = tuple(valid_world_sizes(self.cfg, spec.max_workers))
        self.failures = FailureLog()
        self.state: State = Initializing()
        self.lease = None
        self.fenced: str | None = None  # why this controller may no longer write (another one leads)
        self.epoch = 0
        self.members: list[str] = []  # worker ids, by rank
        self.spares: list[str] = []  # started, not in the group (pending or ready)
        self.train_calls: dict[str, Any] = {}
        self.progress: dict = {}
        self.progress_at = clock()
        self.step_times: deque[float] = deque(maxlen=50)
        self.committed_step: int | None = None
        self.saves_failed_in_a_row = 0  # checkpoint.max_consecutive_failures fails the run
        self.last_save_error = ""
        self.pending_recovery: dict | None = None
        self.pending_resize: dict | None = None
        self.form_phases: dict[str, float] = {}  # seconds of the last form(): process group + trainer, restore
        self.next_grow_check = 0.0
        self.standby_ready = 0  # started workers outside the group that are up (read while RUNNING)
        self.booting_since: float | None = None  # when spares were first seen booting (growth waits for them)
        self.resize_requested_at: float | None = None  # when a changed size request was first read
        self.next_spec_read = 0.0
        self.next_status = 0.0
        self.counters = {"recoveries": 0, "failures": 0, "steps_lost": 0, "resizes": 0}
        self.recovery_seconds: list[float] = []
        self.started_unix = time.time()
        self.productive_s = 0.0
        self._unsent_events: list[dict] = []
        self.events_log: list[dict] = []  # every event of this controller, for the driver's live view
        self._lock = threading.Lock()
        self._keeper: threading.Thread | None = None
        self._stop_keeper = threading.Event()
        # The run's Prometheus figures (orchestrator.metrics.RunMetrics), None without an endpoint.
        self.metrics = metrics
        self.metrics_url: str | None = None
        self.metrics_file_sd: str | None = None  # the Prometheus target file of the endpoint
        self._telemetry_calls: dict[str, Any] = {}
        self.next_telemetry = 0.0
        self.history: list[list] = []  # every step trained, from rank 0 (RunStore.put_history)
        self.storage_faults: dict | None = None  # injected by `etrain chaos`, for every worker
        self.next_history = 0.0

    # --- the loop ------------------------------------------------------------------------

    def step(self) -> State:
        """One iteration: the current state's step, then the status write."""
        before = self.state
        try:
            nxt = before.step(self)
        except FencedError as e:
            nxt = Failed(f"fenced: {e}")
        except WorkerLost as e:
            nxt = Recovering(FailureRecord("actor_died", self.last_completed_step(), str(e), self.clock()), (),
                             self.clock())
        except GroupFailure as e:  # a group call (form, restore, save) failed where the state did not catch it
            nxt = Recovering(FailureRecord(e.kind, self.last_completed_step(), str(e), self.clock()), e.suspects,
                             self.clock())
        except StoreUnavailable as e:  # only from until_store, past its bound
            nxt = Failed(str(e))
        if not nxt.terminal:
            self.publish_throttled()
            if self.fenced is not None:  # another controller leads the run now: stop, change nothing
                nxt = Failed(f"fenced: {self.fenced}")
        if type(nxt) is not type(before):
            log.info("%s -> %s", before.name, nxt.name)
        self.state = nxt
        if self.metrics is not None:
            self.metrics.observe_run(world_size=len(self.members), epoch=self.epoch, phase=nxt.name,
                                     goodput=self.goodput())
        if nxt.terminal:
            self.finish(nxt)
        return nxt

    def run(self) -> dict:
        while not self.state.terminal:
            self.step()
        return self.snapshot()

    # --- membership ---------------------------------------------------------------------

    def desired(self) -> int:
        """The size to aim for: the largest allowed valid size <= the requested workers."""
        want = max(self.spec.min_workers, min(self.spec.workers, self.spec.max_workers))
        fits = [n for n in self.scaling.allowed(self.valid_sizes) if n <= want]
        return fits[-1] if fits else want

    def ensure_workers(self, target: int, standby: bool = True) -> None:
        """Start workers until members plus spares are ``target`` plus the warm standbys (without
        ``standby``: ``target``, starting no new standby); stop spares beyond ``target`` plus standbys."""
        keep = target + self.opts.standby
        want = keep if standby else target
        have = len(self.members) + len(self.spares)
        if have < want:
            self.spares += self.group.start(want - have)
        elif have > keep and self.spares:
            room = max(0, keep - len(self.members))
            for wid in self.spares[room:]:
                self.group.kill(wid)
            self.spares = self.spares[:room]

    def formable(self, ready: list[str], candidates: list[str], target: int, waited: float,
                 wait_booting: bool = True) -> int | None:
        """The size to form a group at now from ``ready`` workers, or None to wait for more.

        The largest valid size up to ``target`` as soon as that many are ready.
        Otherwise, after ``replace_wait_s``, the largest valid size that is
        ready, unless (``wait_booting``) workers that already hold resources
        (booting: a new process importing torch) would make it larger; those
        are waited for up to ``boot_timeout_s``. Workers without resources
        (no capacity in the cluster) are not waited for past ``replace_wait_s``.
        """
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
        chosen = [w for w in self.members if w in ready][:size]
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
        calls = [self.group.submit(w, "form", self.epoch, r, size, addr, port) for r, w in enumerate(chosen)]
        formed = self._collect(calls, "form")
        t1 = self.clock()
        restored = self._group_call(chosen, "restore")
        self.form_phases = {"form_s": t1 - t0, "restore_s": self.clock() - t1}
        for r in formed.values():  # the slowest rank's time in each part of forming
            for k, v in r.get("phases", {}).items():
                self.form_phases[k] = max(v, self.form_phases.get(k, 0.0))
        step = restored[rank0]["step"]
        self.progress = {"step": step}
        self.progress_at = self.clock()
        self.committed_step = restored[rank0]["from_step"]
        if self.metrics is not None:
            self.metrics.observe_commit(self.committed_step)
            self.metrics.forget_ranks_above(size)
            self._telemetry_calls = {}
        if self.pending_recovery is not None and "restored_step" not in self.pending_recovery:
            r = self.pending_recovery
            r.update(restored_step=step, world_after=size)
            r["phases"].update(wait_replacement_s=t0 - r["settled_at"], **self.form_phases)
        self.event("formed", epoch=self.epoch, world_size=size, step=step, restored_from=restored[rank0]["from_step"],
                   rendezvous=f"{addr}:{port}",
                   members=[self.group.info(w).get("node_id", "")[:8] for w in chosen],
                   nodes=[self.group.info(w).get("node_id", "") for w in chosen],
                   pids=[self.group.info(w).get("pid") for w in chosen])
        return step

    def until_store(self, fn, what: str):
        """``fn()``, retried while the run store is unreachable, for at most ``store_wait_s``.

        For the writes the run cannot go on without (the epoch fence): the
        group waits for the store rather than form without one.
        """
        deadline = self.clock() + self.opts.store_wait_s
        while True:
            try:
                return fn()
            except StoreUnavailable as e:
                if self.clock() >= deadline:
                    raise StoreUnavailable(f"{what}: the run store was unreachable for "
                                           f"{self.opts.store_wait_s:.0f} s ({e})") from None
                log.warning("%s: waiting for the run store (%s)", what, e)
                self.sleep(min(1.0, self.opts.store_wait_s))

    def _group_call(self, wids: list[str], method: str, *args) -> dict:
        return self._collect([self.group.submit(w, method, *args) for w in wids], method)

    def _collect(self, calls: list, what: str) -> dict:
        """Results of calls on every member, or GroupFailure naming the ones that died or hung."""
        deadline = self.clock() + self.opts.call_timeout_s
        pending = list(calls)
        out = {}
        lost, raised = [], []
        while pending and self.clock() < deadline:
            for call in self.group.wait(pending, timeout=min(1.0, max(0.0, deadline - self.clock()))):
                pending.remove(call)
                try:
                    out[call.wid] = self.group.result(call)
                except WorkerLost as e:
                    lost.append((call.wid, str(e)))
                except Exception as e:  # the method raised in a live worker: a peer vanished mid-collective
                    raised.append((call.wid, describe(getattr(e, "cause", None) or e)))
            if lost or raised:
                break
        if lost:
            raise GroupFailure(f"{what}: " + "; ".join(m for _, m in lost), "actor_died", [w for w, _ in lost])
        if raised:
            # The worker that raised lives on (its process group is rebuilt by the next form); the failure
            # that caused it is found when the group settles.
            ranks = {self.members.index(w) if w in self.members else -1: m for w, m in raised}
            raise GroupFailure(f"{what}: " + group_rank_errors(ranks), "collective_failed", [])
        if pending:
            raise GroupFailure(f"{what} did not finish within {self.opts.call_timeout_s:.0f} s on workers "
                               f"{','.join(c.wid for c in pending)}", "hang", [c.wid for c in pending])
        return out

    # --- training ------------------------------------------------------------------------

    def launch_training(self) -> None:
        self.train_calls = {w: self.group.submit(w, "train", self.total_steps) for w in self.members}
        self.progress_at = self.clock()

    def check_training(self) -> State | None:
        """React to train calls that returned: done, stopped, failed, or a dead worker."""
        done = self.group.wait(list(self.train_calls.values()), timeout=self.opts.poll_s)
        if not done:
            return None
        results, lost = {}, []
        for call in done:
            try:
                results[call.wid] = self.group.result(call)
            except WorkerLost as e:
                lost.append((call.wid, str(e)))
        step = self.last_completed_step()
        if lost:
            # Name ranks, not worker ids: a replacement gets a new id, and the crash-loop rule compares messages.
            ranks = ",".join(str(self.members.index(w)) for w, _ in lost if w in self.members)
            log.warning("workers lost: %s", "; ".join(m for _, m in lost))
            return Recovering(FailureRecord("actor_died", step, f"worker died: rank {ranks}", self.clock()),
                              tuple(w for w, _ in lost), self.clock())
        failed = {w: r for w, r in results.items() if r["status"] == "failed"}
        if failed:
            # The cause before its echoes: peers of a failing rank only see their collective fail.
            # The message groups the culprits by error ("ranks 1,3: X"), named by rank.
            culprits = {w: r for w, r in failed.items() if r.get("kind") != "collective_failed"} or failed
            kind = next(iter(culprits.values())).get("kind", "error")
            message = group_rank_errors({self.members.index(w): r["error"] for w, r in culprits.items()})
            return Recovering(FailureRecord(kind, step, message, self.clock()), (), self.clock())
        if len(results) == len(self.train_calls) and all(r["status"] == "done" for r in results.values()):
            self.poll_progress()  # the last steps' figures (loss), which the final status reports
            self.progress["step"] = max(r["step"] for r in results.values())
            return Finishing("all steps done")
        return None  # "stopped" results are collected by stop_at_boundary

    def poll_progress(self, timeout: float = 2.0) -> None:
        """Rank 0's last step (every rank reaches the same step boundary)."""
        if not self.members:
            return
        try:
            p = self.group.result(self.group.submit(self.members[0], "progress"), timeout=timeout)
        except (TimeoutError, WorkerLost):
            return
        self._absorb_saves(p.get("saves", []))
        rows = p.pop("history", None) or []
        self.history.extend(rows)
        del self.history[:-HISTORY_MAX]
        self.productive_s += sum(r[5] for r in rows if len(r) > 5)  # every step's time, not only the polled one
        if p.get("step") is not None and p.get("step", -1) > self.progress.get("step", -1):
            self.progress = p
            self.progress_at = self.clock()
            if self.metrics is not None:
                self.metrics.observe_step(p)
            self.step_times.append(p.get("step_seconds", 0.0))
            self._finish_pending(p)

    def _absorb_saves(self, saves: list[dict]) -> None:
        """Results of checkpoints as rank 0, the coordinator that commits them, reports them."""
        for s in saves:
            if self.metrics is not None:
                self.metrics.observe_save(s)
            if s["status"] in ("committed", "exists"):  # exists: the step was committed already
                self.committed_step = max(self.committed_step or 0, s["step"])
                self.saves_failed_in_a_row, self.last_save_error = 0, ""
            elif s["status"] == "skipped":  # when_busy="skip", or the step was committed already
                log.info("checkpoint of step %d not written: %s", s["step"], s.get("error", ""))
            else:
                if not s.get("cause"):  # a run-store outage is ridden out on its own bound (store_wait_s)
                    self.saves_failed_in_a_row += 1
                    self.last_save_error = s["error"]
                self.event("checkpoint_failed", step=s["step"], error=s["error"])

    def check_durability(self) -> State | None:
        """Failed once ``checkpoint.max_consecutive_failures`` saves failed in a row: the run's work
        is no longer being made durable, and training on would only hide that."""
        limit = self.cfg.checkpoint.max_consecutive_failures
        if self.saves_failed_in_a_row < limit:
            return None
        try:
            self.stop_at_boundary()
        except GroupFailure as e:
            log.warning("stopping after %d failed checkpoints: %s", self.saves_failed_in_a_row, e)
        return Failed(f"{self.saves_failed_in_a_row} checkpoints in a row failed (last: {self.last_save_error}); "
                      f"the run stops because its work is not being made durable: fix the storage at "
                      f"{redact(self.cfg.checkpoint.url)} and `etrain resume {self.run_id}`, or raise "
                      "checkpoint.max_consecutive_failures")

    def _finish_pending(self, p: dict) -> None:
        now = self.clock()
        if self.pending_recovery is not None:
            r, self.pending_recovery = self.pending_recovery, None
            lost = max(0, r["last_step"] - r["restored_step"])
            self.counters["recoveries"] += 1
            self.counters["steps_lost"] += lost
            seconds = now - r["detected_at"]
            self.recovery_seconds.append(seconds)
            if self.metrics is not None:
                self.metrics.observe_recovery(seconds, lost)
            self.event("recovered", time_to_recover_s=round(seconds, 3), steps_lost=lost,
                       restored_step=r["restored_step"], world_before=r["world_before"],
                       world_after=r["world_after"], failure_kind=r["failure_kind"],
                       detected_unix=time.time() - seconds, failure_unix=r["failure_time_unix"],
                       first_step_unix=p.get("time"), phases={k: round(v, 3) for k, v in r["phases"].items()})
        if self.pending_resize is not None:
            r, self.pending_resize = self.pending_resize, None
            self.resize_requested_at = None
            self.counters["resizes"] += 1
            if self.metrics is not None:
                self.metrics.observe_resize()
            self.event("resized", from_workers=r["from"], to_workers=r["to"],
                       resize_s=round(now - r["requested_at"], 3), reason=r["reason"], step=p.get("step"),
                       first_step_unix=p.get("time"), phases={k: round(v, 3) for k, v in r["phases"].items()})

    def last_completed_step(self) -> int:
        return int(self.progress.get("step", 0) or 0)

    def hang_deadline(self) -> float:
        if self.opts.hang_timeout_s:
            return self.opts.hang_timeout_s
        typical = statistics.median(self.step_times) if self.step_times else 0.0
        return max(self.opts.hang_min_s, self.opts.hang_factor * typical)

    def check_hang(self) -> State | None:
        idle = self.clock() - self.progress_at
        if idle <= self.hang_deadline():
            return None
        hung = tuple(w for w in self.members if not self.group.alive(w, timeout=2.0))
        msg = (f"no step completed for {idle:.0f} s (deadline {self.hang_deadline():.0f} s); "
               + (f"{len(hung)} worker(s) unresponsive" if hung else "every worker answers: a collective hang"))
        suspects = hung or tuple(self.members)
        return Recovering(FailureRecord("hang", self.last_completed_step(), msg, self.clock()), suspects, self.clock())

    def check_scaling(self) -> State | None:
        """Resize requests, shrink requests, and growth when spares are up.

        Missing workers are started at most every ``grow_check_s``; spares
        already started are looked at on every poll, and the group grows once
        every spare that holds resources is up (one re-formation, not one per
        worker), or when the rest have booted for longer than ``boot_timeout_s``.
        """
        current, want = len(self.members), self.desired()
        requested_at = self.resize_requested_at or self.clock()
        if (want == current and self.opts.standby and self.pending_recovery is None and self.pending_resize is None
                and self.clock() >= self.next_grow_check):  # top the standbys up once the group trains again
            self.next_grow_check = self.clock() + min(self.opts.grow_check_s, 5.0)
            self.ensure_workers(want)
        if want < current:
            size = self.scaling.target(ScalingStatus(current, want, current, self.valid_sizes))
            if size is not None and size != current:
                return Resizing(size, f"resize to {want} requested", requested_at)
            return None
        if want > current:
            now = self.clock()
            if now >= self.next_grow_check:
                self.next_grow_check = now + min(self.opts.grow_check_s, 5.0)
                self.ensure_workers(want)
            if not self.spares:
                return None
            ready = self.group.ready(self.spares, timeout=0)
            booting = [w for w in self.group.placed(self.spares) if w not in ready]
            if booting and len(ready) < want - current:
                self.booting_since = self.booting_since if self.booting_since is not None else now
                if now - self.booting_since < self.opts.boot_timeout_s:
                    return None
            self.booting_since = None
            decision = self.scaling.decide(ScalingStatus(current, want, current + len(ready), self.valid_sizes), now)
            if isinstance(decision, Resize) and decision.workers > current:
                return Resizing(decision.workers, decision.reason, requested_at)
        return None

    def stop_at_boundary(self) -> None:
        """Ask every member to stop after the current step and wait until they all did."""
        if not self.train_calls:
            return
        for w in self.members:
            self.group.submit(w, "request_stop")
        results = self._collect(list(self.train_calls.values()), "train")
        self.train_calls = {}
        failed = {w: r for w, r in results.items() if r["status"] == "failed"}
        if failed:
            r = next(iter(failed.values()))
            raise GroupFailure(r["error"], r.get("kind", "error"))
        self.poll_progress()
        self.progress["step"] = max(r["step"] for r in results.values())

    def save_now(self) -> bool:
        """A checkpoint of the current step, committed before this returns (collective)."""
        if not self.cfg.checkpoint.url or not self.members:
            return False
        if self.committed_step == self.last_completed_step():
            return True
        # A periodic save of this very step may still be uploading: let it finish and ask the
        # coordinator whether it committed, so that every rank takes the same branch below.
        flushed = self._group_call(self.members, "flush_saves")
        self._absorb_saves(flushed[self.members[0]])
        if self.committed_step == self.last_completed_step():
            return True
        results = self._group_call(self.members, "save")
        ok = all(r["status"] in ("committed", "exists") for r in results.values())
        if self.metrics is not None:
            self.metrics.observe_save({**results[self.members[0]], "status": "committed" if ok else "failed"})
        if ok:
            self.committed_step = self.last_completed_step()
            self.saves_failed_in_a_row, self.last_save_error = 0, ""
        else:
            bad = next(r for r in results.values() if r["status"] not in ("committed", "exists"))
            self.saves_failed_in_a_row += 1
            self.last_save_error = bad["error"]
            self.event("checkpoint_failed", step=self.last_completed_step(), error=bad["error"])
        return ok

    def settle_after_failure(self, suspects: tuple[str, ...]) -> list[str]:
        """Kill the culprits, let survivors' train calls return, and keep the survivors that answer."""
        for w in suspects:
            self.group.kill(w)
        members = [w for w in self.members if w not in suspects]
        pending = [c for w, c in self.train_calls.items() if w in members]
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

    # --- spec, status, events -----------------------------------------------------------

    def refresh_spec_throttled(self) -> None:
        now = self.clock()
        if now < self.next_spec_read:
            return
        self.next_spec_read = now + self.opts.spec_every_s
        try:
            spec = self.store.get_spec(self.run_id)
        except StoreUnavailable as e:
            log.debug("spec not refreshed: %s", e)
            return
        if spec.generation != self.spec.generation:
            if spec.workers != self.spec.workers:
                # From the request itself by the requester's clock, so that resize_s includes the time to
                # notice it; bounded (never in the future, at most 10 s back) against clocks that disagree.
                waited = time.time() - spec.updated_unix if spec.updated_unix else 0.0
                self.resize_requested_at = now - min(max(0.0, waited), 10.0)
            self.spec = spec
            self.scaling = ScalingPolicy(min_workers=spec.min_workers, max_workers=spec.max_workers)
            self.valid_sizes = tuple(valid_world_sizes(self.cfg, spec.max_workers))
            self.next_grow_check = 0.0

    def snapshot(self) -> dict:
        p = self.progress
        return {
            "run_id": self.run_id, "phase": self.state.name, "reason": getattr(self.state, "reason", ""),
            "world_size": len(self.members), "workers_requested": self.spec.workers, "step": self.last_completed_step(),
            "standby_ready": self.standby_ready,
            "total_steps": self.total_steps, "epoch": self.epoch, "loss": p.get("loss"), "lr": p.get("lr"),
            "tokens_per_s": p.get("tokens_per_s"), "latest_checkpoint": self.committed_step,
            "controller_id": self.controller_id, "started_unix": self.started_unix,
            "recoveries": self.counters["recoveries"], "failures": len(self.failures.records),
            "steps_lost": self.counters["steps_lost"], "resizes": self.counters["resizes"],
            "last_recovery_s": self.recovery_seconds[-1] if self.recovery_seconds else None,
            "goodput": self.goodput(), "metrics_url": self.metrics_url,
        }

    def goodput(self) -> float:
        """Productive step time over wall time since the controller started."""
        return min(1.0, self.productive_s / max(1e-9, time.time() - self.started_unix))

    def set_storage_faults(self, faults: dict | None) -> int:
        """Chaos: storage faults on every started worker, and on those started later."""
        self.storage_faults = faults
        wids = list(self.members) + list(self.spares)
        calls = [self.group.submit(w, "set_storage_faults", faults) for w in wids]
        self.group.wait(calls, timeout=10.0)
        self.event("chaos_storage", faults=faults)
        return len(wids)

    def poll_telemetry(self) -> None:
        """Every ``metrics.every_s``: collect the members' telemetry asked for last time, ask again.
        Never waits: a member busy in a long step answers on a later poll."""
        if self.metrics is None:
            return
        done = self.group.wait(list(self._telemetry_calls.values()), timeout=0) if self._telemetry_calls else []
        for call in done:
            self._telemetry_calls.pop(call.wid, None)
            try:
                t = self.group.result(call, timeout=0)
            except Exception as e:  # a worker that died is the failure path's business
                log.debug("telemetry of %s: %s", call.wid, e)
                continue
            if call.wid in self.members:
                self.metrics.observe_ranks(call.wid, {**t, "rank": self.members.index(call.wid)})
        now = self.clock()
        if now < self.next_telemetry:
            return
        self.next_telemetry = now + self.cfg.metrics.every_s
        for w in self.members:
            if w not in self._telemetry_calls:
                self._telemetry_calls[w] = self.group.submit(w, "telemetry")

    def publish_throttled(self) -> None:
        now = self.clock()
        if now >= self.next_status:
            self.next_status = now + self.opts.status_every_s
            self.publish()

    def publish(self) -> None:
        if self.fenced is not None:
            return
        try:
            self.store.put_status(self.run_id, self.snapshot(), self.lease)
            self._flush_events()
            if self.clock() >= self.next_history:
                self.next_history = self.clock() + 30.0
                self.store.put_history(self.run_id, self.history)
        except StoreUnavailable as e:
            log.debug("status not written (will catch up): %s", e)
        except FencedError as e:
            log.error("run %s: %s", self.run_id, e)
            self.fenced = str(e)

    def _publish_final(self) -> None:
        """The final status and every event not yet written, waiting for the store up to ``store_wait_s``."""
        if self.fenced is not None:
            return

        def write():
            self.store.put_status(self.run_id, self.snapshot(), self.lease)
            self.store.put_history(self.run_id, self.history)
            self._flush_events()
            if self._unsent_events:
                raise StoreUnavailable("events not written yet")

        try:
            self.until_store(write, "writing the final status")
        except StoreUnavailable as e:
            log.error("run %s: %s; `etrain status` shows the last status written", self.run_id, e)
        except FencedError as e:
            log.error("run %s: %s", self.run_id, e)

    def event(self, kind: str, **fields) -> None:
        e = {"kind": kind, "time": time.time(), "epoch": self.epoch, **fields}
        self.events_log.append(e)
        self._unsent_events.append(e)
        self._flush_events()

    def _flush_events(self) -> None:
        while self._unsent_events:
            try:
                self.store.add_event(self.run_id, self._unsent_events[0])
            except StoreUnavailable:
                return
            self._unsent_events.pop(0)

    def start_lease_keeper(self) -> None:
        """Renew the leadership lease in the background; losing it ends this controller's writes."""

        def keep():
            # Renew every third of the TTL; after a failed renewal (the store away) try again each second, so
            # that a short outage, whose failed request may itself take a client timeout, cannot outlast the
            # lease between two tries.
            wait_s = self.opts.lease_ttl_s / 3
            while not self._stop_keeper.wait(wait_s):
                try:
                    if not self.store.renew(self.lease):
                        log.error("lost the leadership of run %s; another controller leads it", self.run_id)
                        self.fenced = "lost the leadership lease; another controller may lead the run"
                        return
                    wait_s = self.opts.lease_ttl_s / 3
                except StoreUnavailable as e:
                    log.debug("lease not renewed (store away): %s", e)
                    wait_s = min(1.0, self.opts.lease_ttl_s / 3)

        self._keeper = threading.Thread(target=keep, name="etrain-lease", daemon=True)
        self._keeper.start()

    def finish(self, state: State) -> None:
        if isinstance(state, Failed):
            self.event("failed", reason=state.reason, step=self.last_completed_step())
            try:
                self.group.shutdown()
            except Exception as e:  # the group may be half gone already
                log.debug("group shutdown: %s", e)
        self._publish_final()
        self._stop_keeper.set()
        if self.lease is not None and self.fenced is None and not state.reason.startswith("fenced"):
            try:
                self.store.release(self.lease)
            except StoreUnavailable:
                pass
