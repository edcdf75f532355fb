"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, per ``[logging]`` (docs/metrics.md#trackers).

    trackers = open_trackers(cfg, cfg.run_id)          # the ones [logging] asks for; none is fine
    trackers.log_step(s.step, step_values(s))          # loss, lr, tokens/s, step seconds, eval loss
    trackers.log_event(step, "recovery", {"seconds": 4.2, "steps_lost": 3})
    trackers.close()

Each backend is one small class with ``start(cfg, run_id)``, ``log_step(step, values)``,
``log_event(step, kind, fields)`` and ``close()``; :class:`Trackers` drives them
all. A tracker never fails the run: the first error a backend raises is logged
once and that backend is disabled. Rank 0 feeds them under torchrun
(``trainer.cli``); on Ray the controller does (``orchestrator.observers.TrackerObserver``).

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
import time
from typing import Any

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
    """One backend. ``start`` may raise (the library or its destination is not usable); so may the others."""

    name = "tracker"

    def start(self, cfg, run_id: str) -> None:
        raise NotImplementedError

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


class Trackers:
    """Every started tracker as one; a tracker that raises is logged once and dropped, the run goes on."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers
        self.counts: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, what: str, call) -> None:
        for t in list(self.trackers):
            try:
                call(t)
            except Exception as e:  # a tracker never fails the run
                log.error("tracker %s failed to %s (%s: %s); it is disabled for the rest of the run",
                          t.name, what, type(e).__name__, e)
                self.trackers.remove(t)

    def log_step(self, step: int, values: dict[str, float]) -> None:
        if values:
            self._each("log", lambda t: t.log_step(step, values))

    def log_event(self, step: int, kind: str, fields: dict[str, Any]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        values = event_values(kind, self.counts[kind], fields)
        text = f"{kind} at step {step}: " + ", ".join(f"{k}={v}" for k, v in sorted(fields.items()))
        self._each("log", lambda t: t.log_event(step, kind, values, text))

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            try:
                t.close()
            except Exception as e:
                log.error("tracker %s failed to close (%s: %s)", t.name, type(e).__name__, e)


def open_trackers(cfg, run_id: str) -> Trackers:
    """Start the trackers ``cfg.logging`` asks for; one that cannot start is logged and left out."""
    started = []
    for t in wanted(cfg):
        try:
            t.start(cfg, run_id)
            started.append(t)
        except Exception as e:
            log.error("tracker %s did not start (%s: %s); the run goes on without it", t.name, type(e).__name__, e)
    return Trackers(started)
