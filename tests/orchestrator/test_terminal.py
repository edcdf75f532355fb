"""``etrain run`` as a user sees it: in a terminal (a tmux pane) the live bar with an ETA, in a pipe plain lines
with an ETA; an evaluation as a line of its own in both; then ``etrain stop`` ends the run and nothing of it stays.

Each test starts ``etrain run`` (a local Ray of 1 CPU on 127.0.0.1, the tiny model, one worker) as a user
does, in a Ray temporary directory of its own (``RAY_TMPDIR``): once the run has ended, no process may still
name that directory (a leaked raylet, GCS or worker); any that does is killed by its pid and fails the test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from tests.harness import ROOT, wait_for

pytestmark = pytest.mark.ray

ETRAIN = os.path.join(os.path.dirname(sys.executable), "etrain")
# Enough steps that the run is still going when the ETA shows (it is stopped then); an evaluation every 10.
SETS = ['model.preset="tiny"', "data.seq_len=32", "data.max_bytes=1000000", "train.steps=2000",
        "train.global_batch=12", "train.micro_batch=1", "train.log_every=1000", "parallel.zero_stage=2",
        "checkpoint.interval_steps=1000", "metrics.enabled=false", "eval.every_steps=10", "eval.val_fraction=0.05",
        "eval.batches=1"]
ETA_BAR = re.compile(r"ETA \d+:\d\d:\d\d")  # rich's TimeRemainingColumn, once it has a speed (-:--:-- before)
ETA_LINE = re.compile(r"^(\S+) step (\d+)/2000 .* [\d.]+ steps/s  ETA (\d+:\d\d(:\d\d)?|\d+\.\d s)$")  # plain
EVAL_LINE = re.compile(r"^\[eval\] step (\d+) eval loss (\d+\.\d{4})$")


@pytest.fixture
def ray_dir():
    """A Ray temporary directory for the test's runs (short: Ray's socket paths must fit 107 bytes); afterwards,
    every process that still names it is killed (by pid) and fails the test."""
    path = tempfile.mkdtemp(prefix="etr-", dir="/tmp")
    yield path
    leaked = _naming(path, wait_s=30.0)
    for pid in leaked:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)
    assert not leaked, f"processes of the run's Ray still alive after it ended: {leaked}"


def _naming(path: str, wait_s: float) -> dict[int, str]:
    """The processes whose command line names ``path`` (pid -> command line), waiting up to ``wait_s`` for
    them to end (Ray stops its processes in the moments after the driver's ray.shutdown())."""
    deadline = time.monotonic() + wait_s
    while True:
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if path in cmd and int(pid) != os.getpid():
                found[int(pid)] = cmd[:200]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _env(tmp_path, ray_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "ETRAIN_STORE", "OMP_NUM_THREADS")}
    env.update(ETRAIN_HOME=str(tmp_path / "home"), RAY_TMPDIR=ray_dir, RAY_USAGE_STATS_ENABLED="0",
               PYTHONUNBUFFERED="1")
    return env


def _run_argv(run_id: str, store: str) -> list[str]:
    argv = [ETRAIN, "run", "examples/tiny.toml", "--run-id", run_id, "--workers", "1", "--store", store]
    for s in [*SETS, f'checkpoint.url="{store}"']:
        argv += ["--set", s]
    return argv


def _stop(run_id: str, store: str, env: dict) -> None:
    r = subprocess.run([ETRAIN, "stop", run_id, "--store", store, "--timeout", "120"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr


def _check_history(store_url: str, run_id: str) -> None:
    """The rows the run's history holds carry each step's tokens/s, and the eval loss on the steps that evaluated:
    the same loss as the run's eval events; the run registered with its cluster's allocator."""
    from orchestrator.store.run_store import open_store

    store = open_store(store_url)
    rows = store.get_history(run_id)
    evals = {e["step"]: e["loss"] for e in store.events(run_id) if e.get("kind") == "eval"}
    assert rows and all(r.tokens_per_s and r.tokens_per_s > 0 for r in rows)
    assert {r.step: r.eval_loss for r in rows if r.eval_loss is not None}.items() >= evals.items() and evals
    assert all((r.eval_loss is not None) == (r.step % 10 == 0) for r in rows[:-1])  # the last: the stop's step
    # `etrain run` in a terminal of its own (its local Ray): the run was its allocator's
    assert [e for e in store.events(run_id) if e.get("kind") == "allocator" and e.get("action") == "registered"]


def _evals_in(text: str) -> list[int]:
    """The steps of the ``[eval]`` lines in ``text``."""
    return [int(m.group(1)) for line in text.splitlines() if (m := EVAL_LINE.match(line.strip()))]


def test_the_live_bar_in_a_terminal_shows_an_eta(tmp_path, ray_dir):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: `make sysdeps` (deploy/install-sysdeps.sh) installs it")
    store, env = f"file://{tmp_path}/runs", _env(tmp_path, ray_dir)
    sock_dir = tempfile.mkdtemp(prefix="etrain-tmux-", dir="/tmp")
    tmux = ["tmux", "-S", os.path.join(sock_dir, "s")]  # a tmux server of this test's own, with its environment
    name = f"etrain-{uuid.uuid4().hex[:6]}"
    command = " ".join(f"'{a}'" for a in _run_argv("term", store)) + '; echo "etrain exited $?"; sleep 600'
    subprocess.run([*tmux, "new-session", "-d", "-s", name, "-x", "200", "-y", "50", "-c", ROOT, command],
                   env=env, check=True, timeout=30)

    def pane() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", name], capture_output=True, text=True,
                              timeout=30).stdout

    try:
        screen = wait_for(lambda: (s := pane()) and (ETA_BAR.search(s) and _evals_in(s) or "etrain exited" in s) and s,
                          "the bar showing an ETA and an evaluation", timeout=180, poll_s=0.5)
        print(screen)  # what the user saw (pytest -s shows it)
        assert "etrain exited" not in screen, screen  # it ended before the bar had an ETA
        bar = next(line for line in screen.splitlines() if ETA_BAR.search(line))
        assert bar.split()[0] == "term" and re.search(r"\d+/2000", bar) and "world 1" in bar, screen
        assert all(step % 10 == 0 for step in _evals_in(screen)), screen
        _stop("term", store, env)
        screen = wait_for(lambda: (s := pane()) and "etrain exited" in s and s,
                          "the end of etrain run after etrain stop", timeout=60, poll_s=0.5)
        print(screen)
        assert "etrain exited 0" in screen and "etrain: run 'term' FINISHED at step" in screen, screen
        last = [line for line in screen.splitlines() if line.startswith("term ")][-1]
        assert "FINISHED" in last and "ETA" not in last, screen  # stopped early: the bar shows no time left
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)  # the pane's shell with it
        shutil.rmtree(sock_dir, ignore_errors=True)
    _check_history(store, "term")


def test_piped_output_has_plain_lines_with_an_eta(tmp_path, ray_dir):
    store, env = f"file://{tmp_path}/runs", _env(tmp_path, ray_dir)
    proc = subprocess.Popen(_run_argv("piped", store), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: any(map(ETA_LINE.match, lines)) and _evals_in("\n".join(lines)) or proc.poll() is not None,
                 "a plain line with an ETA and an evaluation", timeout=180, poll_s=0.5)
        assert proc.poll() is None, "the run ended before a plain line with an ETA:\n" + "\n".join(lines)
        _stop("piped", store, env)
        assert proc.wait(timeout=60) == 0, "\n".join(lines)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()  # our own etrain run; the fixture then finds what of its Ray is left
            proc.wait()
    progress = [x for x in lines if x.startswith("piped step ")]
    assert progress and all("\x1b" not in x and "━" not in x for x in lines), lines  # no bar, no colour codes
    assert int(next(m for m in map(ETA_LINE.match, progress) if m).group(2)) > 0
    evals = _evals_in("\n".join(lines))
    assert evals and all(s % 10 == 0 for s in evals), lines
    assert lines[-1].startswith("etrain: run 'piped' FINISHED at step"), lines
    _check_history(store, "piped")
