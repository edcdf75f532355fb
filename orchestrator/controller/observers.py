"""What the controller tells the rest of etrain: one observer interface, as Ray Train's controller callbacks.

    class Printer(ControllerObserver):
        def on_recovery(self, ctl, seconds, steps_lost):
            print(f"recovered in {seconds:.1f} s, {steps_lost} steps lost")

    ctl = Controller(spec, store, group, opts, config=cfg, observers=[MetricsObserver(RunMetrics(run_id))])

The controller and its states announce what happened (a step, a save, a
failure, a recovery, ...) through :class:`Observers`, which calls every
observer in order. The run's own reporting is made of observers too: the
status, events and history in the run store (``orchestrator.controller.status.RunStatus``),
the goodput (:class:`Goodput`, effective training time), the leadership lease (:class:`LeaseKeeper`);
the Prometheus figures (:class:`MetricsObserver`) are one more, present only
when the run serves metrics.

Invariants:

* Every hook of :class:`ControllerObserver` is a no-op: an observer overrides
  only what it needs, and the controller never asks which observers it has.
* Observers read the controller; what they change on it is ``ctl.fenced``
  (this controller may no longer write) and its event log (``ctl.event``).
  Decisions stay with the states and the policies.
* Hooks run on the controller's thread, in the order the observers were
  given, except ``on_end``, which runs in reverse (the last one started ends
  first): the lease keeper, given first, renews the lease from the start and
  releases it only after the status has written the final status under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from trainer.observe.metrics import StepLedger, goodput_ratio

from ..phase import Phase
from .run_policy import FailureRecord
from ..store.run_store import HistoryRow, StoreUnavailable
from .protocols import RunView

if TYPE_CHECKING:
    from trainer.observe.metrics import RunMetrics
    from .states import State

log = logging.getLogger("etrain")


class ControllerObserver:
    """Hooks the controller calls; each one does nothing here. Subclass and override what you need."""

    def on_start(self, ctl: RunView) -> None:
        """This controller leads the run: it holds the lease and has read the epoch."""

    def on_event(self, ctl: RunView, event: dict) -> None:
        """A run event (``kind``, ``time``, ``epoch`` and its fields), for the run's event log."""

    def on_state(self, ctl: RunView) -> None:
        """After every iteration of the loop; ``ctl.state`` is the state it moved to (often the same)."""

    def on_poll(self, ctl: RunView) -> None:
        """RUNNING, once per poll while the members train (never waits)."""

    def on_history(self, ctl: RunView, rows: list[list]) -> None:
        """Rank 0's rows of the steps trained since the last poll (``RunStore.put_history`` rows)."""

    def on_step(self, ctl: RunView, progress: dict) -> None:
        """Rank 0 completed a new step; ``progress`` is its figures (``StepStats.to_dict()``)."""

    def on_save(self, ctl: RunView, result: dict) -> None:
        """A checkpoint ended: ``result["status"]`` is committed, exists, skipped or failed."""

    def on_formed(self, ctl: RunView) -> None:
        """A group of ``len(ctl.members)`` formed a new epoch and restored ``ctl.committed_step``."""

    def on_failure(self, ctl: RunView, failure: FailureRecord, detect_s: float) -> None:
        """A failure, ``detect_s`` after the last sign of progress; the failure policy decides next."""

    def on_recovery(self, ctl: RunView, seconds: float, steps_lost: int) -> None:
        """The first step after a recovery: it took ``seconds`` from detection and lost ``steps_lost``."""

    def on_resize(self, ctl: RunView) -> None:
        """The first step after a resize (no step is lost)."""

    def on_end(self, ctl: RunView, state: State) -> None:
        """The controller reached a terminal state; nothing is called after this (observers in reverse)."""

    def status_fields(self, ctl: RunView) -> dict[str, Any]:
        """Fields this observer adds to the run's status (``Controller.snapshot``)."""
        return {}


class Observers(ControllerObserver):
    """Several observers as one: every hook calls each of them, in order (``on_end`` in reverse)."""

    def __init__(self, observers: Iterable[ControllerObserver]):
        self.observers = list(observers)

    def _each(self, hook: str, *args) -> None:
        for o in self.observers:
            getattr(o, hook)(*args)

    def on_start(self, ctl):
        self._each("on_start", ctl)

    def on_event(self, ctl, event):
        self._each("on_event", ctl, event)

    def on_state(self, ctl):
        self._each("on_state", ctl)

    def on_poll(self, ctl):
        self._each("on_poll", ctl)

    def on_history(self, ctl, rows):
        self._each("on_history", ctl, rows)

    def on_step(self, ctl, progress):
        self._each("on_step", ctl, progress)

    def on_save(self, ctl, result):
        self._each("on_save", ctl, result)

    def on_formed(self, ctl):
        self._each("on_formed", ctl)

    def on_failure(self, ctl, failure, detect_s):
        self._each("on_failure", ctl, failure, detect_s)

    def on_recovery(self, ctl, seconds, steps_lost):
        self._each("on_recovery", ctl, seconds, steps_lost)

    def on_resize(self, ctl):
        self._each("on_resize", ctl)

    def on_end(self, ctl, state):
        for o in reversed(self.observers):
            o.on_end(ctl, state)

    def status_fields(self, ctl):
        out: dict[str, Any] = {}
        for o in self.observers:
            out.update(o.status_fields(ctl))
        return out


class Goodput(ControllerObserver):
    """The run's goodput: effective training time over wall time since the run started
    (``etrain_goodput_ratio``, Meta's ETTR, Google's ML goodput), and beside it the time of every step
    trained over the same wall time (``etrain_step_time_ratio``).

    The numerator is a :class:`trainer.observe.metrics.StepLedger` fed with rank 0's history (every step
    trained, in order) and with the step each new group restored (``on_formed``): steps trained
    after the last commit before a failure and rolled back by the restore leave it.

    Across controllers (``etrain resume``, or a controller taking over a run whose controller is
    gone) the figures go on from the run store: the history is replayed into the ledger, and the
    wall time goes on from the last status written (``wall_s`` at ``updated_unix``). The time
    between that status and this controller's start counts when the run was interrupted (its last
    status not terminal: a run meant to train that did not) and does not after SUSPENDED, FAILED or
    FINISHED (nobody meant it to train). Steps trained after the last history write of a controller
    that vanished are not in the store and count in neither numerator.
    """

    def __init__(self, clock=time.time):
        self.clock = clock
        self.started_unix = clock()  # when the run's first controller started
        self.since = self.started_unix  # when this controller started counting wall time
        self.wall_before_s = 0.0  # wall time counted by earlier controllers of the run
        self.ledger = StepLedger()

    def wall_s(self) -> float:
        return self.wall_before_s + max(0.0, self.clock() - self.since)

    def ratio(self) -> float:
        """``etrain_goodput_ratio``: effective training time over wall time since the start."""
        return goodput_ratio(self.ledger.effective_s, self.wall_s())

    def step_time_ratio(self) -> float:
        """``etrain_step_time_ratio``: every trained step's time (redone ones too) over the same wall time."""
        return goodput_ratio(self.ledger.step_time_s, self.wall_s())

    def on_start(self, ctl):
        try:
            previous = ctl.store.get_status(ctl.run_id)
            history = ctl.store.get_history(ctl.run_id) if previous else []
        except StoreUnavailable as e:  # the store answered the lease a moment ago; count from now
            log.warning("goodput counts from this controller's start: the run store is away (%s)", e)
            return
        self.resume(previous, history)

    def resume(self, previous: dict | None, history: list) -> None:
        """Go on from an earlier controller's last ``status`` and the run's ``history`` (none: a new run)."""
        if not previous:
            return
        self.on_history(None, history)
        now = self.since
        updated = _number(previous.get("updated_unix"))
        started = _number(previous.get("started_unix"))
        wall = _number(previous.get("wall_s"))
        if wall is None and updated is not None and started is not None:  # a status without wall_s
            wall = updated - started
        if wall is None:  # no earlier wall time known: count from now
            return
        self.wall_before_s = max(0.0, wall)
        if updated is not None and not Phase.of(previous).terminal:
            self.wall_before_s += max(0.0, now - updated)  # interrupted: the run was down until now
        self.started_unix = started if started is not None else now - self.wall_before_s

    def on_history(self, ctl, rows):
        for r in rows:  # in the order trained; a step trained again shows the rollback before it
            h = HistoryRow.of(r)
            self.ledger.trained(h.step, h.step_s)

    def on_formed(self, ctl):
        # The new group holds the step it restored (a resize: the step it stopped at, nothing lost).
        self.ledger.restored(ctl.last_completed_step())

    def status_fields(self, ctl):
        return {"started_unix": self.started_unix, "goodput": self.ratio(), "step_time_ratio": self.step_time_ratio(),
                "wall_s": self.wall_s(), "effective_s": self.ledger.effective_s,
                "step_time_s": self.ledger.step_time_s}


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class LeaseKeeper(ControllerObserver):
    """Renews the controller's leadership lease in the background; losing it ends the controller's writes.

    Renews every third of the TTL; after a failed renewal (the store away) it
    tries again each second, so that a short outage, whose failed request may
    itself take a client timeout, cannot outlast the lease between two tries.
    """

    def __init__(self):
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def on_start(self, ctl):
        self.thread = threading.Thread(target=self._keep, args=(ctl,), name="etrain-lease", daemon=True)
        self.thread.start()

    def _keep(self, ctl: RunView) -> None:
        ttl_s = ctl.opts.lease_ttl_s
        wait_s = ttl_s / 3
        while not self.stop.wait(wait_s):
            try:
                if not ctl.store.renew(ctl.lease):
                    log.error("lost the leadership of run %s; another controller leads it", ctl.run_id)
                    ctl.fenced = "lost the leadership lease; another controller may lead the run"
                    return
                wait_s = ttl_s / 3
            except StoreUnavailable as e:
                log.debug("lease not renewed (store away): %s", e)
                wait_s = min(1.0, ttl_s / 3)

    def on_end(self, ctl, state):
        self.stop.set()
        if ctl.lease is not None and ctl.fenced is None and not state.reason.startswith("fenced"):
            try:
                ctl.store.release(ctl.lease)
            except StoreUnavailable:
                pass


class MetricsObserver(ControllerObserver):
    """The run's Prometheus figures (``trainer.observe.metrics.RunMetrics``), and the members' telemetry
    collected for them every ``metrics.every_s``."""

    def __init__(self, metrics: RunMetrics, *, url: str | None = None, file_sd: str | None = None):
        self.metrics = metrics
        self.url = url  # where the endpoint serves them (announced in the events and the status)
        self.file_sd = file_sd  # its Prometheus target file
        self.calls: dict[str, Any] = {}  # telemetry asked of each member, not collected yet
        self.next_telemetry = 0.0

    def on_start(self, ctl):
        if self.url:
            ctl.event("metrics", url=self.url, file_sd=self.file_sd)

    def on_state(self, ctl):
        self.metrics.observe_run(world_size=len(ctl.members), epoch=ctl.epoch, phase=ctl.state.name,
                                 goodput=ctl.goodput.ratio(), step_time_ratio=ctl.goodput.step_time_ratio(),
                                 queue_wait_s=ctl.queue_wait())

    def on_poll(self, ctl):
        """Collect the members' telemetry asked for last time, ask again. Never waits: a member busy
        in a long step answers on a later poll."""
        done = ctl.group.wait(list(self.calls.values()), timeout=0) if self.calls else []
        for call in done:
            self.calls.pop(call.wid, None)
            try:
                t = ctl.group.result(call, timeout=0)
            except Exception as e:  # a worker that died is the failure path's business
                log.debug("telemetry of %s: %s", call.wid, e)
                continue
            if call.wid in ctl.members:
                self.metrics.observe_ranks(call.wid, {**t, "rank": ctl.members.index(call.wid)})
        now = ctl.clock()
        if now < self.next_telemetry:
            return
        self.next_telemetry = now + ctl.cfg.metrics.every_s
        for w in ctl.members:
            if w not in self.calls:
                self.calls[w] = ctl.group.submit(w, "telemetry")

    def on_step(self, ctl, progress):
        self.metrics.observe_step(progress)

    def on_save(self, ctl, result):
        self.metrics.observe_save(result)

    def on_formed(self, ctl):
        self.metrics.observe_commit(ctl.committed_step)
        self.metrics.forget_ranks_above(len(ctl.members))
        self.calls = {}

    def on_failure(self, ctl, failure, detect_s):
        self.metrics.observe_failure(failure.kind, detect_s)

    def on_recovery(self, ctl, seconds, steps_lost):
        self.metrics.observe_recovery(seconds, steps_lost)

    def on_event(self, ctl, event):
        if event["kind"] == "preempted":
            self.metrics.observe_preemption(event.get("action", ""), event.get("reason", ""))
        elif event["kind"] == "sdc":
            self.metrics.observe_health_event(event)

    def on_resize(self, ctl):
        self.metrics.observe_resize()

    def status_fields(self, ctl):
        return {"metrics_url": self.url}


class EvalEvents(ControllerObserver):
    """An ``eval`` event (``step``, ``loss``) for each held-out evaluation rank 0 reports, so that the run store
    keeps the eval loss beside the step history (``etrain plot``). Polled: two evaluations between two polls
    keep only the newer."""

    def __init__(self):
        self.last_step: int | None = None

    def on_step(self, ctl, progress):
        step, loss = progress.get("eval_step"), progress.get("eval_loss")
        if step is not None and loss is not None and step != self.last_step:
            self.last_step = step
            ctl.event("eval", step=step, loss=loss)


# Run events as the trackers name them (trainer.observe.trackers).
TRACKED_EVENTS = {"failure": "failure", "recovered": "recovery", "resized": "resize", "suspended": "suspend",
                  "checkpoint_failed": "checkpoint_failed", "finished": "finished", "failed": "failed"}


class TrackerObserver(ControllerObserver):
    """The run's experiment trackers (``trainer.observe.trackers``, per ``[logging]``) fed from the controller.

    Every step of rank 0's history gives loss, world size and step seconds; the steps the controller polls
    add lr, throughput and eval loss (steps between two polls have none of those); failures, recoveries,
    resizes, suspends and resumes (a controller starting on a run that has trained) are events at their step.
    Nothing here waits for a tracker (each has a thread and a bounded queue of its own); a change in a
    tracker's health (stalled, dropping records, recovered, disabled) becomes a ``tracker`` run event. The
    final flush waits at most ``flush_timeout_s``."""

    def __init__(self, trackers, flush_timeout_s: float = 5.0):
        self.trackers = trackers
        self.flush_timeout_s = flush_timeout_s
        self.eval_step: int | None = None

    def on_start(self, ctl):
        history = ctl.status.history  # a resumed run's steps so far (the status observer, called before)
        if history:
            self.trackers.log_event(HistoryRow.of(history[-1]).step, "resume", {"workers": ctl.spec.workers})

    def on_state(self, ctl):
        self._report(ctl, self.trackers.notices())

    @staticmethod
    def _report(ctl, notices) -> None:
        for n in notices:
            log.warning("%s", n.text())
            ctl.event("tracker", **n.fields())

    def on_history(self, ctl, rows):
        for r in rows:
            h = HistoryRow.of(r)
            self.trackers.log_step(h.step, {"train/loss": float(h.loss), "train/world_size": float(h.world_size),
                                            "train/step_seconds": float(h.step_s)})

    def on_step(self, ctl, progress):
        values = {k: float(progress[p]) for k, p in (("train/lr", "lr"), ("train/tokens_per_s", "tokens_per_s"))
                  if isinstance(progress.get(p), (int, float))}
        if progress.get("eval_loss") is not None and progress.get("eval_step") != self.eval_step:
            self.eval_step = progress.get("eval_step")
            self.trackers.log_step(int(self.eval_step or progress["step"]), {"eval/loss": float(progress["eval_loss"])})
        self.trackers.log_step(int(progress["step"]), values)

    def on_event(self, ctl, event):
        kind = TRACKED_EVENTS.get(event.get("kind"))
        if kind is None:
            return
        step = event.get("step") if isinstance(event.get("step"), int) else ctl.last_completed_step()
        self.trackers.log_event(step, kind, {k: v for k, v in event.items() if k not in ("kind", "time", "step")})

    def on_end(self, ctl, state):
        # Before the final status is written (observers end in reverse): its flush_timeout event goes with it.
        self._report(ctl, self.trackers.close(self.flush_timeout_s))
