"""Held-out evaluation ([eval]): the same batches at every world size, no effect on training, and
reported in the step log, on stdout and as a Prometheus series."""

from __future__ import annotations

import json

import pytest

from tests.harness import run_ranks
from tests.checkpointing.test_input_safety import run_module

BASE = ["data.max_bytes=600000", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
        "train.steps=4", "metrics.enabled=false"]
EVAL = ["eval.every_steps=2", "eval.batches=3", "eval.val_fraction=0.1"]


@pytest.fixture(scope="module")
def runs():
    payload = {"base": BASE, "runs": [("eval", EVAL), ("no_eval", ["eval.val_fraction=0.1"])]}
    w1 = run_ranks("tests.eval_jobs:train_with_eval", 1, payload)[0]
    w2 = run_ranks("tests.eval_jobs:train_with_eval", 2, {**payload, "runs": payload["runs"][:1] + [
        ("zero3", EVAL + ["parallel.zero_stage=3"]), ("tp2", EVAL + ["parallel.tp=2"]),
        ("pp2", EVAL + ["parallel.pp=2"])]})
    return w1, w2


def test_eval_runs_every_k_steps_and_at_the_end(runs):
    w1, _ = runs
    stats = w1["eval"]["stats"]
    assert [s["step"] for s in stats if s["eval_loss"] is not None] == [2, 4]
    assert all(s["eval_loss"] > 0 for s in stats if s["eval_loss"] is not None)
    # Evaluating again right after the last step gives the same number: fixed batches, eval mode.
    assert w1["eval"]["again"] == pytest.approx(stats[-1]["eval_loss"], rel=1e-6)
    # Whole documents are held out (a tenth of them; documents differ in size): none of it is trained on.
    assert 0 < w1["eval"]["val_tokens"] < w1["eval"]["train_tokens"] / 3


def test_eval_does_not_change_training(runs):
    w1, _ = runs
    assert [s["loss"] for s in w1["eval"]["stats"]] == [s["loss"] for s in w1["no_eval"]["stats"]]


@pytest.mark.parametrize("name", ["eval", "zero3", "tp2", "pp2"])
def test_eval_loss_is_the_same_at_every_world_size_and_layout(runs, name):
    w1, w2 = runs
    ref = [s["eval_loss"] for s in w1["eval"]["stats"] if s["eval_loss"] is not None]
    for rank in w2:
        got = [s["eval_loss"] for s in rank[name]["stats"] if s["eval_loss"] is not None]
        assert got == pytest.approx(ref, rel=1e-4), name


def test_eval_loss_in_the_step_log_and_on_stdout(tmp_path):
    log = tmp_path / "steps.jsonl"
    args = []
    for o in BASE + EVAL:
        args += ["--set", o]
    r = run_module("trainer", args + ["--log-file", str(log)], env={"WORLD_SIZE": "1"})
    assert r.returncode == 0, r.stderr
    assert "eval at step 2: loss" in r.stdout and "eval at step 4: loss" in r.stdout
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["eval_loss"] is not None for r in rows] == [False, True, False, True]


def test_eval_loss_is_a_prometheus_series():
    from prometheus_client import CollectorRegistry, generate_latest

    from trainer.observe.metrics import RunMetrics

    m = RunMetrics("r")
    registry = CollectorRegistry()
    registry.register(m)
    m.observe_step({"step": 1, "loss": 3.0, "eval_loss": None})
    assert 'etrain_eval_loss{run_id="r"}' not in generate_latest(registry).decode()
    m.observe_step({"step": 2, "loss": 2.9, "eval_loss": 2.5})
    m.observe_step({"step": 3, "loss": 2.8, "eval_loss": None})  # the newest evaluation stays in view
    assert 'etrain_eval_loss{run_id="r"} 2.5' in generate_latest(registry).decode()


def test_eval_without_a_split_is_refused():
    r = run_module("trainer", ["--set", "eval.every_steps=5"])
    assert r.returncode == 2 and "needs a validation split" in r.stderr
