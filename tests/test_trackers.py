"""Experiment trackers (``[logging]``): each real library writes locally and is read back.

TensorBoard event files through tensorboard's EventAccumulator, the W&B offline
run directory through its record log, MLflow's file store through MlflowClient.
No network: W&B runs offline.
"""

import glob
import json
import os
import struct
import subprocess
import sys
import types

# The tracker libraries are in the test extra (`make test` installs them): a missing one fails here, loudly.
import mlflow  # noqa: F401
import pytest
import tensorboard  # noqa: F401
import wandb  # noqa: F401

from checkpointing.errors import ConfigError
from orchestrator.observers import TrackerObserver
from tests.harness import ROOT
from trainer.config import LoggingConfig
from trainer.trackers import Tracker, Trackers


def wandb_records(path: str):
    """The records of a W&B ``run-*.wandb`` file: a 7-byte header, then leveldb-log blocks of 32 KiB."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def wandb_history(run_dir: str) -> list[dict]:
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in wandb_records(path) if r.WhichOneof("record_type") == "history"]


def test_every_tracker_logs_a_torchrun_run(tmp_path):
    """One process trains 4 steps (eval every 2) with all three trackers on; each holds loss, lr, throughput,
    eval loss and memory at their steps."""
    tb, wb, ml = tmp_path / "tb", tmp_path / "wandb", tmp_path / "mlruns"
    wb.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    sets = ["train.steps=4", "train.warmup_steps=1", "data.max_bytes=200000", "eval.every_steps=2",
            "eval.batches=1", "eval.val_fraction=0.1", "metrics.enabled=false", "run_id=tracked",
            f"logging.tensorboard_dir={tb}", "logging.wandb_project=etrain-test", f"logging.wandb_dir={wb}",
            f"logging.mlflow_uri=file://{ml}", "logging.experiment=tests"]
    r = subprocess.run([sys.executable, "-m", "trainer", "--config", "examples/tiny.toml", "--quiet",
                        *[a for s in sets for a in ("--set", s)]], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tracker" not in r.stderr, r.stderr  # none failed

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb / "tracked"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/step_seconds", "eval/loss",
            "memory/params_mib"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("eval/loss")] == [2, 4]
    assert all(e.value > 0 for e in acc.Scalars("train/tokens_per_s"))

    (run_dir,) = glob.glob(str(wb / "wandb" / "offline-run-*"))
    rows = wandb_history(run_dir)
    assert [row["train/step"] for row in rows] == [1, 2, 3, 4]
    assert all("train/loss" in row and "train/lr" in row for row in rows)
    assert [row["train/step"] for row in rows if "eval/loss" in row] == [2, 4]
    assert "memory/params_mib" in rows[0]

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file://{ml}")
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")] == [2, 4]
    assert len(client.get_metric_history(run.info.run_id, "train/tokens_per_s")) == 4


class Recorder(Tracker):
    name = "recorder"

    def __init__(self, fail_on: str = ""):
        self.steps, self.events, self.fail_on, self.closed = [], [], fail_on, False

    def log_step(self, step, values):
        if self.fail_on and self.fail_on in values:
            raise RuntimeError("disk full")
        self.steps.append((step, values))

    def log_event(self, step, kind, values, text):
        self.events.append((step, kind, values))

    def close(self):
        self.closed = True


def test_a_failing_tracker_is_disabled_once_and_the_others_go_on(caplog):
    bad, good = Recorder(fail_on="train/lr"), Recorder()
    t = Trackers([bad, good])
    t.log_step(1, {"train/loss": 2.0})
    t.log_step(2, {"train/loss": 1.9, "train/lr": 0.1})
    t.log_step(3, {"train/lr": 0.1})
    assert [s for s, _ in bad.steps] == [1] and [s for s, _ in good.steps] == [1, 2, 3]
    assert sum("disabled" in r.message for r in caplog.records) == 1
    t.close()
    assert good.closed and not bad.closed


def test_controller_feeds_history_steps_and_events():
    """Under Ray: every history row, the polled steps' lr/throughput/eval loss, and the run's events."""
    rec = Recorder()
    obs = TrackerObserver(Trackers([rec]))
    ctl = types.SimpleNamespace(status=types.SimpleNamespace(history=[[7, 2.0, 2, 84, 1.0, 0.1]]),
                                spec=types.SimpleNamespace(workers=3), last_completed_step=lambda: 7)
    obs.on_start(ctl)  # a controller on a run that has trained: a resume
    obs.on_history(ctl, [[8, 1.5, 3, 96, 2.0, 0.1], [9, 1.4, 3, 108, 2.1, 0.1]])
    obs.on_step(ctl, {"step": 9, "lr": 0.01, "tokens_per_s": 900.0, "eval_step": 8, "eval_loss": 1.6})
    obs.on_event(ctl, {"kind": "failure", "time": 1.0, "step": 9, "failure_kind": "worker_lost"})
    obs.on_event(ctl, {"kind": "recovered", "time": 2.0, "time_to_recover_s": 3.5, "steps_lost": 2})
    obs.on_event(ctl, {"kind": "formed", "time": 2.0})  # not a tracked event
    obs.on_event(ctl, {"kind": "resized", "time": 3.0, "step": 12, "from_workers": 3, "to_workers": 2})
    assert [(s, sorted(v)) for s, v in rec.steps] == [
        (8, ["train/loss", "train/step_seconds", "train/world_size"]),
        (9, ["train/loss", "train/step_seconds", "train/world_size"]),
        (8, ["eval/loss"]), (9, ["train/lr", "train/tokens_per_s"])]
    assert [(s, k) for s, k, _ in rec.events] == [(7, "resume"), (9, "failure"), (7, "recovery"), (12, "resize")]
    assert rec.events[2][2] == {"events/recovery": 1.0, "events/recovery/time_to_recover_s": 3.5,
                                "events/recovery/steps_lost": 2.0}
    obs.on_end(ctl, None)
    assert rec.closed


def test_a_tracker_without_its_library_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb_project is set but wandb is not installed.*etrain\[trackers\]"):
        LoggingConfig(wandb_project="p")
    LoggingConfig(tensorboard_dir="/tmp/tb")  # the others are there
    with pytest.raises(ConfigError, match="logging.wandb_mode"):
        LoggingConfig(wandb_mode="sometimes")


def test_controller_logs_a_failure_a_recovery_and_a_resize_to_tensorboard(tmp_path):
    """The controller (fake worker group, no Ray) with a real TensorBoard tracker: a worker dies at step 7,
    the run recovers from step 5, grows to 4 workers at step 12; each is in the event file at its step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from orchestrator.controller import Controller
    from orchestrator.observers import EvalEvents
    from orchestrator.store import RunSpec, open_store
    from tests.fake_group import FakeClock, FakeGroup, Fault
    from tests.test_controller import INTERVAL, RUN, options, run_config
    from trainer.config_load import config_from_dict
    from trainer.trackers import open_trackers

    raw = {**run_config(tmp_path), "logging": {"tensorboard_dir": str(tmp_path / "tb")}}
    clock, store = FakeClock(), open_store(f"file://{tmp_path}/runs")
    spec = RunSpec(run_id=RUN, config=raw, workers=2, min_workers=1, max_workers=4)
    store.create_run(spec)
    group = FakeGroup(clock, interval=INTERVAL, faults=[Fault(rank=1, step=7, kind="die")], step_seconds=0.1)
    cfg = config_from_dict(raw)
    ctl = Controller(spec, store, group, options(), config=cfg, clock=clock, controller_id="ctl-test",
                     sleep=clock.advance, observers=[EvalEvents(), TrackerObserver(open_trackers(cfg, RUN))])
    try:
        for _ in range(3000):
            if ctl.state.terminal:
                break
            if ctl.state.name == "RUNNING" and ctl.last_completed_step() >= 12 and spec.workers == 2:
                spec = store.update_spec(RUN, workers=4)
            ctl.step()
    finally:
        ctl._stop_keeper.set()
    assert ctl.state.name == "FINISHED"

    acc = EventAccumulator(str(tmp_path / "tb" / RUN))
    acc.Reload()
    steps = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert steps["events/failure"] == [7]
    assert len(steps["events/recovery"]) == 1 and steps["events/recovery/steps_lost"] == steps["events/recovery"]
    assert [e.value for e in acc.Scalars("events/recovery/steps_lost")] == [2.0]
    assert len(steps["events/resize"]) == 1 and steps["events/resize"][0] >= 12
    assert [e.value for e in acc.Scalars("events/resize/to_workers")] == [4.0]
    assert steps["events/finished"] == [20]
    assert steps["train/lr"] and max(steps["train/lr"]) == 20  # the polled steps
