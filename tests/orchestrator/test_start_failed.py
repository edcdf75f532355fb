"""A run whose start failed before its controller ever ran is marked FAILED, not left PENDING for ever.

``etrain run`` records a run, then launches its controller on Ray. When that launch fails first (the
cluster cannot be joined, a local Ray does not start), nothing would ever write the run's status: it
stayed PENDING, ``etrain run`` of it was refused, and nothing ended it. Here the launch's ``connect``
fails as an unreachable cluster does; `etrain resume` going on from there runs on Ray, in
tests/orchestrator/test_resume_detach.py.
"""

from __future__ import annotations

import pytest

from checkpointing.errors import EtrainError
from orchestrator.cli.main import main as etrain
from tests.cluster import RUN_BASE
from tests.harness import ROOT


@pytest.fixture
def unreachable(monkeypatch, tmp_path):
    """Ray that cannot be joined, as launch() meets it (a cluster that refuses, a local Ray that fails)."""
    import orchestrator.driver.run

    def connect(address, num_cpus):
        raise EtrainError("cannot join the Ray cluster at 127.0.0.1:1 (--address / $RAY_ADDRESS): Failed to connect")

    monkeypatch.setattr(orchestrator.driver.run, "connect", connect)
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(ROOT)
    return f"file://{tmp_path}/runs"


def test_a_start_that_fails_before_the_controller_ran_marks_the_run_failed(unreachable, capsys):
    from orchestrator.store.run_store import open_store

    argv = ["run", "examples/tiny.toml", *(a for o in RUN_BASE for a in ("--set", o)), "--set",
            f'checkpoint.url="{unreachable}"', "--store", unreachable, "--run-id", "sf", "--no-progress"]
    assert etrain(argv) == 2
    err = capsys.readouterr().err
    assert "cannot join the Ray cluster" in err and "recorded as FAILED before its first step" in err, err
    assert "`etrain resume sf` starts it" in err, err
    store = open_store(unreachable)
    status = store.get_status("sf")
    assert status["phase"] == "FAILED" and status["reason"].startswith("did not start: cannot join"), status
    assert "etrain resume sf" in status["reason"]
    assert [e["kind"] for e in store.events("sf")] == ["start_failed"]
    # The same `etrain run` again says how to go on; `etrain status` shows why it stopped.
    assert etrain(argv) == 2
    assert "`etrain resume sf`" in capsys.readouterr().err
    assert etrain(["status", "sf", "--store", unreachable]) == 0
    assert "did not start" in capsys.readouterr().out


def test_a_run_whose_controller_wrote_its_status_is_not_marked(tmp_path):
    from orchestrator.driver.run import mark_start_failed
    from orchestrator.store.run_store import RunSpec, open_store

    store = open_store(f"file://{tmp_path}/runs")
    store.create_run(RunSpec("r", {"run_id": "r"}, 1, 1, 1))
    lease = store.acquire("r", "ctl-1")
    store.put_status("r", {"run_id": "r", "phase": "RUNNING", "step": 3}, lease)
    assert mark_start_failed(store, "r", "boom") is None  # its controller ran: it is its to say
    assert store.get_status("r")["phase"] == "RUNNING" and store.events("r") == []
