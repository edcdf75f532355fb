"""Joining a `ray start` cluster with token authentication (``RAY_AUTH_MODE=token`` on its head).

The head is a real ``ray start --head --block`` on 127.0.0.1, with explicit ports, in a temporary directory
of its own, ended by its pid (SIGTERM: it stops its processes; then its process group is killed). The
clients run in processes of their own, with a HOME of the test's: Ray reads its token mode once per process.

* no token anywhere: etrain says so at once, naming the variables to set (Ray alone retries for 20 s, a
  line of ``InvalidAuthToken`` a second, and then says only "Failed to connect");
* Ray's token file (``~/.ray/auth_token``) present and ``RAY_AUTH_MODE`` unset: etrain uses it, as the
  ``ray`` CLI does, and joins;
* a token the cluster does not know: refused at once too;
* ``etrain submit``: the dashboard (the job server) gets the token; refused without one, naming the variables.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from tests.harness import ROOT, free_port

pytestmark = pytest.mark.ray

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture(scope="module")
def token_cluster():
    """(GCS address, token, dashboard URL) of a one-node Ray with token authentication, ended by pid when the
    module ends."""
    token = uuid.uuid4().hex
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: Ray's socket paths live under it
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0", HOME=temp_dir)
    ports = {"--port": port, "--ray-client-server-port": free_port(), "--dashboard-agent-listen-port": free_port(),
             "--dashboard-agent-grpc-port": free_port(), "--metrics-export-port": free_port(),
             "--runtime-env-agent-port": free_port(), "--node-manager-port": free_port(),
             "--object-manager-port": free_port(), "--dashboard-port": free_port()}
    proc = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                             f"--temp-dir={temp_dir}", "--disable-usage-stats", "--dashboard-host=127.0.0.1",
                             *(f"{k}={v}" for k, v in ports.items())],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(temp_dir, "ray_current_cluster")):
            assert proc.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", token, f"http://127.0.0.1:{ports['--dashboard-port']}"
    finally:
        proc.terminate()  # ray start --block stops its processes on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:  # anything of its session left behind: its process group, started by this test
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def client(home, code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -c code args`` as a user whose HOME is ``home`` and who set nothing of Ray's auth but ``env``."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    e.update(HOME=str(home), PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", code, *args], check=False, cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=300)


# Joins the cluster at argv[1] as etrain does; how long the join took goes to stderr (the imports before it are
# slow on a loaded machine, and not what is measured).
JOIN = """
import sys, time, ray
from orchestrator.driver.run import connect
start = time.monotonic()
try:
    connect(sys.argv[1], 0)
finally:
    print(f"join took {time.monotonic() - start:.1f} s", file=sys.stderr)
print("joined", ray.cluster_resources().get("CPU"))
ray.shutdown()
"""


def join_took(stderr: str) -> float:
    return float(stderr.rsplit("join took ", 1)[1].split()[0])


def test_joining_without_a_token_says_which_variables_to_set_at_once(token_cluster, tmp_path):
    address, *_ = token_cluster
    r = client(tmp_path, "import sys; from orchestrator.cli.main import main; sys.exit(main(sys.argv[1:]))",
                     "run", "examples/tiny.toml", "--address", address, "--store", f"file://{tmp_path}/runs",
                     "--set", f'checkpoint.url="file://{tmp_path}/runs"', "--set", "train.steps=2", "--no-progress")
    assert r.returncode == 2, r.stderr
    assert "needs a token" in r.stderr and "RAY_AUTH_TOKEN" in r.stderr and "~/.ray/auth_token" in r.stderr, r.stderr
    assert "InvalidAuthToken" not in r.stderr and "Failed to connect" not in r.stderr, r.stderr
    r = client(tmp_path, JOIN, address)
    assert r.returncode != 0 and "needs a token" in r.stderr and join_took(r.stderr) < 10, r.stderr
    from orchestrator.store.run_store import open_store

    assert open_store(f"file://{tmp_path}/runs").list_runs() == []  # a run that could not join is not recorded


def test_rays_token_file_is_used_as_the_ray_cli_uses_it(token_cluster, tmp_path):
    address, token, _ = token_cluster
    os.makedirs(tmp_path / ".ray")
    (tmp_path / ".ray" / "auth_token").write_text(token)
    r = client(tmp_path, JOIN, address)
    assert r.returncode == 0 and "joined 1.0" in r.stdout, r.stderr
    assert "InvalidAuthToken" not in r.stderr, r.stderr


def test_a_token_the_cluster_does_not_know_is_refused_at_once(token_cluster, tmp_path):
    address, *_ = token_cluster
    r = client(tmp_path, JOIN, address, RAY_AUTH_TOKEN="not-" + uuid.uuid4().hex)
    assert r.returncode != 0 and "refuses the token this machine has" in r.stderr, r.stderr
    assert join_took(r.stderr) < 10 and "InvalidAuthToken" not in r.stderr, r.stderr


SUBMIT = """
import sys, time
from checkpointing.errors import EtrainError
from orchestrator.driver.run import submit_job
deadline = time.monotonic() + 120
while True:  # the dashboard and its agent come up a while after the GCS
    try:
        print("submitted", submit_job(sys.argv[1], ["-c", "pass"], working_dir=sys.argv[2]))
        break
    except EtrainError as e:
        if "Authentication" in str(e) or time.monotonic() > deadline:
            sys.exit(f"etrain: {e}")
        time.sleep(1)
"""


def test_etrain_submit_sends_the_token_to_the_dashboard_and_names_the_fix_without_it(token_cluster, tmp_path):
    _, token, dashboard = token_cluster
    (tmp_path / "job").mkdir()
    r = client(tmp_path, SUBMIT, dashboard, str(tmp_path / "job"))
    assert r.returncode != 0 and "Authentication required" in r.stderr and "RAY_AUTH_TOKEN" in r.stderr, r.stderr
    r = client(tmp_path, SUBMIT, dashboard, str(tmp_path / "job"), RAY_AUTH_TOKEN=token)
    assert r.returncode == 0 and "submitted raysubmit_" in r.stdout, r.stderr
