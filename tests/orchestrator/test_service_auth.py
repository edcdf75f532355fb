"""Run tokens and the admin token: who may suspend, resume, resize and stop a run (orchestrator.service.auth), through
the `etrain` command as users call it, on a real run store; and where a token may never appear."""

from __future__ import annotations

import json
import os
import stat

import pytest

from orchestrator.service import auth
from orchestrator.store import user_runs as registry
from orchestrator.cli.main import main as etrain
from orchestrator.driver.run import prepare_run
from orchestrator.store.run_store import open_store


@pytest.fixture
def users(tmp_path, monkeypatch):
    """Two users on one store: alice (her run registry in alice/) and bob (his in bob/). ``as_(name)``
    switches this process to that user's home."""
    for var in ("ETRAIN_RUN_TOKEN", "ETRAIN_ADMIN_TOKEN", "ETRAIN_STORE"):
        monkeypatch.delenv(var, raising=False)

    def as_(name: str) -> str:
        home = str(tmp_path / name)
        monkeypatch.setenv("ETRAIN_HOME", home)
        return home

    return as_


@pytest.fixture
def root(tmp_path):
    return f"file://{tmp_path}/runs"


def start(root: str, run_id: str, owner: str):
    """A run started by ``owner`` (prepare_run, as `etrain run` does) whose controller looks alive: it holds
    the lease and has written a RUNNING status."""
    spec, store = prepare_run("examples/tiny.toml", [f'checkpoint.url="{root}"'], run_id=run_id, store=root,
                              owner=owner)
    lease = store.acquire(run_id, "ctl-test", ttl_s=120)
    store.put_status(run_id, {"run_id": run_id, "phase": "RUNNING", "step": 3, "controller_id": "ctl-test"}, lease)
    return spec, store


def cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = etrain(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_new_run_gets_a_token_only_its_owners_registry_holds(users, root, capsys):
    home = users("alice")
    spec, store = start(root, "a1", owner="alice")
    token = registry.token_of("a1")
    assert token and len(token) >= 40 and spec.owner == "alice"
    assert store.get_spec("a1").token_hash == auth.digest(token)  # the store keeps the hash only
    path = os.path.join(home, "runs", "a1.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    users("bob")
    assert registry.token_of("a1") is None


def test_another_owners_token_cannot_suspend_a_run_its_owners_can(users, root, capsys, monkeypatch):
    users("bob")
    start(root, "b1", owner="bob")
    bobs = registry.token_of("b1")
    users("alice")
    start(root, "a1", owner="alice")
    store = open_store(root)
    users("bob")  # bob, with his own run's token, on alice's run
    code, out = cli(capsys, "suspend", "a1", "--store", root, "--no-wait", "--token", bobs)
    assert code == 2 and "run 'a1' belongs to alice" in out and "--token" in out and "Traceback" not in out
    assert bobs not in out
    code, out = cli(capsys, "resize", "a1", "--workers", "1", "--store", root)  # no token of his for it at all
    assert code == 2 and "belongs to alice" in out
    monkeypatch.setenv("ETRAIN_RUN_TOKEN", bobs)
    code, out = cli(capsys, "stop", "a1", "--store", root, "--no-wait")
    monkeypatch.delenv("ETRAIN_RUN_TOKEN")
    assert code == 2 and "ETRAIN_RUN_TOKEN" in out
    spec = store.get_spec("a1")
    assert not spec.suspended and not spec.stop and spec.workers == 2 and spec.generation == 0
    users("alice")  # the owner: her token is found in her run registry, as before tokens existed
    code, out = cli(capsys, "suspend", "a1", "--store", root, "--no-wait")
    assert code == 0, out
    assert store.get_spec("a1").suspended


def test_an_admin_token_may_change_any_run_and_only_an_admin_replaces_it(users, root, capsys, monkeypatch):
    users("alice")
    start(root, "a1", owner="alice")
    store = open_store(root)
    admin_home = users("admin")
    code, out = cli(capsys, "admin-token", "--store", root)
    assert code == 0, out
    path = os.path.join(admin_home, "admin_token")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as f:
        admin = f.read().strip()
    assert admin not in out
    code, out = cli(capsys, "resize", "a1", "--workers", "1", "--store", root)  # the admin, from the file
    assert code == 0, out
    assert store.get_spec("a1").workers == 1
    users("bob")
    code, out = cli(capsys, "admin-token", "--store", root)  # bob cannot take the admin's place
    assert code == 2 and "replacing it needs the current one" in out
    monkeypatch.setenv("ETRAIN_ADMIN_TOKEN", admin)  # the admin elsewhere: the token in the environment
    code, out = cli(capsys, "suspend", "a1", "--store", root, "--no-wait")
    assert code == 0, out
    assert store.get_spec("a1").suspended


def test_the_python_api_run_carries_its_token(users, root):
    from etrain import Run

    users("alice")
    start(root, "a1", owner="alice")
    token = registry.token_of("a1")
    users("bob")
    with pytest.raises(auth.NotAuthorized, match="belongs to alice"):
        Run("a1", root).resize(1)
    Run("a1", root, token=token).resize(1)
    assert "token" not in repr(Run("a1", root, token=token).__dict__.get("_bg"))
    assert open_store(root).get_spec("a1").workers == 1


def test_a_token_never_appears_in_the_store_its_events_or_what_etrain_prints(users, root, tmp_path, capsys):
    users("alice")
    _, store = start(root, "a1", owner="alice")
    token = registry.token_of("a1")
    for args in (("suspend", "a1", "--no-wait"), ("status", "a1", "--json"), ("status",), ("events", "a1", "--json"),
                 ("resize", "a1", "--workers", "1", "--token", token)):
        code, out = cli(capsys, *args, "--store", root)
        assert token not in out, args
    store.add_event("a1", {"kind": "note"})
    status = store.get_status("a1")
    assert token not in json.dumps(status) and token not in json.dumps(store.events("a1"))
    for dirpath, _, files in os.walk(tmp_path / "runs"):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert token.encode() not in f.read(), os.path.join(dirpath, name)


def test_a_submitted_job_gets_the_hash_and_never_the_token(users, root, monkeypatch):
    """What `etrain submit` forwards to the job: its hash on the command line, no token in the environment."""
    users("alice")
    monkeypatch.setenv("ETRAIN_RUN_TOKEN", "t-secret")
    monkeypatch.setenv("ETRAIN_ADMIN_TOKEN", "a-secret")
    monkeypatch.setenv("ETRAIN_ETCD_USER", "alice")
    env = auth.job_env()
    assert "ETRAIN_RUN_TOKEN" not in env and "ETRAIN_ADMIN_TOKEN" not in env and env["ETRAIN_ETCD_USER"] == "alice"
    token = auth.mint()
    registry.record("s1", root, token=token)  # what etrain submit keeps on the submitting machine
    spec, _ = prepare_run("examples/tiny.toml", [f'checkpoint.url="{root}"'], run_id="s1", store=root,
                          token_hash=auth.digest(token), owner="alice")  # the job's driver, same registry
    assert spec.token_hash == auth.digest(token) and registry.token_of("s1") == token  # kept, not lost
    with pytest.raises(Exception, match="--token-hash"):
        prepare_run("examples/tiny.toml", [f'checkpoint.url="{root}"'], run_id="s2", store=root, token_hash="x")
