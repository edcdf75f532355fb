"""Shared fixtures: real servers on 127.0.0.1, started once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

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
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
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


@pytest.fixture(params=["file", "s3"])
def storage_url(request, tmp_path):
    """A fresh checkpoint root: a local directory, then an S3 bucket on the moto server."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt"
    endpoint = request.getfixturevalue("s3_server")
    return f"s3://{new_bucket(endpoint)}/runs"


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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    server = EtcdServer(str(tmp_path_factory.mktemp("etcd")))
    server.start()
    try:
        yield server
    finally:
        server.stop()
