"""Ray's own job controls on a run submitted as a Ray job, against a local head on 127.0.0.1 (the session's
cluster, tests/cluster.py): `ray job stop` (SIGTERM to the entrypoint) suspends the run at a committed
step boundary, and it resumes to the uninterrupted run's final state; a SIGKILLed driver leaves the run
INTERRUPTED (and resumable), never RUNNING."""

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
from orchestrator.store.run_store import open_store
from tests.cluster import GLOBAL_BATCH, RUN_BASE, STEPS

pytestmark = pytest.mark.ray

RAY = os.path.join(os.path.dirname(sys.executable), "ray")  # Ray's own CLI, as a user runs it


@pytest.fixture
def root(tmp_path):
    return f"file://{tmp_path}/runs"


def ray_cli(*args: str, timeout: float = 180) -> str:
    deadline = time.monotonic() + 120
    while True:
        r = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=timeout)
        # A head just started may not have its job agent up yet; Ray says to try again.
        if r.returncode and "No available agent" in r.stderr and time.monotonic() < deadline:
            time.sleep(2)
            continue
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout + r.stderr


def submit(client, entry: list[str], run_id: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            client.submit_job(entrypoint=" ".join(f"'{a}'" for a in entry), submission_id=run_id,
                              runtime_env={"working_dir": "."})
            return
        except RuntimeError as e:  # as above
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(2)


def entrypoint(root: str, run_id: str) -> list[str]:
    sets = [a for o in [*RUN_BASE, f'checkpoint.url="{root}"'] for a in ("--set", o)]
    return [sys.executable, "-m", "orchestrator", "run", "examples/tiny.toml", "--workers", "2", "--run-id", run_id,
            "--store", root, "--no-progress", *sets]


def cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = etrain(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


def wait_for_step(store, client, job: str, run_id: str, step: int, timeout: float = 240) -> dict:
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout
    while True:
        st = store.get_status(run_id) or {}
        if st.get("phase") == "RUNNING" and (st.get("step") or 0) >= step:
            return st
        assert client.get_job_status(job) not in (JobStatus.FAILED, JobStatus.STOPPED), client.get_job_logs(job)
        assert time.monotonic() < deadline, client.get_job_logs(job)[-3000:]
        time.sleep(0.3)


def registrations(store, run_id: str) -> int:
    """How often the run was registered with the cluster's allocator (an event at every start and resume)."""
    return sum(1 for e in store.events(run_id) if e["kind"] == "allocator" and e.get("action") == "registered")


def samples_committed(root: str, run_id: str) -> int:
    mgr = CheckpointManager(root, run_id)
    return mgr.read_manifest(mgr.latest_committed()).trainer_state["samples_consumed"]


def test_ray_job_stop_suspends_at_a_committed_step_boundary_and_resume_matches_the_uninterrupted_run(
        ray_cluster, root, reference, capsys):
    from ray.job_submission import JobStatus, JobSubmissionClient

    url = ray_cluster.dashboard_url
    client = JobSubmissionClient(url)
    run_id = f"stop-{uuid.uuid4().hex[:6]}"
    # The grace Ray gives the driver between SIGTERM and SIGKILL (3 s by default), as docs/service.md says
    # to set it for a job submitted by hand; `etrain submit` sets it itself.
    grace = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})
    ray_cli("job", "submit", "--address", url, "--no-wait", "--submission-id", run_id, "--working-dir", ".",
            "--runtime-env-json", grace, "--", *entrypoint(root, run_id))
    store = open_store(root)
    wait_for_step(store, client, run_id, run_id, 6)
    assert registrations(store, run_id) == 1, "a run started by `ray job submit` is not the allocator's"
    t0, t0_unix = time.monotonic(), time.time()
    ray_cli("job", "stop", "--address", url, run_id)  # waits until the job has stopped
    stop_s = time.monotonic() - t0
    assert client.get_job_status(run_id) == JobStatus.STOPPED
    st = store.get_status(run_id)
    assert st["phase"] == "SUSPENDED", st
    assert st["latest_checkpoint"] == st["step"] and 6 <= st["step"] < STEPS  # committed at the boundary
    assert CheckpointManager(root, run_id).latest_committed() == st["step"]
    suspended = [e for e in store.events(run_id) if e["kind"] == "suspended"]
    assert len(suspended) == 1 and suspended[0]["cause"] == "SIGTERM" and suspended[0]["checkpoint_committed"]
    logs = client.get_job_logs(run_id)
    assert f"run '{run_id}' SUSPENDED at step {st['step']}" in logs and "Traceback" not in logs, logs[-3000:]
    with capsys.disabled():  # the figure docs/service.md quotes
        print(f"\nray job stop -> SUSPENDED at step {st['step']}: the command took {stop_s:.1f} s, the suspend "
              f"{suspended[0]['time'] - t0_unix:.1f} s from the command's start (incl. its own start-up)")
    code, out = cli(capsys, "resume", run_id, "--store", root, "--no-progress")
    assert code == 0 and f"run '{run_id}' FINISHED at step {STEPS}/{STEPS}" in out, out[-3000:]
    final = store.get_status(run_id)
    assert registrations(store, run_id) == 2, "a run resumed by `etrain resume` is not the allocator's"
    assert final["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    assert samples_committed(root, run_id) == samples_committed(reference["root"], "reference") == STEPS * GLOBAL_BATCH


def test_a_sigkilled_driver_leaves_the_run_interrupted_and_resumable_never_running(ray_cluster, root, capsys):
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(ray_cluster.dashboard_url)
    run_id = f"kill-{uuid.uuid4().hex[:6]}"
    submit(client, entrypoint(root, run_id), run_id)
    store = open_store(root)
    wait_for_step(store, client, run_id, run_id, 5)
    os.kill(int(client.get_job_info(run_id).driver_info.pid), signal.SIGKILL)  # no handler runs
    killed = time.monotonic()
    deadline = killed + 60  # the controller's lease (15 s) lapses, and its status goes stale
    while True:
        code, out = cli(capsys, "status", run_id, "--store", root, "--json")
        assert code == 0
        st = json.loads(out)
        if st["phase"] == "INTERRUPTED":
            break
        assert st["phase"] == "RUNNING" and time.monotonic() < deadline, st
        time.sleep(1.0)
    assert client.get_job_status(run_id) == JobStatus.FAILED
    assert "etrain resume" in st["reason"] and store.get_status(run_id)["phase"] == "INTERRUPTED"
    event = [e for e in store.events(run_id) if e["kind"] == "interrupted"]
    # Marked once, by whichever noticed the lapsed lease first: this status command or the cluster's allocator
    # (which watches every run's lease on the cluster).
    assert len(event) == 1 and event[0]["noticed_by"] in ("etrain status", "the cluster's allocator"), event
    with capsys.disabled():
        print(f"\nSIGKILL -> INTERRUPTED noticed after {time.monotonic() - killed:.1f} s")
    code, out = cli(capsys, "resume", run_id, "--store", root, "--no-progress")
    assert code == 0 and f"FINISHED at step {STEPS}/{STEPS}" in out, out[-3000:]
    assert samples_committed(root, run_id) == STEPS * GLOBAL_BATCH


def test_a_driver_whose_controller_dies_marks_the_run_interrupted_and_frees_its_lease(ray_cluster, root):
    import ray

    from tests.cluster import start_run

    run, store = start_run(root)
    run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 2, what="step 2")
    ray.kill(run.actor, no_restart=True)  # the controller dies; its driver (this process's thread) sees it
    final = run.join()
    assert final["phase"] == "INTERRUPTED" and "its controller died" in final["reason"], final
    st = store.get_status(run.spec.run_id)
    assert st["phase"] == "INTERRUPTED" and "etrain resume" in st["reason"]
    event = [e for e in store.events(run.spec.run_id) if e["kind"] == "interrupted"]
    assert len(event) == 1 and event[0]["noticed_by"] == "etrain run"
    assert not store.leader_alive(run.spec.run_id)  # freed at once: a resume need not wait out the lease
    store.check_resumable(run.spec.run_id)
