"""The etcd run store with etcd's own authentication and with TLS: credentials and certificate files from
the environment (ETRAIN_ETCD_USER, ETRAIN_ETCD_PASSWORD, ETRAIN_ETCD_CA), never in the URL; real etcd
servers on 127.0.0.1 started for this file."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.request

import pytest

from orchestrator.store.run_store import RunSpec, StoreUnavailable, open_store
from tests.conftest import terminate
from tests.harness import free_port

PASSWORD = "Pa55-w0rd-of-alice"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def start_etcd(data_dir: str, scheme: str = "http", tls: tuple[str, str] | None = None):
    port, peer = free_port(), free_port()
    client = f"{scheme}://127.0.0.1:{port}"
    args = ["etcd", "--name", "a", "--data-dir", data_dir, "--listen-client-urls", client, "--advertise-client-urls",
            client, "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}", "--initial-cluster", f"a=http://127.0.0.1:{peer}", "--log-level", "error"]
    if tls:
        args += ["--cert-file", tls[0], "--key-file", tls[1]]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, port


def wait_up(proc, check) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            check()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                terminate(proc)
                raise RuntimeError("etcd did not start") from None
            time.sleep(0.1)


@pytest.fixture(scope="module")
def etcd_with_auth(tmp_path_factory):
    """etcd with authentication on: root, and alice with read-write access to the prefix /test/ only."""
    proc, port = start_etcd(str(tmp_path_factory.mktemp("etcd-auth")))
    base = f"http://127.0.0.1:{port}/v3"
    wait_up(proc, lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=1))

    def post(path: str, body: dict, token: str | None = None) -> dict:
        req = urllib.request.Request(f"{base}/{path}", data=json.dumps(body).encode(),
                                     headers={"Authorization": token} if token else {})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    post("auth/role/add", {"name": "root"})
    post("auth/user/add", {"name": "root", "password": "root-pw"})
    post("auth/user/grant", {"user": "root", "role": "root"})
    post("auth/role/add", {"name": "etrain"})
    post("auth/role/grant", {"name": "etrain", "perm": {"permType": "READWRITE", "key": _b64("/test/"),
                                                        "range_end": _b64("/test0")}})
    post("auth/user/add", {"name": "alice", "password": PASSWORD})
    post("auth/user/grant", {"user": "alice", "role": "etrain"})
    post("auth/enable", {})
    try:
        yield f"etcd://127.0.0.1:{port}/test"
    finally:
        terminate(proc)


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("ETRAIN_ETCD_USER", "ETRAIN_ETCD_PASSWORD", "ETRAIN_ETCD_CA", "ETRAIN_ETCD_CERT", "ETRAIN_ETCD_KEY"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def spec(run_id="r1"):
    return RunSpec(run_id=run_id, config={"run_id": run_id}, workers=2, min_workers=1, max_workers=4)


def test_a_store_with_etcd_authentication_takes_its_user_from_the_environment(etcd_with_auth, clean_env):
    with pytest.raises(StoreUnavailable, match="refused no user.*ETRAIN_ETCD_USER"):
        open_store(etcd_with_auth).list_runs()
    clean_env.setenv("ETRAIN_ETCD_USER", "alice")
    clean_env.setenv("ETRAIN_ETCD_PASSWORD", "wrong-" + PASSWORD)
    with pytest.raises(StoreUnavailable, match="refused the user \\$ETRAIN_ETCD_USER='alice'") as e:
        open_store(etcd_with_auth).list_runs()
    assert PASSWORD not in str(e.value)
    clean_env.setenv("ETRAIN_ETCD_PASSWORD", PASSWORD)
    store = open_store(etcd_with_auth)
    store.create_run(spec())
    assert store.update_spec("r1", expected=0, workers=3).workers == 3  # the compare-and-swap, authenticated
    lease = store.acquire("r1", "ctl-1", ttl_s=5)
    store.put_status("r1", {"phase": "RUNNING"}, lease)
    assert store.renew(lease) and store.leader_alive("r1")
    store.release(lease)
    assert store.list_runs() == ["r1"]
    assert PASSWORD not in store.url
    outside = open_store(etcd_with_auth.rsplit("/", 1)[0] + "/other")  # a prefix alice has no right to
    with pytest.raises(StoreUnavailable, match="permission denied"):
        outside.get_spec("r1")


def test_half_a_credential_is_refused_naming_the_missing_variable(etcd_with_auth, clean_env):
    from checkpointing.errors import ConfigError

    clean_env.setenv("ETRAIN_ETCD_USER", "alice")
    with pytest.raises(ConfigError, match="ETRAIN_ETCD_PASSWORD is not set"):
        open_store(etcd_with_auth)
    clean_env.delenv("ETRAIN_ETCD_USER")
    clean_env.setenv("ETRAIN_ETCD_CA", "/nonexistent/ca.pem")
    with pytest.raises(ConfigError, match="ETRAIN_ETCD_CA=.*not a readable file"):
        open_store(etcd_with_auth)


def test_a_store_over_tls_checks_the_servers_certificate_against_etrain_etcd_ca(tmp_path, clean_env):
    ca_key, ca, key, csr, cert, other_key, other = (str(tmp_path / n) for n in (
        "ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem", "other.key", "other.pem"))
    ext = tmp_path / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
                 "-subj", "/CN=etrain-test-ca"],
                ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", other_key, "-out", other, "-days", "2",
                 "-subj", "/CN=another-ca"],
                ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
                ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days",
                 "2", "-extfile", str(ext)]):
        subprocess.run(["openssl", *cmd], check=True, capture_output=True)
    proc, port = start_etcd(str(tmp_path / "data"), "https", (cert, key))
    try:
        import ssl

        ctx = ssl.create_default_context(cafile=ca)
        wait_up(proc, lambda: urllib.request.urlopen(f"https://127.0.0.1:{port}/version", timeout=1, context=ctx))
        url = f"etcd://127.0.0.1:{port}/test"
        with pytest.raises(StoreUnavailable, match="unreachable"):  # plain HTTP to a TLS server
            open_store(url).list_runs()
        clean_env.setenv("ETRAIN_ETCD_CA", ca)
        store = open_store(url)
        store.create_run(spec())
        assert store.get_spec("r1").workers == 2
        clean_env.setenv("ETRAIN_ETCD_CA", other)
        with pytest.raises(StoreUnavailable, match="TLS handshake failed.*ETRAIN_ETCD_CA"):  # not its signer
            open_store(url).list_runs()
    finally:
        terminate(proc)
