"""Run tokens and the admin token: who may suspend, resume, resize and stop a run (orchestrator.service.auth), through
the `etrain` command as users call it, on a real run store; and where a token may never appear."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from orchestrator.cli.main import main as etrain
from orchestrator.driver.run import prepare_run
from orchestrator.service import auth
from orchestrator.store import user_runs as registry
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
    path = auth.admin_token_file(store)
    assert path.startswith(os.path.join(admin_home, "admin_tokens", "")) and path in out
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
        _, out = cli(capsys, *args, "--store", root)
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


def test_each_store_has_its_own_admin_token_file_and_one_never_replaces_anothers(users, tmp_path, capsys):
    roots = [f"file://{tmp_path}/one/runs", f"file://{tmp_path}/two/runs"]
    users("alice")
    for i, r in enumerate(roots):
        start(r, f"a{i}", owner="alice")
    home = users("admin")
    paths = []
    for r in roots:
        code, out = cli(capsys, "admin-token", "--store", r)
        assert code == 0, out
        paths.append(auth.admin_token_file(open_store(r)))
    assert paths[0] != paths[1] and all(os.path.dirname(p) == os.path.join(home, "admin_tokens") for p in paths)
    assert "one_runs" in os.path.basename(paths[0])  # a readable name, then the URL's hash
    assert stat.S_IMODE(os.stat(os.path.dirname(paths[0])).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in paths)
    assert not os.path.exists(os.path.join(home, "admin_token"))  # the single file of earlier versions: never written
    for i, r in enumerate(roots):  # the first store's admin still administers it after the second's token was made
        code, out = cli(capsys, "resize", f"a{i}", "--workers", "1", "--store", r)
        assert code == 0, out
        auth.authorize_admin(open_store(r), None, "a quota")
    with open(paths[0]) as f:
        first = f.read().strip()
    os.remove(paths[1])
    with pytest.raises(auth.NotAuthorized, match="needs the admin token of"):  # one store's token is not another's
        auth.authorize_admin(open_store(roots[1]), first, "a quota")
    assert auth.admin_token_file("etcds://h:2379/etrain") == auth.admin_token_file("etcd://h:2379/etrain")


def test_the_single_admin_token_file_of_earlier_versions_is_still_read(users, root, capsys):
    users("alice")
    _, store = start(root, "a1", owner="alice")
    home = users("admin")
    old = auth.mint()
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, "admin_token"), "w") as f:  # as earlier versions kept it
        f.write(old + "\n")
    auth.init_admin(store, old)
    code, out = cli(capsys, "suspend", "a1", "--store", root, "--no-wait")
    assert code == 0, out
    auth.authorize_admin(store, None, "a quota")
    path = auth.new_admin_token(store)  # replacing it: the old token, found in the old file, allows it
    with open(os.path.join(home, "admin_token")) as f:
        assert f.read().strip() == old  # left as it was
    with open(path) as f:
        assert auth.admin_hash(store) == auth.digest(f.read().strip())


def test_a_resume_grant_works_once_and_only_until_its_expiry(users, root):
    users("alice")
    _, store = start(root, "a1", owner="alice")
    users("bob")  # the submitted job: no token of the run, only the grant
    grant = auth.mint_grant()
    assert auth.grant_expiry(grant) == pytest.approx(time.time() + auth.GRANT_LIFETIME_S, abs=5)
    store.update_spec("a1", resume_grant=auth.digest(grant))
    spec = store.get_spec("a1")
    assert auth.authorize(store, spec, grant=grant) == "grant"
    with pytest.raises(auth.NotAuthorized, match="expired at"):  # an hour later
        auth.authorize(store, spec, grant=grant, now=time.time() + auth.GRANT_LIFETIME_S + 1)
    auth.change_run(store, "a1", {"suspended": False}, grant=grant)
    with pytest.raises(auth.NotAuthorized, match="belongs to alice"):  # used: gone
        auth.change_run(store, "a1", {"suspended": False}, grant=grant)
    stale = auth.mint_grant(lifetime_s=-1)
    store.update_spec("a1", resume_grant=auth.digest(stale))
    with pytest.raises(auth.NotAuthorized, match="expired at .*etrain resume --submit"):
        auth.change_run(store, "a1", {"suspended": False}, grant=stale)
    forged = stale.replace(str(auth.grant_expiry(stale)), str(auth.grant_expiry(stale) + 7200), 1)
    with pytest.raises(auth.NotAuthorized, match="belongs to alice"):  # the hash covers the expiry
        auth.change_run(store, "a1", {"suspended": False}, grant=forged)
    plain = auth.mint()  # a grant without an expiry is not one
    store.update_spec("a1", resume_grant=auth.digest(plain))
    with pytest.raises(auth.NotAuthorized, match="carries no expiry"):
        auth.change_run(store, "a1", {"suspended": False}, grant=plain)


def test_secrets_are_withheld_from_an_environment_for_the_block_only():
    env = {"ETRAIN_RUN_TOKEN": "t", "ETRAIN_ADMIN_TOKEN": "a", "ETRAIN_RESUME_GRANT": "g", "ETRAIN_ETCD_USER": "u"}
    with auth.secrets_withheld(env):
        assert env == {"ETRAIN_ETCD_USER": "u"}
    assert env["ETRAIN_RUN_TOKEN"] == "t" and env["ETRAIN_RESUME_GRANT"] == "g"


@pytest.mark.ray
def test_a_local_runs_workers_never_see_the_shells_tokens(tmp_path):
    """A local Ray started by `etrain run` (driver.run.connect) and its workers inherit the environment of
    the process that starts it: not its tokens."""
    script = (
        "import os, ray\n"
        "from orchestrator.driver.run import connect\n"
        "connect(None, 1)\n"
        "assert os.environ['ETRAIN_RUN_TOKEN'] == 'run-secret'\n"  # the driver keeps its own
        "seen = ray.get(ray.remote(lambda: {k: os.environ.get(k) for k in "
        "('ETRAIN_RUN_TOKEN', 'ETRAIN_ADMIN_TOKEN', 'ETRAIN_ETCD_USER')}).remote())\n"
        "print('SEEN', sorted((k, v) for k, v in seen.items() if v))\n"
        "ray.shutdown()\n")
    env = {**os.environ, "ETRAIN_RUN_TOKEN": "run-secret", "ETRAIN_ADMIN_TOKEN": "admin-secret",
           "ETRAIN_ETCD_USER": "alice", "ETRAIN_HOME": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SEEN [('ETRAIN_ETCD_USER', 'alice')]" in out.stdout
