"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, per ``[logging]`` (docs/metrics.md#trackers).

    trackers = open_trackers(cfg, cfg.run_id)          # the ones [logging] asks for; none is fine; never waits
    trackers.log_step(s.step, step_values(s))          # loss, lr, tokens/s, step seconds, eval loss
    trackers.log_event(step, "recovery", {"seconds": 4.2, "steps_lost": 3})
    for n in trackers.notices(): ...                   # a tracker stalled, dropping records, recovered, disabled
    trackers.close(timeout_s=cfg.logging.flush_timeout_s)   # the final flush, bounded

Each backend is one small class with ``start(cfg, run_id)``, ``log_step(step, values)``,
``log_event(step, kind, fields)`` and ``close()``; :class:`Trackers` drives them
all. A tracker never fails the run, and never delays it: each backend runs on a
thread of its own behind a bounded queue (:class:`TrackerThread`), started there
too, so a tracker server that stops answering (MLflow's client waits 120 s a
request and retries 7 times) stalls only its own thread. When its queue is full
the newest records are dropped and counted; the caller learns it through
:meth:`Trackers.notices` (``stalled``, ``dropping``, ``recovered``, ``disabled``,
``flush_timeout``), which the trainer prints and the controller turns into run
events. The first error a backend raises is logged once and that backend is
disabled. Rank 0 feeds them under torchrun (``trainer.cli``); on Ray the
controller does (``orchestrator.controller.observers.TrackerObserver``). Messages never
show a tracker URI's password or query (``checkpointing.names.redact_text``).

Names: ``train/loss``, ``train/lr``, ``train/tokens_per_s``, ``train/step_seconds``,
``train/world_size``, ``eval/loss``, ``memory/<part>_mib``; an event of kind K
counts in ``events/K`` (1, 2, ... at its step) and its numeric fields go to
``events/K/<field>``. A step redone after a restore is logged again at the same
step (W&B plots against ``train/step``, so that its own step counter may only grow).
The libraries are imported only when their tracker starts.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from checkpointing.names import redact_text

log = logging.getLogger("etrain")


def step_values(stats) -> dict[str, float]:
    """What a tracker logs of one ``StepStats`` (or its ``to_dict()``): eval loss only on the steps that evaluate."""
    d = stats if isinstance(stats, dict) else stats.to_dict()
    out = {"train/loss": d.get("loss"), "train/lr": d.get("lr"), "train/tokens_per_s": d.get("tokens_per_s"),
           "train/step_seconds": d.get("step_seconds"), "train/world_size": d.get("world_size")}
    if d.get("eval_loss") is not None:
        out["eval/loss"] = d["eval_loss"]
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def memory_values(measured: dict[str, int]) -> dict[str, float]:
    """The bytes of one rank's parameters, gradients and optimizer state, in MiB."""
    return {f"memory/{k}_mib": v / 2**20 for k, v in measured.items() if isinstance(v, (int, float))}


def event_values(kind: str, count: int, fields: dict[str, Any]) -> dict[str, float]:
    """An event as metrics: its running count and its numeric fields."""
    out = {f"events/{kind}": float(count)}
    for k, v in fields.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"events/{kind}/{k}"] = float(v)
    return out


class Tracker:
    """One backend. ``start`` may raise (the library or its destination is not usable); so may the others.
    Every call runs on the tracker's own thread (:class:`TrackerThread`), in order."""

    name = "tracker"

    def start(self, cfg, run_id: str) -> None:
        """Open the destination (called first, on the tracker's thread)."""

    def log_step(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def log_event(self, step: int, kind: str, values: dict[str, float], text: str) -> None:
        self.log_step(step, values)

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    """Event files under ``logging.tensorboard_dir/<run_id>`` (``tensorboard --logdir DIR``)."""

    name = "tensorboard"

    def start(self, cfg, run_id):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(cfg.logging.tensorboard_dir, run_id), flush_secs=10)
        self.writer.add_text("config", f"run {run_id}, config hash {cfg.config_hash()}", 0)

    def log_step(self, step, values):
        now = time.time()
        for k, v in values.items():
            self.writer.add_scalar(k, v, step, walltime=now)

    def log_event(self, step, kind, values, text):
        self.log_step(step, values)
        self.writer.add_text(f"events/{kind}", text, step)

    def close(self):
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run in ``logging.wandb_project``; ``wandb_mode="offline"`` writes only its local run directory
    (``wandb sync`` uploads it later)."""

    name = "wandb"

    def start(self, cfg, run_id):
        import wandb

        lc = cfg.logging
        self.run = wandb.init(project=lc.wandb_project, name=run_id, mode=lc.wandb_mode,
                              dir=lc.wandb_dir or None, config=cfg.to_dict(), reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        self.run.define_metric("train/step")
        self.run.define_metric("*", step_metric="train/step")

    def log_step(self, step, values):
        self.run.log({"train/step": step, **values})

    def log_event(self, step, kind, values, text):
        self.run.log({"train/step": step, **values})

    def close(self):
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run named after the run in ``logging.experiment`` (default "etrain") at ``logging.mlflow_uri``."""

    name = "mlflow"

    def start(self, cfg, run_id):
        lc = cfg.logging
        if lc.mlflow_uri.startswith("file:") or "://" not in lc.mlflow_uri:
            # MLflow 3 refuses its file store unless asked: the user asked, by naming one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=lc.mlflow_uri)
        name = lc.experiment or "etrain"
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_id, tags={"etrain.run_id": run_id}).info.run_id
        self.client.log_param(self.run_id, "config_hash", cfg.config_hash())

    def log_step(self, step, values):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_event(self, step, kind, values, text):
        self.log_step(step, values)
        self.client.set_tag(self.run_id, f"event.{kind}.{int(values.get(f'events/{kind}', 0))}", text[:5000])

    def close(self):
        self.client.set_terminated(self.run_id)


def wanted(cfg) -> list[Tracker]:
    """The trackers ``[logging]`` asks for, not started."""
    lc = cfg.logging
    return ([TensorBoardTracker()] if lc.tensorboard_dir else []) + ([WandbTracker()] if lc.wandb_project else []) \
        + ([MlflowTracker()] if lc.mlflow_uri else [])


# Records a tracker's queue holds before it drops the newest; about 10 minutes of a run's records at a step
# a second, in a few MB.
QUEUE_RECORDS = 2000
# A call that has not returned after this long is reported as stalled (once, until it returns).
STALL_S = 10.0


@dataclass(frozen=True)
class TrackerNotice:
    """A change in one tracker's health, for the run's output and events.

    ``state``: ``stalled`` (a call has not returned for ``seconds``), ``dropping`` (its queue is full:
    records are dropped from now on), ``recovered`` (calls return again and the queue has room;
    ``dropped`` records were lost meanwhile), ``disabled`` (it raised; ``reason``) or
    ``flush_timeout`` (the final flush did not finish in time; ``pending`` records unsent)."""

    tracker: str
    state: str
    dropped: int = 0
    pending: int = 0
    seconds: float = 0.0
    reason: str = ""

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in ("", 0, 0.0) or k in ("tracker", "state")}

    def text(self) -> str:
        what = {"stalled": f"has not answered for {self.seconds:.0f} s; its records queue",
                "dropping": "is not keeping up: its queue is full and new records are dropped",
                "recovered": f"answers again ({self.dropped} records were dropped meanwhile)",
                "disabled": f"failed ({self.reason}); it is disabled for the rest of the run",
                "flush_timeout": f"did not flush in time: {self.pending} queued records were not sent"
                                 + (f" ({self.dropped} dropped before)" if self.dropped else "")}
        return f"tracker {self.tracker} {what.get(self.state, self.state)}"


_CLOSE = ("close", ())


class TrackerThread:
    """One tracker on a thread of its own, fed through a bounded queue: the caller never waits for it.

    The thread starts the tracker, then makes its calls in order. ``submit`` drops the record when
    the queue is full (counted); a tracker that raises is disabled and its queue discarded."""

    def __init__(self, tracker: Tracker, cfg, run_id: str, notify, *, queue_records: int = QUEUE_RECORDS,
                 stall_s: float = STALL_S, clock=time.monotonic):
        self.tracker, self.name, self.notify = tracker, tracker.name, notify
        self.queue: queue.Queue = queue.Queue(maxsize=queue_records)
        self.stall_s, self.clock = stall_s, clock
        self.dropped = 0  # records dropped since the tracker last kept up
        self.dropping = self.stalled = self.disabled = False
        self.busy_since: float | None = None  # when the call in progress began
        self.lock = threading.Lock()
        self.queue.put(("start", (cfg, run_id)))
        self.thread = threading.Thread(target=self._run, name=f"etrain-tracker-{self.name}", daemon=True)
        self.thread.start()

    def submit(self, what: str, *args) -> None:
        if self.disabled:
            return
        try:
            self.queue.put_nowait((what, args))
        except queue.Full:
            with self.lock:
                self.dropped += 1
                first = not self.dropping
                self.dropping = True
            if first:
                self.notify(TrackerNotice(self.name, "dropping"))

    def check_stall(self) -> None:
        """Report a call that has not returned for ``stall_s`` (once per stall); the caller's thread."""
        busy = self.busy_since
        if busy is not None and not self.stalled and not self.disabled and self.clock() - busy >= self.stall_s:
            self.stalled = True
            self.notify(TrackerNotice(self.name, "stalled", seconds=round(self.clock() - busy, 1)))

    def _run(self) -> None:
        while True:
            what, args = self.queue.get()
            self.busy_since = self.clock()
            try:
                getattr(self.tracker, what)(*args)
            except Exception as e:  # a tracker never fails the run
                self._disable(what, e)
                return
            finally:
                self.busy_since = None
            if what == "close":
                return
            self._maybe_recovered()

    def _maybe_recovered(self) -> None:
        with self.lock:
            if not (self.stalled or self.dropping) or (self.dropping and self.queue.qsize() > self.queue.maxsize // 2):
                return
            dropped, self.dropped, self.dropping, self.stalled = self.dropped, 0, False, False
        self.notify(TrackerNotice(self.name, "recovered", dropped=dropped))

    def _disable(self, what: str, e: Exception) -> None:
        self.disabled = True
        reason = redact_text(f"{type(e).__name__}: {e}")[:500]
        log.error("tracker %s failed to %s (%s); it is disabled for the rest of the run", self.name, what, reason)
        self.notify(TrackerNotice(self.name, "disabled", reason=f"{what}: {reason}"))
        while True:  # what it queued will not be sent
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break

    def begin_close(self) -> None:
        """Ask the thread to send what it queued, then close the tracker; returns at once."""
        if self.disabled:
            return
        try:
            self.queue.put_nowait(_CLOSE)
        except queue.Full:  # make room for the close: the newest record goes
            try:
                self.queue.get_nowait()
                with self.lock:
                    self.dropped += 1
            except queue.Empty:
                pass
            self.queue.put_nowait(_CLOSE)

    def wait_closed(self, deadline: float) -> bool:
        """Wait for the close until ``deadline`` (``clock`` time); False, and a notice, if it did not end."""
        self.thread.join(max(0.0, deadline - self.clock()))
        if self.thread.is_alive():
            pending = max(0, self.queue.qsize() - 1)  # records, not the close queued behind them
            self.notify(TrackerNotice(self.name, "flush_timeout", pending=pending, dropped=self.dropped))
            return False
        return True


class Trackers:
    """Every started tracker as one, each on a thread of its own (:class:`TrackerThread`); no call waits.

    A tracker that raises is logged once and dropped, the run goes on."""

    def __init__(self, trackers: list[Tracker], cfg=None, run_id: str = "", *, queue_records: int = QUEUE_RECORDS,
                 stall_s: float = STALL_S):
        self._notices: list[TrackerNotice] = []
        self._lock = threading.Lock()
        self.threads = [TrackerThread(t, cfg, run_id, self._notify, queue_records=queue_records, stall_s=stall_s)
                        for t in trackers]
        self.counts: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.threads)

    def _notify(self, notice: TrackerNotice) -> None:
        with self._lock:
            self._notices.append(notice)

    def notices(self) -> list[TrackerNotice]:
        """What changed in the trackers' health since the last call (stalls checked now); each once."""
        for t in self.threads:
            t.check_stall()
        with self._lock:
            out, self._notices = self._notices, []
        return out

    def log_step(self, step: int, values: dict[str, float]) -> None:
        if values:
            for t in self.threads:
                t.submit("log_step", step, values)

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        values = event_values(kind, self.counts[kind], fields)
        text = f"{kind} at step {step}: " + ", ".join(f"{k}={v}" for k, v in sorted(fields.items()))
        for t in self.threads:
            t.submit("log_event", step, kind, values, text)

    def begin_close(self) -> None:
        """Every tracker sends what it queued and closes, on its thread; returns at once."""
        for t in self.threads:
            t.begin_close()

    def wait_closed(self, timeout_s: float) -> list[TrackerNotice]:
        """Wait at most ``timeout_s`` in all for the closes; a tracker still busy then is left behind (its
        thread is a daemon) and reported. Returns the notices not yet taken."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.wait_closed(deadline)
        self.threads = []
        return self.notices()

    def close(self, timeout_s: float = 5.0) -> list[TrackerNotice]:
        """The final flush, bounded by ``timeout_s`` (``[logging] flush_timeout_s``)."""
        self.begin_close()
        return self.wait_closed(timeout_s)


def open_trackers(cfg, run_id: str) -> Trackers:
    """The trackers ``cfg.logging`` asks for, each starting on its own thread: returns at once. One that
    cannot start is reported (a ``disabled`` notice) and left out; the run goes on without it."""
    return Trackers(wanted(cfg), cfg, run_id)
