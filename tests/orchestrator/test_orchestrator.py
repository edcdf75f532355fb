"""Runs on a real multi-node Ray cluster on 127.0.0.1: recovery, resize, suspend/resume, growth, etcd outage.

One cluster for the session (a head with no CPUs and three 1-CPU nodes, each
its own raylet, shared with tests/orchestrator/test_chaos.py) and one failure-free
reference run (tests/conftest.py). Workers are real ``TrainWorker`` actors
training the tiny model over gloo; they are killed with SIGKILL, nodes are added and removed, and
the etcd server is stopped and started. The CLI is called as a user calls
it (``orchestrator.cli.main.main``), against the same run store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from checkpointing.manager import CheckpointManager
from orchestrator.cli.main import main as etrain
from orchestrator.driver.run import prepare_resume
from orchestrator.store.run_store import open_store
from tests.cluster import GLOBAL_BATCH, STEPS, follow, start_run
from tests.cluster import RUN_BASE as BASE

pytestmark = pytest.mark.ray


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture
def root(tmp_path):
    return f"file://{tmp_path}/runs"


start = start_run


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = etrain(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def final_manifest(root: str, run_id: str):
    mgr = CheckpointManager(f"{root}", run_id)
    return mgr.read_manifest(mgr.latest_committed())


def assert_finished(final: dict, run_id: str, root: str) -> None:
    assert final["phase"] == "FINISHED", final
    assert final["step"] == STEPS
    # The data cursor of the last commit: every sample of every step exactly once, in order.
    assert final_manifest(root, run_id).trainer_state["samples_consumed"] == STEPS * GLOBAL_BATCH


def test_clean_run_reports_through_the_cli(reference, capsys):
    assert_finished(reference["final"], "reference", reference["root"])
    code, out, _ = cli(capsys, "status", "reference", "--json", "--store", reference["root"])
    assert code == 0
    st = json.loads(out)
    assert st["phase"] == "FINISHED" and st["step"] == STEPS and st["latest_checkpoint"] == STEPS
    assert st["recoveries"] == 0 and st["steps_lost"] == 0
    code, out, _ = cli(capsys, "events", "reference", "--store", reference["root"])
    assert code == 0 and "[started]" in out and "[formed]" in out and "[finished]" in out


def test_killed_worker_recovers_in_place_and_matches_the_failure_free_run(cluster, root, reference, capsys,
                                                                         prometheus):
    # A warm spare takes the dead worker's place at once. A real Prometheus discovers the run's
    # endpoint through its target file and scrapes it throughout.
    run, store = start(root, "elastic.standby=1", f'metrics.file_sd_dir="{prometheus.targets_dir}"')
    before = run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 10 and s["latest_checkpoint"], what="step 10")
    code, out, _ = cli(capsys, "top", before["run_id"], "--once", "--interval", "0.3", "--store", root)
    assert code == 0 and "all_gather" in out and "dp_shard" in out and "RUNNING" in out, out
    formed = run.events("formed")[0]
    survivor_pid, victim_pid = formed["pids"]
    os.kill(victim_pid, signal.SIGKILL)
    rec = run.wait_event("recovered")
    final = run.join()
    assert_finished(final, final["run_id"], root)
    assert final["recoveries"] == 1 and final["failures"] == 1
    assert rec["world_before"] == 2 and rec["world_after"] == 2
    # From the memory tier (the survivor's own snapshot and the copy of the dead rank's it held):
    # at most the step in flight is lost, and never an older step than the newest commit.
    assert rec["tier"] == "memory", rec
    assert rec["restored_step"] >= before["latest_checkpoint"]
    events = store.events(final["run_id"])
    failure = next(e for e in events if e["kind"] == "failure")
    assert failure["failure_kind"] == "actor_died" and "rank 1" in failure["message"]
    assert rec["steps_lost"] <= 1 and rec["restored_step"] >= failure["step"] - 1
    assert rec["time_to_recover_s"] > 0
    reformed = [e for e in events if e["kind"] == "formed"][1]
    assert reformed["pids"][0] == survivor_pid  # the survivor kept its process
    assert victim_pid not in reformed["pids"]
    # Same world size, restored from a checkpoint: the same computation as the run that never failed.
    assert final["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    code, out, _ = cli(capsys, "events", final["run_id"], "--store", root)
    assert "[failure]" in out and "[recovered]" in out and "[metrics]" in out
    assert final["metrics_url"].startswith("http://127.0.0.1:")
    assert_prometheus_saw(prometheus, final["run_id"], failures=1)


def assert_prometheus_saw(prom, run_id: str, failures: int) -> None:
    """What Prometheus scraped from the run, asked through its HTTP API after the run ended."""
    sel = f'run_id="{run_id}"'

    def values(promql: str) -> list[float]:
        return [float(r["value"][1]) for r in prom.query(promql)]

    def over_run(promql: str) -> list[float]:  # the run's samples are at most minutes old
        deadline = time.monotonic() + 20  # a scrape may still be being ingested
        while True:
            got = values(promql)
            if got or time.monotonic() > deadline:
                return got
            time.sleep(1)

    assert over_run(f"count_over_time(etrain_steps_total{{{sel}}}[10m]) >= 3"), "fewer than 3 scrapes"
    assert over_run(f"max_over_time(etrain_steps_total{{{sel}}}[10m]) - min_over_time(etrain_steps_total{{{sel}}}[10m]) > 5")
    grown = over_run(f'max_over_time(etrain_comm_bytes_total{{{sel},kind="all_gather"}}[10m]) '
                     f'- min_over_time(etrain_comm_bytes_total{{{sel},kind="all_gather"}}[10m]) > 0')
    assert grown, "all-gather bytes never grew between scrapes"
    params = over_run(f'max_over_time(etrain_memory_bytes{{{sel},kind="params"}}[10m])')
    assert len(params) >= 2 and all(v > 0 for v in params), params
    assert all(v > 0 for v in over_run(f'max_over_time(etrain_memory_bytes{{{sel},kind="rss"}}[10m])'))
    assert over_run(f"max_over_time(etrain_failures_total{{{sel}}}[10m])") == [float(failures)]
    assert over_run(f"max_over_time(etrain_recoveries_total{{{sel}}}[10m])") == [float(failures)]
    assert over_run(f"max_over_time(etrain_time_to_recover_seconds_count{{{sel}}}[10m])") == [float(failures)]
    assert over_run(f"max_over_time(etrain_time_to_recover_seconds_sum{{{sel}}}[10m])")[0] > 0
    # The memory tier's host bytes, per rank: its snapshots and the copy of its peer's.
    tier = over_run(f"max_over_time(etrain_recovery_tier_bytes{{{sel}}}[10m])")
    assert len(tier) >= 2 and all(v > 0 for v in tier), tier


def test_resize_up_and_down_at_step_boundaries_loses_no_step(cluster, root, reference, capsys):
    run, store = start(root, "elastic.standby=1", max_workers=3)
    run_id = run.spec.run_id
    run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 4, what="step 4")
    code, out, _ = cli(capsys, "resize", run_id, "--workers", "3", "--store", root)
    assert code == 0 and "2 -> 3" in out
    up = run.wait_event("resized", 1)
    assert (up["from_workers"], up["to_workers"]) == (2, 3)
    run.wait(lambda s: s["world_size"] == 3 and s["step"] >= up["step"] + 2, what="steps at 3 workers")
    code, _, _ = cli(capsys, "resize", run_id, "--workers", "2", "--store", root)
    assert code == 0
    down = run.wait_event("resized", 2)
    assert (down["from_workers"], down["to_workers"]) == (3, 2)
    final = run.join()
    assert_finished(final, run_id, root)
    assert final["steps_lost"] == 0 and final["recoveries"] == 0 and final["resizes"] == 2
    # Different world sizes reduce in a different order: equal up to float rounding.
    assert final["loss"] == pytest.approx(reference["loss"], rel=1e-4)


def test_resize_to_an_invalid_size_names_the_valid_ones(cluster, root, capsys):
    run, _ = start(root, "train.steps=400", max_workers=3)
    run.wait(lambda s: s["phase"] == "RUNNING", what="RUNNING")
    code, _, err = cli(capsys, "resize", run.spec.run_id, "--workers", "5", "--store", root)
    assert code == 2 and "--workers 5 is not a valid size" in err and "[1, 2, 3, 4]" in err  # up to 5: max raised
    # A second `etrain run` of the live run id is refused, naming what to do.
    code, _, err = cli(capsys, "run", "examples/tiny.toml", "--run-id", run.spec.run_id, "--store", root,
                       "--set", f'checkpoint.url="{root}"')
    assert code == 2 and "its controller is alive" in err
    assert cli(capsys, "stop", run.spec.run_id, "--store", root)[0] == 0
    final = run.join()
    assert final["phase"] == "FINISHED" and final["step"] < 400


def test_suspend_releases_every_actor_and_resume_continues_on_another_size(cluster, root, reference, capsys):
    from ray.util.state import list_actors, list_placement_groups

    run, _ = start(root, max_workers=3)
    run_id = run.spec.run_id
    run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 6, what="step 6")
    code, out, _ = cli(capsys, "suspend", run_id, "--store", root, "--timeout", "120")
    assert code == 0 and "SUSPENDED" in out
    final = run.join()
    assert final["phase"] == "SUSPENDED"
    suspended_at = final["step"]
    assert final_manifest(root, run_id).step == suspended_at  # committed at the boundary
    alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if (a.name or "").startswith("etrain-")]
    assert alive == []
    pgs = [p for p in list_placement_groups() if p.name.startswith(f"etrain-{run_id}") and p.state != "REMOVED"]
    assert pgs == []
    code, _, err = cli(capsys, "suspend", run_id, "--store", root)
    assert code == 2 and "already suspended" in err
    spec, store = prepare_resume(run_id, root, workers=3)
    resumed = follow(spec, store)
    formed = resumed.wait_event("formed")
    assert formed["world_size"] == 3 and formed["restored_from"] == suspended_at and formed["step"] == suspended_at
    final = resumed.join()
    assert_finished(final, run_id, root)
    assert final["loss"] == pytest.approx(reference["loss"], rel=1e-4)


def test_group_grows_when_a_node_joins_and_shrinks_when_it_leaves(cluster, root):
    # 3 CPUs in the cluster, 4 workers asked for: it starts at 3, grows when a 1-CPU node joins.
    run, _ = start(root, "train.steps=400", "elastic.replace_wait_s=2", workers=4, min_workers=2)
    run.wait(lambda s: s["phase"] == "RUNNING" and s["world_size"] == 3, what="running at 3 workers")
    node = cluster.add_node(1)
    try:
        grown = run.wait_event("resized", 1, timeout=120)
        assert (grown["from_workers"], grown["to_workers"]) == (3, 4)
        run.wait(lambda s: s["world_size"] == 4 and s["phase"] == "RUNNING", what="running at 4")
    finally:
        cluster.remove_node(node)
    rec = run.wait_event("recovered", timeout=180)
    assert rec["world_before"] == 4 and 2 <= rec["world_after"] <= 3
    # The node's capacity is gone: the group settles at what the remaining 3 CPUs hold.
    run.wait(lambda s: s["phase"] == "RUNNING" and s["world_size"] == 3, what="running at 3 again")
    etrain(["stop", run.spec.run_id, "--store", root, "--no-wait"])
    final = run.join()
    assert final["phase"] == "FINISHED" and final["recoveries"] == 1


def test_etcd_outage_keeps_training_and_the_status_catches_up(cluster, root, etcd_server, capsys):
    store_url = f"{etcd_server.url}-{uuid.uuid4().hex[:6]}"
    run, store = start(root, "train.steps=60", store=store_url)
    run_id = run.spec.run_id
    at = run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 4, what="step 4")
    etcd_server.stop()
    try:
        code, _, err = cli(capsys, "status", run_id, "--store", store_url)
        assert code == 2 and "unreachable" in err
        code, _, err = cli(capsys, "suspend", run_id, "--store", store_url)
        assert code == 2 and "unreachable" in err
        during = run.wait(lambda s: s["step"] >= at["step"] + 8, timeout=120, what="steps during the outage")
        assert during["phase"] == "RUNNING"
    finally:
        etcd_server.start()
    final = run.join()
    assert final["phase"] == "FINISHED" and final["step"] == 60
    deadline = time.monotonic() + 30
    while (store.get_status(run_id) or {}).get("phase") != "FINISHED" and time.monotonic() < deadline:
        time.sleep(0.2)
    st = store.get_status(run_id)
    assert st["phase"] == "FINISHED" and st["step"] == 60
    kinds = [e["kind"] for e in store.events(run_id) if e["kind"] != "allocator"]  # the controller's own
    assert kinds[0] == "started" and kinds[-1] == "finished"


def test_ray_job_submit_runs_the_training_and_resume_submits_a_new_job(cluster, root, capsys, monkeypatch):
    """The user's path: `ray job submit --working-dir . -- python -m orchestrator run ...`."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    # This cluster's interpreter with etrain's dependencies is this one (a venv), not `python` on PATH.
    monkeypatch.setenv("ETRAIN_JOB_PYTHON", sys.executable)
    client = JobSubmissionClient(cluster.dashboard_url)
    run_id = f"job-{uuid.uuid4().hex[:6]}"
    sets = [a for o in [*BASE, f'checkpoint.url="{root}"', "train.steps=200"] for a in ("--set", o)]
    entry = [sys.executable, "-m", "orchestrator", "run", "examples/tiny.toml", "--workers", "2", "--run-id", run_id,
             "--store", root, "--no-progress", *sets]
    job = client.submit_job(entrypoint=" ".join(f"'{a}'" for a in entry), runtime_env={"working_dir": "."})
    store = open_store(root)
    deadline = time.monotonic() + 240
    while (store.get_status(run_id) or {}).get("step", 0) < 4:
        assert client.get_job_status(job) not in (JobStatus.FAILED, JobStatus.STOPPED), client.get_job_logs(job)
        assert time.monotonic() < deadline, client.get_job_logs(job)
        time.sleep(0.5)
    code, out, _ = cli(capsys, "suspend", run_id, "--store", root, "--timeout", "120")
    assert code == 0 and "SUSPENDED" in out
    _wait_job(client, job, JobStatus.SUCCEEDED)
    logs = client.get_job_logs(job)
    assert f"run '{run_id}' SUSPENDED" in logs
    # Resume as a new Ray job on 3 workers, from any machine that reaches the store and the cluster.
    code, out, _ = cli(capsys, "resume", run_id, "--workers", "3", "--store", root, "--submit", cluster.dashboard_url)
    assert code == 0 and "submitted Ray job" in out
    second = out.split("submitted Ray job ")[1].split()[0]
    deadline = time.monotonic() + 240
    while (store.get_status(run_id) or {}).get("phase") != "RUNNING":
        assert client.get_job_status(second) not in (JobStatus.FAILED, JobStatus.STOPPED), \
            client.get_job_logs(second)
        assert time.monotonic() < deadline, client.get_job_logs(second)
        time.sleep(0.5)
    registered = [e for e in store.events(run_id) if e["kind"] == "allocator" and e.get("action") == "registered"]
    assert len(registered) == 2, "the job's run and its resume (--submit) are each the allocator's"
    code, _, _ = cli(capsys, "stop", run_id, "--store", root, "--timeout", "240")
    assert code == 0
    _wait_job(client, second, JobStatus.SUCCEEDED)
    st = store.get_status(run_id)
    assert st["phase"] == "FINISHED" and 4 <= st["step"] < 200
    formed = [e for e in store.events(run_id) if e["kind"] == "formed"]
    assert formed[-1]["world_size"] == 3 and formed[-1]["restored_from"] is not None


def _wait_job(client, job: str, want, timeout: float = 240.0) -> None:
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout
    while True:
        status = client.get_job_status(job)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            assert status == want, client.get_job_logs(job)[-3000:]
            return
        assert time.monotonic() < deadline, f"job {job} still {status}: {client.get_job_logs(job)[-3000:]}"
        time.sleep(0.5)


@pytest.mark.exhaustive  # tests/orchestrator/test_terminal.py starts `etrain run` on a local Ray too (the slow tier)
def test_etrain_run_without_a_cluster_starts_a_local_ray_on_loopback(tmp_path):
    """`etrain run` on a machine with no cluster: a local Ray whose workers meet on 127.0.0.1."""
    root = f"file://{tmp_path}/runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k == "RAY_USAGE_STATS_ENABLED"}
    sets = [a for o in [*BASE, f'checkpoint.url="{root}"', "train.steps=6"] for a in ("--set", o)]
    r = subprocess.run([sys.executable, "-m", "orchestrator", "run", "examples/tiny.toml", "--workers", "2",
                        "--run-id", "local", "--no-progress", *sets], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "run 'local' FINISHED at step 6/6" in r.stdout
    formed = [e for e in open_store(root).events("local") if e["kind"] == "formed"]
    assert formed and all(e["rendezvous"].startswith("127.0.0.1:") for e in formed)
