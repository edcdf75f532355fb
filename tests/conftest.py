"""Shared fixtures: real servers on 127.0.0.1, started once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

import tests.cluster  # noqa: F401  (sets Ray's environment, RAY_ENV, before any test module imports Ray)
from tests.harness import free_port

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server in its own process on a free loopback port; yields its endpoint URL.

    The endpoint and test credentials are put into this process's environment
    (so worker processes inherit them) the way a user would set them.
    """
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the moto S3 server did not start") from None
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL_S3"]}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL_S3=endpoint)
    try:
        yield endpoint
    finally:
        terminate(proc)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_bucket_counter = [0]


def new_bucket(endpoint: str) -> str:
    import boto3

    _bucket_counter[0] += 1
    name = f"etrain-test-{os.getpid()}-{_bucket_counter[0]}"
    boto3.client("s3", endpoint_url=endpoint, **{
        "aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": S3_ENV["AWS_DEFAULT_REGION"]}).create_bucket(Bucket=name)
    return name


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow_on_s3`` (``exhaustive_on_s3``): the S3 case of a ``storage_url`` test runs with the slow
    tier (``make test-exhaustive``); the same test on a local disk stays in ``make test``."""
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or spec.params.get("storage_url") != "s3":
            continue
        if item.get_closest_marker("exhaustive_on_s3"):
            item.add_marker(pytest.mark.exhaustive)
        elif item.get_closest_marker("slow_on_s3"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["file", "s3"])
def storage_url(request, tmp_path):
    """A fresh checkpoint root: a local directory, then an S3 bucket on the moto server."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt"
    endpoint = request.getfixturevalue("s3_server")
    return f"s3://{new_bucket(endpoint)}/runs"


def terminate(proc: subprocess.Popen | None) -> None:
    """End a server this session started: SIGTERM, then SIGKILL after 10 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class EtcdServer:
    """A real etcd on loopback with its own data dir; stop() and start() keep ports and data."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.url = f"etcd://127.0.0.1:{self.port}/test"
        self.proc = None

    def start(self) -> None:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", self.data_dir, "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{client}/version", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("etcd did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        terminate(self.proc)
        self.proc = None


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    server = EtcdServer(str(tmp_path_factory.mktemp("etcd")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class PrometheusServer:
    """A real Prometheus on loopback with the project's scrape config (deploy/prometheus.yml), its
    file_sd directory moved to ``targets_dir`` and its scrape interval shortened for tests."""

    def __init__(self, work_dir: str):
        import yaml

        self.targets_dir = os.path.join(work_dir, "targets")
        os.makedirs(self.targets_dir)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(root, "deploy", "prometheus.yml")) as f:
            cfg = yaml.safe_load(f)
        job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "etrain")
        job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
        job["file_sd_configs"][0]["files"] = [os.path.join(self.targets_dir, "*.json")]
        job["file_sd_configs"][0]["refresh_interval"] = "1s"
        config = os.path.join(work_dir, "prometheus.yml")
        with open(config, "w") as f:
            yaml.safe_dump(cfg, f)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={os.path.join(work_dir, 'data')}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work_dir, "prometheus.log"), "w"),
            start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("prometheus did not start; see prometheus.log in " + work_dir) from None
                time.sleep(0.2)

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        """An instant query through the HTTP API: the result vector."""
        import json
        import urllib.parse

        params = {"query": promql, **({"time": f"{at:.3f}"} if at else {})}
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets(self) -> list[dict]:
        import json

        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as r:
            return json.load(r)["data"]["activeTargets"]

    def stop(self) -> None:
        terminate(self.proc)


@pytest.fixture(autouse=True, scope="session")
def _etrain_home(tmp_path_factory):
    """The run registry, logs and Prometheus target files of the tests' runs go to a directory of the
    session, not the user's ~/.etrain (subprocesses inherit it)."""
    home = str(tmp_path_factory.mktemp("etrain-home"))
    old = os.environ.get("ETRAIN_HOME")
    os.environ["ETRAIN_HOME"] = home
    yield home
    if old is None:
        os.environ.pop("ETRAIN_HOME", None)
    else:
        os.environ["ETRAIN_HOME"] = old


@pytest.fixture(autouse=True)
def _end_runs():
    """Close the runs a test started (tests.cluster.start_run), even when it failed half-way."""
    yield
    import sys

    cluster = sys.modules.get("tests.cluster")
    while cluster is not None and cluster.RUNS:
        cluster.RUNS.pop().close()


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster for the session's Ray tests: a head with no CPUs and three 1-CPU worker
    nodes, each its own raylet, on 127.0.0.1 (tests.cluster.LocalCluster)."""
    from tests.cluster import LocalCluster

    c = LocalCluster(node_cpus=[1, 1, 1])
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="session")
def reference(ray_cluster, tmp_path_factory):
    """A failure-free run of tests.cluster.RUN_BASE at 2 workers: what faulted runs must match.
    Its final status, plus ``root`` and ``store`` (where it ran) and its step ``history``."""
    from tests.cluster import reference_run

    return reference_run(f"file://{tmp_path_factory.mktemp('ref')}/runs")


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory):
    server = PrometheusServer(str(tmp_path_factory.mktemp("prometheus")))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["storage", "etcd"])
def store(request, tmp_path):
    """A run store of each backend: the embedded one on a local directory, and etcd."""
    from orchestrator.store.run_store import open_store

    if request.param == "storage":
        return open_store(f"file://{tmp_path}/runs")
    server = request.getfixturevalue("etcd_server")
    return open_store(server.url + "-" + uuid.uuid4().hex[:6])
