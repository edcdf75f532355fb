"""``etrain resume --detach`` on a real Ray cluster: a run whose start failed goes on in the background.

The run is recorded by ``etrain run``, whose launch then fails before its controller ran (the cluster
could not be joined): it is marked FAILED (tests/orchestrator/test_start_failed.py). ``etrain resume RUN
--detach`` starts it from there, in the background, and returns once it resumed; ``etrain logs RUN -f``
follows its output to the end. The tiny model, a few steps, one worker.
"""

from __future__ import annotations

import time
import uuid

import pytest

from checkpointing.errors import EtrainError
from orchestrator.cli.main import main as etrain
from tests.cluster import RUN_BASE
from tests.harness import ROOT

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("by_token", [False, True], ids=["registry", "token"])
def test_a_run_whose_start_failed_resumes_in_the_background(ray_cluster, tmp_path, monkeypatch, capsys, by_token):
    """``by_token``: this user's registry no longer holds the run's token; ``--token`` hands it over."""
    import orchestrator.driver.run
    from orchestrator.store import user_runs as registry
    from orchestrator.store.run_store import open_store

    monkeypatch.chdir(ROOT)
    run_id, root = f"rd-{uuid.uuid4().hex[:6]}", f"file://{tmp_path}/runs"
    sets = [*RUN_BASE, "train.steps=6", f'checkpoint.url="{root}"']
    with monkeypatch.context() as m:  # the cluster cannot be joined when the run is launched
        def unreachable(address, num_cpus):
            raise EtrainError("cannot join the Ray cluster at 127.0.0.1:1: Failed to connect")

        m.setattr(orchestrator.driver.run, "connect", unreachable)
        assert etrain(["run", "examples/tiny.toml", *(a for s in sets for a in ("--set", s)), "--workers", "1",
                       "--store", root, "--run-id", run_id, "--no-progress"]) == 2
    store = open_store(root)
    assert store.get_status(run_id)["phase"] == "FAILED"
    capsys.readouterr()

    token = []
    if by_token:
        token = ["--token", registry.token_of(run_id)]
        registry.record(run_id, root)  # the entry without its token
        assert registry.token_of(run_id) is None

    started = time.monotonic()
    assert etrain(["resume", run_id, "--detach", "--address", ray_cluster.cluster.address, "--store", root,
                   *token]) == 0
    out = capsys.readouterr().out
    assert "runs in the background" in out and f"etrain logs {run_id} -f" in out, out
    deadline = started + 300
    while store.get_status(run_id)["phase"] not in ("FINISHED", "FAILED", "INTERRUPTED"):
        assert time.monotonic() < deadline, store.get_status(run_id)
        time.sleep(1)
    assert etrain(["logs", run_id, "-f"]) == 0  # returns once the detached driver ended
    log = capsys.readouterr().out
    assert f"--- etrain resume {run_id} --address" in log and "--no-progress" in log, log
    assert f"resuming run {run_id!r} on 1 workers" in log and f"run {run_id!r} FINISHED at step 6/6" in log, log
    assert not token or token[1] not in log, "the token was written into the run's log"  # it went in the env
    assert store.get_status(run_id)["phase"] == "FINISHED"
