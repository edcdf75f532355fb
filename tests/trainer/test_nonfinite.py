"""A step whose loss or gradient norm turns nan/inf: the run stops naming the step (``python -m trainer``
exit 1; under Ray FAILED at once, never retried), or with ``train.skip_nonfinite_steps`` the step's
update is skipped on every rank, counted and logged."""

from __future__ import annotations

import math

import pytest

from orchestrator.controller.run_policy import Fail, FailurePolicy, FailureRecord, FailureStatus
from tests.harness import run_ranks

BASE = ["data.max_bytes=20000", "data.seq_len=16", "train.global_batch=4", "train.micro_batch=2",
        "train.warmup_steps=1", "train.steps=10", "metrics.enabled=false"]
# AdamW at this rate throws the weights to ~1e29 in one step: the second step's values are not finite.
DIVERGE = ["train.lr=1e30", "train.steps=4"]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture
def train(monkeypatch):
    from trainer.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    return main


def test_a_diverged_run_exits_1_naming_the_step(train, tmp_path, capsys):
    log = tmp_path / "steps.jsonl"
    assert train(_sets(BASE + DIVERGE) + ["--log-file", str(log), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "at step 2" in err and "train.skip_nonfinite_steps" in err and "Traceback" not in err, err
    assert len(log.read_text().splitlines()) == 1  # step 1 trained; step 2 stopped the run before its update


def test_skip_nonfinite_steps_counts_and_warns(train, tmp_path, capsys):
    import json

    log = tmp_path / "steps.jsonl"
    assert train(_sets(BASE + DIVERGE + ["train.skip_nonfinite_steps=true"]) + ["--log-file", str(log),
                                                                                 "--quiet"]) == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["skipped_nonfinite"] for r in rows] == [0, 1, 2, 3]
    assert [r["samples_consumed"] for r in rows] == [4, 8, 12, 16]  # the cursor moves on past a skipped batch
    err = capsys.readouterr().err
    assert "at step 2: its update is skipped" in err and "at step 4" in err, err


def test_every_rank_skips_the_same_step_and_nothing_changes():
    """Rank 0 alone sees nan logits at step 2: both ranks skip that update (ZeRO-1 and FSDP), the weights
    and optimizer state stay bitwise as they were, and step 3 trains again; without the option both
    ranks stop at step 2."""
    layouts = [("zero1", ["parallel.zero_stage=1", "train.skip_nonfinite_steps=true"]),
               ("fsdp", ["parallel.zero_stage=3", "train.skip_nonfinite_steps=true"]),
               ("stop", ["parallel.zero_stage=1"])]
    res = run_ranks("tests.nonfinite_jobs:skip_or_stop", 2, {"base": BASE, "layouts": layouts}, timeout=300)
    for rank, r in enumerate(res):
        for name in ("zero1", "fsdp"):
            got = r[name]
            assert got["skipped"] == [0, 1, 1], (rank, name, got)
            assert math.isnan(got["losses"][1]) and math.isfinite(got["losses"][2]), (rank, name, got)
            assert got["unchanged"] and got["changed_next"] and got["finite_next"], (rank, name, got)
            assert got["step"] == 3 and got["samples_consumed"] == 12, (rank, name, got)
        assert r["stop"]["step"] == 1 and "at step 2" in r["stop"]["error"], (rank, r["stop"])


def test_a_nonfinite_failure_is_not_retried():
    from orchestrator.workers.results import failure_kind as _failure_kind
    from trainer.models.hf.hf_dir import NonFiniteWeights
    from trainer.loop import NonFiniteStep

    kind = _failure_kind(NonFiniteStep("the loss is nan and the gradient norm nan at step 7: ..."))
    assert kind == _failure_kind(NonFiniteWeights("model.init_from=...: tensor 'w' holds 1 non-finite value")) \
        == "nonfinite"
    record = FailureRecord(kind, 6, "ranks 0,1: NonFiniteStep: the loss is nan ... at step 7", 0.0)
    decision = FailurePolicy(max_failures=20).decide(FailureStatus((record,)), now=0.0)
    assert isinstance(decision, Fail) and "at step 7" in decision.reason and "not retried" in decision.reason


def test_skip_nonfinite_steps_leaves_the_config_hash_alone():
    from trainer.config.load import load_config

    assert load_config(None, BASE).config_hash() == \
        load_config(None, BASE + ["train.skip_nonfinite_steps=true"]).config_hash()


@pytest.mark.ray
def test_etrain_run_of_a_diverging_run_fails_at_once_naming_the_step(ray_cluster, tmp_path):
    from tests.cluster import start_run

    run, st = start_run(f"file://{tmp_path}/runs", "train.lr=1e30", workers=2)
    try:
        final = run.join()
    finally:
        run.close()
    assert final["phase"] == "FAILED", final
    assert "at step 2" in final["reason"] and "not retried" in final["reason"], final
    failures = [e for e in st.events(run.spec.run_id) if e["kind"] == "failure"]
    assert len(failures) == 1 and failures[0]["failure_kind"] == "nonfinite", failures
