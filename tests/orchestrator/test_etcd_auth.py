"""The etcd run store with etcd's own authentication and with TLS: credentials and certificate files from
the environment (ETRAIN_ETCD_USER, ETRAIN_ETCD_PASSWORD, ETRAIN_ETCD_CA), never in the URL; a password never
over plain HTTP unless ETRAIN_ETCD_INSECURE says so; etcds:// for HTTPS against the system's trust store. Real
etcd servers on 127.0.0.1 started for this file."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import struct
import subprocess
import threading
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


def enable_auth(base: str, context=None) -> None:
    """etcd's authentication on at ``base`` (``.../v3``): root, and alice with read-write access to the prefix
    /test/ only."""

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(f"{base}/{path}", data=json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=5, context=context) as r:
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


@pytest.fixture(scope="module")
def etcd_with_auth(tmp_path_factory):
    """etcd over plain HTTP with authentication on (:func:`enable_auth`)."""
    proc, port = start_etcd(str(tmp_path_factory.mktemp("etcd-auth")))
    wait_up(proc, lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=1))
    enable_auth(f"http://127.0.0.1:{port}/v3")
    try:
        yield f"etcd://127.0.0.1:{port}/test"
    finally:
        terminate(proc)


@pytest.fixture(scope="module")
def etcd_tls(tmp_path_factory):
    """etcd over HTTPS with authentication on, its certificate signed by a CA of this file: (port, that CA,
    another CA)."""
    tmp = tmp_path_factory.mktemp("etcd-tls")
    ca_key, ca, key, csr, cert, other_key, other = (str(tmp / n) for n in (
        "ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem", "other.key", "other.pem"))
    ext = tmp / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
                 "-subj", "/CN=etrain-test-ca"],
                ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", other_key, "-out", other, "-days", "2",
                 "-subj", "/CN=another-ca"],
                ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
                ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days",
                 "2", "-extfile", str(ext)]):
        subprocess.run(["openssl", *cmd], check=True, capture_output=True)
    proc, port = start_etcd(str(tmp / "data"), "https", (cert, key))
    try:
        ctx = ssl.create_default_context(cafile=ca)
        wait_up(proc, lambda: urllib.request.urlopen(f"https://127.0.0.1:{port}/version", timeout=1, context=ctx))
        enable_auth(f"https://127.0.0.1:{port}/v3", ctx)
        yield port, ca, other
    finally:
        terminate(proc)


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("ETRAIN_ETCD_USER", "ETRAIN_ETCD_PASSWORD", "ETRAIN_ETCD_CA", "ETRAIN_ETCD_CERT", "ETRAIN_ETCD_KEY",
                "ETRAIN_ETCD_TLS", "ETRAIN_ETCD_INSECURE", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def spec(run_id="r1"):
    return RunSpec(run_id=run_id, config={"run_id": run_id}, workers=2, min_workers=1, max_workers=4)


def test_a_store_with_etcd_authentication_takes_its_user_from_the_environment(etcd_with_auth, clean_env):
    with pytest.raises(StoreUnavailable, match="refused no user.*ETRAIN_ETCD_USER"):
        open_store(etcd_with_auth).list_runs()
    clean_env.setenv("ETRAIN_ETCD_INSECURE", "1")  # plain HTTP on loopback, meant
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


def test_a_password_over_plain_http_is_refused_unless_etrain_etcd_insecure(etcd_with_auth, clean_env, capsys,
                                                                          caplog):
    from checkpointing.errors import ConfigError
    from orchestrator.cli.main import main as etrain

    clean_env.setenv("ETRAIN_ETCD_USER", "alice")
    clean_env.setenv("ETRAIN_ETCD_PASSWORD", PASSWORD)
    with pytest.raises(ConfigError, match="plain HTTP, in the clear.*etcds://.*ETRAIN_ETCD_INSECURE=1") as e:
        open_store(etcd_with_auth)
    assert PASSWORD not in str(e.value)
    capsys.readouterr()
    code = etrain(["status", "--store", etcd_with_auth])  # the CLI: a usage error, exit 2, no traceback
    err = capsys.readouterr().err
    assert code == 2 and "ETRAIN_ETCD_USER and $ETRAIN_ETCD_PASSWORD would be sent over plain HTTP" in err
    assert "Traceback" not in err and PASSWORD not in err
    clean_env.setenv("ETRAIN_ETCD_INSECURE", "1")
    from orchestrator.store import etcd_client

    etcd_client._warned.clear()
    with caplog.at_level("WARNING", logger="etrain"):
        store = open_store(etcd_with_auth)
        store.create_run(spec("insecure"))
    assert "goes over plain HTTP" in caplog.text and PASSWORD not in caplog.text
    assert store.get_spec("insecure").workers == 2
    clean_env.setenv("ETRAIN_ETCD_INSECURE", "maybe")
    with pytest.raises(ConfigError, match="ETRAIN_ETCD_INSECURE='maybe' is not a switch"):
        open_store(etcd_with_auth)


def test_a_store_over_tls_checks_the_servers_certificate_against_etrain_etcd_ca(etcd_tls, clean_env):
    port, ca, other = etcd_tls
    url = f"etcd://127.0.0.1:{port}/test"
    with pytest.raises(StoreUnavailable, match="unreachable"):  # plain HTTP to a TLS server
        open_store(url).list_runs()
    clean_env.setenv("ETRAIN_ETCD_USER", "alice")
    clean_env.setenv("ETRAIN_ETCD_PASSWORD", PASSWORD)
    clean_env.setenv("ETRAIN_ETCD_CA", ca)  # HTTPS: the password may go, no ETRAIN_ETCD_INSECURE needed
    store = open_store(url)
    store.create_run(spec())
    assert store.get_spec("r1").workers == 2
    clean_env.setenv("ETRAIN_ETCD_CA", other)
    with pytest.raises(StoreUnavailable, match="TLS handshake failed.*ETRAIN_ETCD_CA") as e:  # not its signer
        open_store(url).list_runs()
    assert PASSWORD not in str(e.value)


def test_an_etcds_url_talks_https_checked_against_the_systems_trust_store(etcd_tls, clean_env):
    port, ca, _ = etcd_tls
    clean_env.setenv("ETRAIN_ETCD_USER", "alice")
    clean_env.setenv("ETRAIN_ETCD_PASSWORD", PASSWORD)
    url = f"etcds://127.0.0.1:{port}/test"
    with pytest.raises(StoreUnavailable, match="TLS handshake failed.*system's trust store"):  # a private CA
        open_store(url).list_runs()
    clean_env.setenv("SSL_CERT_FILE", ca)  # the system's trust store, as OpenSSL finds it, now holds that CA
    store = open_store(url)
    assert store.url == url
    store.create_run(spec("over-etcds"))
    assert "over-etcds" in store.list_runs()
    clean_env.setenv("ETRAIN_ETCD_TLS", "1")  # the same for an etcd:// URL
    assert "over-etcds" in open_store(f"etcd://127.0.0.1:{port}/test").list_runs()


def test_an_etcds_url_to_a_plain_http_server_fails_its_handshake(etcd_with_auth, clean_env):
    with pytest.raises(StoreUnavailable, match="TLS handshake failed.*speaks TLS"):
        open_store(etcd_with_auth.replace("etcd://", "etcds://")).list_runs()


def test_an_etcds_url_to_a_server_that_resets_the_handshake_names_tls(clean_env):
    """A plain server may answer a TLS hello with a reset (no SSL text in the error): still the handshake."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def reset_each() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # an RST, not a TLS alert

    threading.Thread(target=reset_each, daemon=True).start()
    try:
        with pytest.raises(StoreUnavailable, match="TLS handshake failed.*speaks TLS"):
            open_store(f"etcds://127.0.0.1:{port}/test").list_runs()
    finally:
        server.close()
    with pytest.raises(StoreUnavailable, match="is unreachable"):  # nobody there: not blamed on TLS
        open_store(f"etcds://127.0.0.1:{port}/test").list_runs()
