"""README.md's quick start as a new user runs it: every command of its block, in order, as written, each exiting 0.

It runs in a copy of the repository's files (what a fresh clone holds, the files not yet committed
included), with a HOME of its own (the run registry, ~/.etrain) and the installed `etrain` on PATH. The
block's `etrain run` trains in the foreground until the run ends; the commands after it ("from another
terminal") run while it does, once its status says RUNNING, and the `etrain suspend` among them ends it
(exit 0, SUSPENDED). A local Ray on 127.0.0.1, started and ended by `etrain run` and `etrain resume`
themselves. A few minutes: the slow tier."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def quick_start(readme: str) -> list[str]:
    """The commands of README's quick start block: comment lines dropped, continued lines joined."""
    section = readme.split("\n## Quick start\n", 1)[1]
    block = section.split("```", 2)[1]
    commands: list[str] = []
    for raw in block.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if commands and commands[-1].endswith("\\"):
            commands[-1] = commands[-1][:-1] + " " + line
        else:
            commands.append(line)
    return commands


def test_the_quick_start_block_is_read_whole():
    commands = quick_start((ROOT / "README.md").read_text())
    assert commands[0].startswith("etrain train examples/tiny.toml")
    assert any(c.startswith("etrain run ") for c in commands) and any(c.startswith("etrain suspend") for c in commands)
    assert not any(c.endswith("\\") for c in commands)


def copy_checkout(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def wait_running(cwd: Path, env: dict, run_id: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"`etrain run` ended (exit {proc.returncode}) before {run_id!r} ran"
        got = subprocess.run(["etrain", "status", run_id, "--json"], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=120)
        if got.returncode == 0 and json.loads(got.stdout or "{}").get("phase") == "RUNNING":
            return
        assert time.monotonic() < deadline, f"{run_id!r} not RUNNING within {timeout:.0f} s: {got.stdout}{got.stderr}"
        time.sleep(2)


@pytest.mark.timeout(1800)
def test_the_quick_start_runs_as_written(tmp_path):
    repo, home = tmp_path / "etrain", tmp_path / "home"
    copy_checkout(repo)
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ETRAIN_"))}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
               RAY_USAGE_STATS_ENABLED="0")
    commands = quick_start((repo / "README.md").read_text())
    background, log = None, tmp_path / "run.log"
    try:
        for cmd in commands:
            print(f"{time.strftime('%H:%M:%S')} $ {cmd}", flush=True)  # shown when the test fails
            if cmd.startswith("etrain run ") and "--detach" not in cmd:  # the foreground run, in its own terminal
                with open(log, "w") as out:
                    background = subprocess.Popen(["bash", "-c", cmd], cwd=repo, env=env, stdout=out,
                                                  stderr=subprocess.STDOUT, start_new_session=True)
                wait_running(repo, env, "tiny", background)
                continue
            if cmd.startswith("etrain resume") and background is not None:
                code = background.wait(timeout=300)  # the suspend before it ended the run
                assert code == 0, f"`etrain run` exit {code}:\n{log.read_text()[-4000:]}"
                background = None
            got = subprocess.run(["bash", "-c", cmd], cwd=repo, env=env, capture_output=True, text=True,
                                 timeout=900)
            assert got.returncode == 0, f"$ {cmd}\nexit {got.returncode}\n{got.stdout[-3000:]}\n{got.stderr[-3000:]}"
        assert background is None, "the run the quick start started was never ended by it"
    finally:
        if background is not None and background.poll() is None:
            os.killpg(background.pid, signal.SIGINT)
            try:
                background.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(background.pid, signal.SIGKILL)
