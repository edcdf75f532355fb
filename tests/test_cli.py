"""``python -m trainer`` end to end: bad input exits 2 with one clear line; torchrun trains."""

import json
import os
import subprocess
import sys

import pytest

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
