"""``python -m trainer`` end to end: bad input exits 2 with one clear line; torchrun trains."""

import json
import os
import subprocess
import sys

import pytest

from orchestrator.chaos import procfs
from tests.harness import ROOT, free_port

PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


def run_trainer(args, env=None, timeout=300):
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    e.update(env or {})
    return subprocess.run([PY, "-m", "trainer", *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, env, message", [
    (["--set", "parallel.tp=3"], {}, "parallel.tp=3 does not divide model.n_heads=4"),
    (["--set", "parallel.bogus=1"], {}, "unknown key parallel.bogus"),
    (["--config", "nope.toml"], {}, "config file 'nope.toml' does not exist"),
    (["--set", "data.source=/nonexistent/corpus"], {}, "data.source='/nonexistent/corpus' does not exist"),
    (["--log-file", ROOT], {}, f"--log-file {ROOT!r} is a directory; give a file name"),
    # A layout the world cannot hold fails before any process group is formed:
    # no peer is listening on MASTER_PORT, so reaching init would hang, not exit 2.
    (["--set", "parallel.tp=2"], {"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": "1"}, "world size 3 is not a multiple"),
])
def test_bad_input_exits_2_with_message(args, env, message):
    r = run_trainer(["--config", "examples/tiny.toml", *args], env=env, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # the fast tier's 12-minute budget
def test_tiny_config_learns(tmp_path):
    """200 steps of the tiny config lower the loss by a clear margin."""
    log = tmp_path / "steps.jsonl"
    r = run_trainer(["--config", "examples/tiny.toml", "--set", "data.max_bytes=4000000", "--log-file", str(log),
                     "--quiet"], timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 201))
    first = sum(row["loss"] for row in rows[:5]) / 5
    last = sum(row["loss"] for row in rows[-10:]) / 10
    # A byte-level model starts near ln(256) = 5.5 and learns Python's byte statistics fast.
    assert first > 5.0
    assert last < 0.5 * first, (first, last)


def test_torchrun_two_processes_write_step_log(tmp_path):
    log = tmp_path / "steps.jsonl"
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([TORCHRUN, "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                        "-m", "trainer", "--config", "examples/tiny.toml", "--set", "parallel.zero_stage=2",
                        "--set", "train.steps=6", "--set", "train.log_every=3", "--set", "data.max_bytes=1000000",
                        "--log-file", str(log)], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:
        assert {"step", "loss", "lr", "tokens_per_s", "step_seconds", "world_size"} <= row.keys()
        assert row["world_size"] == 2 and row["tokens_per_s"] > 0
    assert "step 6/6" in r.stdout and "memory rank 0" in r.stdout


def _rank_pids(agent_pid: int) -> dict[int, int]:
    """The rank processes torchrun's agent started: {RANK: pid}."""
    ranks = {pid: procfs.environ(pid).get("RANK", "") for pid in procfs.children(agent_pid)}
    return {int(rank): pid for pid, rank in ranks.items() if rank.isdigit()}


@pytest.mark.slow  # about 14 s: two torchrun launches
def test_torchrun_restarts_resume_from_the_checkpoint(tmp_path):
    """A rank SIGKILLed twice under ``torchrun --max-restarts``: every restart forms its group afresh
    (torchrun's static rendezvous keeps one store for the job: stale keys hung or refused restarts),
    resumes from the newest checkpoint, and the job finishes every step."""
    import signal
    import time

    log = tmp_path / "steps.jsonl"
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [TORCHRUN, "--nproc_per_node=2", "--max-restarts=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "trainer", "--config", "examples/tiny.toml", "--quiet",
           "--log-file", str(log)]
    for o in ["parallel.zero_stage=2", "train.steps=24", "data.max_bytes=1000000", "checkpoint.interval_steps=4",
              f'checkpoint.url="file://{tmp_path}/ckpt"', "checkpoint.resume=true"]:
        cmd += ["--set", o]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)

    def steps():
        try:
            return [json.loads(line)["step"] for line in log.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return []

    try:
        for at in (6, 14):
            deadline = time.monotonic() + 120
            while not (steps() and steps()[-1] >= at) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                time.sleep(0.05)
            assert steps() and steps()[-1] >= at, f"step {at} not reached: {steps()}"
            os.kill(_rank_pids(proc.pid)[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            for pid in _rank_pids(proc.pid).values():
                os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    seen = steps()
    assert seen[-1] == 24 and sorted(set(seen)) == list(range(1, 25))
    # Two restarts, each resuming at a committed step (a multiple of 4) and redoing at most 4 steps.
    resumes = [b for a, b in zip(seen, seen[1:]) if b <= a]
    assert len(resumes) == 2 and all((b - 1) % 4 == 0 for b in resumes), seen
