"""The run's controller: the loop and the calls on its group (its membership: ``orchestrator.controller.membership``).

    ctl = Controller(spec, store, group, opts, config=cfg)   # group: RayWorkerGroup, or a fake in tests
    ctl.run()                                 # step() until SUSPENDED, FINISHED or FAILED; the final status
    ctl.step()                                # or one iteration at a time (tests)

The states (``orchestrator.controller.states``) carry the run's phase and its data and
decide what comes next; ``step`` runs the current state's step and ``run`` is
only the loop. The controller reads the desired state (the spec) from the run
store; everything it decides comes from the pure policies in
``orchestrator.controller.run_policy``. What happens is told to its observers
(``orchestrator.controller.observers``): the status, events and history in the run store,
the goodput, the leadership lease and, when the run serves them, the metrics.

Recovery is in place: when a worker dies (actor death), a collective fails
because its peer vanished, or no step completes within the hang deadline,
the survivors keep their processes. The controller bumps the epoch (a
compare-and-swap in the store: a stale controller is fenced), picks the
largest valid group from survivors and ready spares, and every member
re-forms its process group and Trainer and restores the newest checkpoint,
resharded. Missing workers are started in the background and the group grows
back at a step boundary when they are up (the same path as a resize, which
loses no step).

Invariants: the config is parsed once, by the driver (``config``); a group
call that fails raises :class:`GroupFailure` and becomes a recovery in
``step`` unless the state handles it; the controller writes nothing once
``fenced`` is set.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any

from checkpointing.errors import FencedError
from checkpointing.manager import group_rank_errors
from checkpointing.storage.retry import describe
from trainer.config import RunConfig
from trainer.config.load import config_from_dict
from trainer.parallel.dims import valid_world_sizes

from ..config import recovery_from_raw
from .drain import DrainWatch
from .health import FaultWatch
from .membership import Membership
from .observers import ControllerObserver, Goodput, LeaseKeeper, Observers
from .pending import PendingRecovery, PendingResize
from .options import ControllerOptions
from .run_policy import FailureLog, ScalingPolicy
from ..service.queueing import sharing
from .states import Failed, Initializing, Recovering, Scheduling, State
from .status import RunStatus
from ..store.run_store import RunSpec, RunStore, StoreUnavailable
from ..workers.group import GroupFailure, WorkerGroup, WorkerLost

log = logging.getLogger("etrain")


class Controller(Membership):
    """One run's controller; see the module docstring.

    ``group`` implements :class:`orchestrator.workers.group.WorkerGroup`;
    ``config`` is the run's parsed config (None: parsed from ``spec.config``, for
    a controller built by hand); ``clock`` and ``sleep`` are the controller's
    time (a fake clock in tests); ``observers`` are told what happens, after
    the run's own (lease, goodput, status); ``drains`` reads the cluster's
    draining nodes (``orchestrator.controller.drain``; none read without it).
    """

    def __init__(self, spec: RunSpec, store: RunStore, group: WorkerGroup, opts: ControllerOptions | None = None,
                 *, config: RunConfig | None = None, clock=time.monotonic, controller_id: str | None = None,
                 sleep=time.sleep, observers: Iterable[ControllerObserver] = (), drains: DrainWatch | None = None,
                 faults: FaultWatch | None = None):
        self.spec = spec
        self.run_id = spec.run_id
        self.store = store
        self.group = group
        self.opts = opts or ControllerOptions()
        self.clock = clock
        self.sleep = sleep
        self.controller_id = controller_id or f"ctl-{uuid.uuid4().hex[:8]}"
        # The driver parses the spec's config once and passes it; a controller built by hand parses it here.
        self.cfg = config if config is not None else config_from_dict(spec.config)
        self.recovery = recovery_from_raw(spec.config)  # the memory tier ([recovery])
        self.total_steps = self.cfg.train.steps
        self.scaling = ScalingPolicy(min_workers=spec.min_workers, max_workers=spec.max_workers)
        self.valid_sizes = tuple(valid_world_sizes(self.cfg, spec.max_workers))
        self.failures = FailureLog()
        self.drains = drains or DrainWatch()  # draining nodes the run shrinks off (none watched without a source)
        self.faults = faults or FaultWatch()  # [health]: a rank whose silent fault persists (evict or suspend)
        self.skipped_ranges: list[list[int]] = []  # [health]: samples skipped as the data's fault
        self.state: State = Initializing()
        self.lease = None
        self.fenced: str | None = None  # why this controller may no longer write (another one leads)
        self.epoch = 0
        # membership and the calls on it
        self.members: list[str] = []  # worker ids, by rank
        self.spares: list[str] = []  # started, not in the group (pending or ready)
        self.train_calls: dict[str, Any] = {}
        self.storage_faults: dict | None = None  # injected by `etrain chaos`, for every worker
        self.standby_ready = 0  # started workers outside the group that are up (read while RUNNING)
        self.next_grow_check = 0.0
        self.booting_since: float | None = None  # when spares were first seen booting (growth waits for them)
        self.resize_requested_at: float | None = None  # when a changed size request was first read
        self.next_spec_read = 0.0
        self.suspend_cause: str | None = None  # set by request_suspend (the driver got SIGTERM)
        # the queue: since when (controller clock) and why the run waits in QUEUED, and its waits so far
        self.queued_at: float | None = None
        self.queue_reason = ""
        self.queue_wait_s = 0.0
        # progress and durability
        self.progress: dict = {}
        self.progress_at = clock()
        self.step_times: deque[float] = deque(maxlen=50)
        self.committed_step: int | None = None
        self.saves_failed_in_a_row = 0  # checkpoint.max_consecutive_failures fails the run
        self.last_save_error = ""
        # a recovery or a resize under way, reported at the first step after it
        self.pending_recovery: PendingRecovery | None = None
        self.pending_resize: PendingResize | None = None
        self.form_phases: dict[str, float] = {}  # seconds of the last form(): process group + trainer, restore
        self.restored_tier = ""  # where the last form() restored from: memory, durable or none
        # what is told of it; the lease keeper first: it renews from the start and releases last
        self.lease_keeper = LeaseKeeper()
        self.goodput = Goodput()
        self.status = RunStatus()
        self.observers = Observers([self.lease_keeper, self.goodput, self.status, *observers])
        self.next_status = 0.0

    # --- the loop ------------------------------------------------------------------------

    def step(self) -> State:
        """One iteration: the current state's step, then the status write."""
        before = self.state
        try:
            nxt = before.step(self)
        except FencedError as e:
            nxt = Failed(f"fenced: {e}")
        except WorkerLost as e:
            nxt = Recovering.now(self, "actor_died", str(e))
        except GroupFailure as e:  # a group call (form, restore, save) failed where the state did not catch it
            nxt = Recovering.after(self, e)
        except StoreUnavailable as e:  # only from until_store, past its bound
            nxt = Failed(str(e))
        if not nxt.terminal:
            self.publish_throttled()
            if self.fenced is not None:  # another controller leads the run now: stop, change nothing
                nxt = Failed(f"fenced: {self.fenced}")
        if type(nxt) is not type(before):
            log.info("%s -> %s", before.name, nxt.name)
        self.state = nxt
        self.observers.on_state(self)
        if nxt.terminal:
            self.finish(nxt)
        return nxt

    def run(self) -> dict:
        while not self.state.terminal:
            self.step()
        return self.snapshot()

    def finish(self, state: State) -> None:
        if isinstance(state, Failed):
            self.event("failed", reason=state.reason, step=self.last_completed_step())
            try:
                self.group.shutdown()
            except Exception as e:  # the group may be half gone already
                log.debug("group shutdown: %s", e)
        self.observers.on_end(self, state)  # the final status, then the lease released

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
            if (spec.workers, spec.target) != (self.spec.workers, self.spec.target):
                # From the request itself by the requester's clock, so that resize_s includes the time to
                # notice it; bounded (never in the future, at most 10 s back) against clocks that disagree.
                waited = time.time() - spec.updated_unix if spec.updated_unix else 0.0
                self.resize_requested_at = now - min(max(0.0, waited), 10.0)
            self.spec = spec
            self.scaling = ScalingPolicy(min_workers=spec.min_workers, max_workers=spec.max_workers)
            self.valid_sizes = tuple(valid_world_sizes(self.cfg, spec.max_workers))
            self.next_grow_check = 0.0

    def queued(self, reason: str, since: float) -> None:
        """The run waits in QUEUED from ``since`` (its gang was not admitted at once, or it was requeued)."""
        self.queued_at, self.queue_reason = since, reason
        self.event("queued", workers=self.spec.min_workers, reason=reason)
        log.info("queued: waiting for %d workers together (%s)", self.spec.min_workers, reason)

    def admitted(self, since: float | None) -> State:
        """The gang holds its workers: on to SCHEDULING (``since``: when the run was queued, None: at once)."""
        if since is not None:
            wait = self.clock() - since
            self.queue_wait_s += wait
            self.event("admitted", wait_s=round(wait, 3), workers=self.spec.min_workers)
        self.queued_at, self.queue_reason = None, ""
        return Scheduling(self.desired(), "admitted")

    def queue_wait(self) -> float:
        """Seconds waited in QUEUED, the current wait included."""
        return self.queue_wait_s + (self.clock() - self.queued_at if self.queued_at is not None else 0.0)

    def take_lease(self) -> None:
        """Lead the run: its lease in the store, and the epoch the store is at."""
        self.lease = self.store.acquire(self.run_id, self.controller_id, ttl_s=self.opts.lease_ttl_s)
        self.epoch = self.store.current_epoch(self.run_id)

    def begin_recovery(self, record: PendingRecovery) -> None:
        """A recovery is under way; it is reported at the first step after it (``recovered``)."""
        self.pending_recovery = record

    def begin_resize(self, record: PendingResize, leaving: tuple[str, ...] = ()) -> None:
        """A resize re-formed the group (``leaving``: members that are gone, never spares); it is reported at
        the first step at the new size (``resized``)."""
        self.spares = [w for w in self.spares if w not in leaving]
        self.pending_resize = record

    def grow_check_in(self, seconds: float) -> None:
        """Look at starting missing workers again in ``seconds``."""
        self.next_grow_check = self.clock() + seconds

    def boot_wait(self, now: float) -> float:
        """Seconds the group has waited for booting spares (growth waits for them up to ``boot_timeout_s``)."""
        self.booting_since = self.booting_since if self.booting_since is not None else now
        return now - self.booting_since

    def boot_done(self) -> None:
        self.booting_since = None

    def count_standbys(self) -> None:
        """How many started workers outside the group are up (the status shows it)."""
        self.standby_ready = len(self.group.ready(self.spares, timeout=0)) if self.spares else 0

    def reached(self, step: int) -> None:
        """Every member trained to ``step`` (the step the status reports)."""
        self.progress["step"] = step

    def request_suspend(self, cause: str) -> None:
        """Suspend at the next step boundary, as a spec asking it would, naming ``cause`` (e.g. "SIGTERM")."""
        self.suspend_cause = cause

    def set_storage_faults(self, faults: dict | None) -> int:
        """Chaos: storage faults on every started worker, and on those started later."""
        self.storage_faults = faults
        wids = list(self.members) + list(self.spares)
        calls = [self.group.submit(w, "set_storage_faults", faults) for w in wids]
        self.group.wait(calls, timeout=10.0)
        self.event("chaos_storage", faults=faults)
        return len(wids)

    def set_health_faults(self, faults: list | None, rank: int) -> str | None:
        """Chaos: in-process faults (``[health] faults`` entries: bitflip, poison_batch) in the worker that is
        rank ``rank`` now; they stay with that worker (a bad device goes where its process goes). The worker's
        id, None when there is no such rank."""
        if not 0 <= rank < len(self.members):
            return None
        wid = self.members[rank]
        self.group.wait([self.group.submit(wid, "set_health_faults", faults)], timeout=10.0)
        self.event("chaos_health", faults=faults, rank=rank, worker=wid)
        return wid

    # --- group calls -----------------------------------------------------------------------

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

    def launch_training(self) -> None:
        self.train_calls = {w: self.group.submit(w, "train", self.total_steps) for w in self.members}
        self.progress_at = self.clock()

    def stop_at_boundary(self) -> None:
        """Ask every member to stop after the current step and wait until they all did."""
        if not self.train_calls:
            return
        for w in self.members:
            self.group.submit(w, "request_stop")
        results = self._collect(list(self.train_calls.values()), "train")
        self.train_calls = {}
        failed = [r for r in results.values() if r.failed]
        if failed:
            raise GroupFailure(failed[0].error, failed[0].kind)
        self.poll_progress()
        self.reached(max(r.step for r in results.values()))

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
        self.observers.on_save(self, {**results[self.members[0]], "status": "committed" if ok else "failed"})
        if ok:
            self.committed_step = self.last_completed_step()
            self.saves_failed_in_a_row, self.last_save_error = 0, ""
        else:
            bad = next(r for r in results.values() if r["status"] not in ("committed", "exists"))
            self.saves_failed_in_a_row += 1
            self.last_save_error = bad["error"]
            self.event("checkpoint_failed", step=self.last_completed_step(), error=bad["error"])
        return ok

    # --- progress --------------------------------------------------------------------------

    def poll_progress(self, timeout: float = 2.0) -> None:
        """Rank 0's last step (every rank reaches the same step boundary)."""
        if not self.members:
            return
        try:
            p = self.group.result(self.group.submit(self.members[0], "progress"), timeout=timeout)
        except (TimeoutError, WorkerLost):
            return
        self._absorb_saves(p.get("saves", []))
        self.observers.on_history(self, p.pop("history", None) or [])
        for e in p.pop("memory_tier", None) or []:  # the tier turned itself off (rank 0 tells)
            self.event("memory_tier", **e)
        for e in p.pop("health", None) or []:  # [health]: sdc verdicts, spikes, rollbacks (rank 0 tells)
            e = dict(e)
            if e.get("kind") == "sdc" and e.get("verdict") == "data" and e.get("samples"):
                self.skipped_ranges.append(list(e["samples"]))
            self.event(str(e.pop("kind", "health")), **e)
        if p.get("replayed") and p.get("time") != self.progress.get("time"):  # [health]: a rollback's replay
            self.progress_at = self.clock()  # behind the step seen, but alive: no hang
        if p.get("step") is not None and p.get("step", -1) > self.progress.get("step", -1):
            self.progress = p
            self.progress_at = self.clock()
            self.observers.on_step(self, p)
            self.step_times.append(p.get("step_seconds", 0.0))
            self._finish_pending(p)

    def _absorb_saves(self, saves: list[dict]) -> None:
        """Results of checkpoints as rank 0, the coordinator that commits them, reports them."""
        for s in saves:
            self.observers.on_save(self, s)
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

    def _finish_pending(self, p: dict) -> None:
        """The first step after a recovery or a resize completes it: tell how long it took and what it cost."""
        now = self.clock()
        if self.pending_recovery is not None:
            r, self.pending_recovery = self.pending_recovery, None
            fields = r.event(now=now, first_step_unix=p.get("time"))
            self.observers.on_recovery(self, now - r.detected_at, fields["steps_lost"])
            self.event("recovered", **fields)
        if self.pending_resize is not None:
            r, self.pending_resize = self.pending_resize, None
            self.resize_requested_at = None
            self.observers.on_resize(self)
            self.event("resized", **r.event(now=now, step=p.get("step"), first_step_unix=p.get("time")))

    def last_completed_step(self) -> int:
        return int(self.progress.get("step", 0) or 0)

    def hang_deadline(self) -> float:
        if self.opts.hang_timeout_s:
            return self.opts.hang_timeout_s
        typical = statistics.median(self.step_times) if self.step_times else 0.0
        return max(self.opts.hang_min_s, self.opts.hang_factor * typical)

    # --- what is told of the run -------------------------------------------------------------

    def event(self, kind: str, **fields) -> None:
        """A run event: kept for the driver and written to the run store (the status observer)."""
        self.observers.on_event(self, {"kind": kind, "time": time.time(), "epoch": self.epoch, **fields})

    def snapshot(self) -> dict:
        """The run's status: the controller's own figures and its observers' (counters, goodput, metrics)."""
        p = self.progress
        return {
            "run_id": self.run_id, "phase": self.state.name, "reason": getattr(self.state, "reason", ""),
            "world_size": len(self.members), "workers_requested": self.spec.workers, "step": self.last_completed_step(),
            "standby_ready": self.standby_ready,
            "total_steps": self.total_steps, "epoch": self.epoch, "loss": p.get("loss"), "lr": p.get("lr"),
            "eval_loss": p.get("eval_loss"), "eval_step": p.get("eval_step"),
            "verified_step": p.get("verified_step"), "skipped_ranges": self.skipped_ranges[-64:] or None,
            "tokens_per_s": p.get("tokens_per_s"), "latest_checkpoint": self.committed_step,
            "controller_id": self.controller_id, "failures": len(self.failures.records),
            "queue_reason": self.queue_reason, "queue_wait_s": round(self.queue_wait(), 3),
            "queued_unix": (time.time() - (self.clock() - self.queued_at)) if self.queued_at is not None else None,
            **sharing(self.spec),  # priority, team, owner, min..max, target, requeue: what `etrain queue` lists
            "metrics_url": None,  # where the run's metrics are served, when they are (the metrics observer)
            **self.observers.status_fields(self),
        }

    def publish_throttled(self) -> None:
        now = self.clock()
        if now >= self.next_status:
            self.next_status = now + self.opts.status_every_s
            self.publish()

    def publish(self) -> None:
        """Write the status (and the events and history not written yet) to the run store now."""
        self.status.publish(self)

    @property
    def _stop_keeper(self) -> threading.Event:
        """Set to end the lease keeper's thread (a test that drops a controller before it ends)."""
        return self.lease_keeper.stop
