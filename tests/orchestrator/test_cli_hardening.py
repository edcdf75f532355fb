"""What a clumsy or hostile tenant of a shared store meets in `etrain`: one resize for the CLI and the Python API,
stores this user may read but not write, `etrain top` over http(s) only, stored text that carries escape
sequences or rich markup, a bad run beside good ones, `etrain chaos` without the run's token, and a run
registry directory made too wide.

Real file stores in ``tmp_path``; read-only access is the local disk refusing writes with EACCES (these tests
may run as root, for whom a mode 0555 directory is still writable).
"""

from __future__ import annotations

import errno
import http.server
import json
import os
import stat
import threading
import time

import pytest

from checkpointing.storage.local import LocalBackend
from orchestrator.cli.main import main as etrain
from orchestrator.driver.run import prepare_run
from orchestrator.store import user_runs as registry
from orchestrator.store.documents import RunSpec
from orchestrator.store.run_store import open_store

ESC = "\x1b"


@pytest.fixture
def home(tmp_path, monkeypatch):
    for var in ("ETRAIN_RUN_TOKEN", "ETRAIN_ADMIN_TOKEN", "ETRAIN_STORE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def root(tmp_path):
    return f"file://{tmp_path}/runs"


def live_run(root: str, run_id: str = "a1", owner: str = "alice"):
    """A run `etrain run` recorded (its token in this user's registry) whose controller looks alive."""
    spec, store = prepare_run("examples/tiny.toml", [f'checkpoint.url="{root}"'], run_id=run_id, store=root,
                              owner=owner)
    lease = store.acquire(run_id, "ctl-test", ttl_s=120)
    store.put_status(run_id, {"run_id": run_id, "phase": "RUNNING", "step": 3, "world_size": 2,
                              "controller_id": "ctl-test"}, lease)
    return spec, store


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = etrain(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def read_only(monkeypatch) -> None:
    """Every write to a local disk refused, as on a store this user may only read."""
    def refuse(self, rel, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", self.path(rel))

    monkeypatch.setattr(LocalBackend, "write_if", refuse)
    monkeypatch.setattr(LocalBackend, "write", refuse)


# --- one resize ----------------------------------------------------------------------------------------------


def test_the_python_apis_resize_clears_the_allocators_target_and_requeue(home, root):
    from etrain import ConfigError, Run

    _, store = live_run(root)
    store.update_spec("a1", target=2, requeue=True)  # the allocator set a target, then requeued the run
    Run("a1", root).resize(1)  # this user's registry holds the run's token
    spec = store.get_spec("a1")
    assert (spec.workers, spec.target, spec.requeue) == (1, 0, False)
    for bad in (5, 0, True, "2"):  # 5: no valid size (a size beyond max_workers raises it)
        with pytest.raises(ConfigError, match="workers="):
            Run("a1", root).resize(bad)
    assert store.get_spec("a1").generation == spec.generation  # nothing written


def test_etrain_resize_writes_the_same_three_fields(home, root, capsys):
    _, store = live_run(root)
    store.update_spec("a1", target=2, requeue=True)
    code, _, err = cli(capsys, "resize", "a1", "--workers", "1", "--store", root)
    assert code == 0, err
    spec = store.get_spec("a1")
    assert (spec.workers, spec.target, spec.requeue) == (1, 0, False)
    code, _, err = cli(capsys, "resize", "a1", "--workers", "5", "--store", root)
    assert code == 2 and "--workers 5 is not a valid size" in err


# --- a store this user may read but not write ------------------------------------------------------------------


def test_a_read_only_store_is_shown_and_not_written(home, root, capsys, monkeypatch):
    _, store = live_run(root)
    store.release(store.acquire("a1", "ctl-test", ttl_s=120))  # its controller is gone...
    raw, _ = store.read_versioned("a1", "status")
    old = {**json.loads(raw), "updated_unix": time.time() - 3600}  # ...an hour ago
    store.write_if("a1", "status", json.dumps(old), store.read_versioned("a1", "status")[1])
    read_only(monkeypatch)
    for args in (("status", "a1"), ("status",)):
        code, out, err = cli(capsys, *args, "--store", root)
        assert code == 0 and "INTERRUPTED" in out and "Traceback" not in err, (args, out, err)
    assert json.loads(store.read_versioned("a1", "status")[0])["phase"] == "RUNNING"  # shown, not marked


@pytest.mark.parametrize("argv", [["suspend", "--no-wait"], ["stop", "--no-wait"], ["resize", "--workers", "1"]])
def test_control_commands_on_a_read_only_store_say_so(home, root, capsys, monkeypatch, argv):
    live_run(root)
    read_only(monkeypatch)
    code, _, err = cli(capsys, argv[0], "a1", *argv[1:], "--store", root)
    assert code == 2 and f"the run store {root} is not writable by this user" in err, err
    assert "Traceback" not in err


def test_an_existing_registry_directory_is_made_private(home, root):
    runs = home / "runs"
    runs.mkdir(parents=True)
    os.chmod(runs, 0o755)
    registry.record("a1", root, token="etr_x")
    assert stat.S_IMODE(os.stat(runs).st_mode) == 0o700


# --- etrain top ------------------------------------------------------------------------------------------------


def run_with_status(root: str, run_id: str = "r1", **status):
    store = open_store(root)
    store.create_run(RunSpec(run_id=run_id, config={}, workers=1, min_workers=1, max_workers=1))
    status = {"run_id": run_id, "phase": "RUNNING", "updated_unix": time.time(), **status}  # a live run's
    store.write_if(run_id, "status", json.dumps(status), None)
    return store


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://x", "http://", "/etc/passwd"])
def test_top_reads_http_endpoints_only(home, root, capsys, url):
    run_with_status(root, metrics_url=url)
    code, out, err = cli(capsys, "top", "r1", "--once", "--store", root)
    assert code == 2 and "metrics_url" in err and "not an http:// or https:// URL" in err, err
    assert "root:" not in out + err
    code, out, err = cli(capsys, "top", "--url", url, "--once")
    assert code == 2 and "--url=" in err


@pytest.fixture
def endpoint():
    """A local HTTP server: /big answers 9 MiB, /redirect sends to file:///etc/passwd, / a metric."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "file:///etc/passwd")
                self.end_headers()
                return
            body = b"# x\n" * (9 * 2**18) if self.path == "/big" else \
                b'etrain_step{run_id="r1"} 5\netrain_phase{phase="[bold]RUNNING\\u001b"} 1\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_top_caps_what_it_reads_and_follows_no_redirect_off_http(capsys, endpoint):
    code, out, err = cli(capsys, "top", "--url", f"{endpoint}/big", "--once", "--interval", "0")
    assert code == 1 and "over 8 MiB" in out, out + err
    code, out, err = cli(capsys, "top", "--url", f"{endpoint}/redirect", "--once", "--interval", "0")
    assert code == 1 and "root:" not in out + err, out + err
    code, out, err = cli(capsys, "top", "--url", f"{endpoint}/", "--once", "--interval", "0")
    assert code == 0 and "[bold]RUNNING" in out and ESC not in out, out + err


# --- stored text on the terminal ----------------------------------------------------------------------------------


def test_escape_sequences_and_markup_in_stored_text_are_shown_not_acted_on(home, root, capsys):
    store = run_with_status(root, reason="done\x1b[2J\x9b31m [red]red[/red]\nsecond line", team="t[bold]x\x1b]0;",
                            owner="\x1b[5m", queue_reason="\x07bell")
    store.add_event("r1", {"kind": "failure", "step": 1, "failure_kind": "\x1b[31mkill", "message": "[b]m[/b]\u202e"})
    store.add_event("r1", {"kind": "note\x1b", "what": "\x00"})
    outs = [cli(capsys, *args, "--store", root) for args in (("status", "r1"), ("status",), ("queue",),
                                                             ("events", "r1"), ("status", "r1", "--json"))]
    for code, out, err in outs:
        assert code == 0 and ESC not in out + err and "\x9b" not in out and "\x07" not in out, (out, err)
    status_out, _, queue_out, events_out, _ = (o for _, o, _ in outs)
    assert "\\x1b[2J" in status_out and "[red]red[/red]" in status_out and "second line" in status_out
    assert "t[bold]x\\x1b]0;" in queue_out
    assert "\\x1b[31mkill" in events_out and "[b]m[/b]\\u202e" in events_out and "[note\\x1b]" in events_out


# --- a bad run beside good ones ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ['{"phase": "BOGUS"}', '{"phase": "RUNNING", "goodput": "x"}',
                                 '{"phase": "QUEUED", "priority": 1e999}', '{"phase": "QUEUED", "queued_unix": "y"}',
                                 '{"phase": "RUNNING", "updated_unix": 1e400}', "[" * 100000, "{oops"])
def test_a_bad_run_is_unreadable_alone(home, root, capsys, bad):
    run_with_status(root, "good", step=7)
    store = run_with_status(root, "bad")
    store.write_if("bad", "status", bad, store.read_versioned("bad", "status")[1])
    registry.record("good", root)
    registry.record("bad", root)
    for args in (("status", "--store", root), ("status",)):
        code, out, err = cli(capsys, *args)
        assert code == 2 and "good" in out and "RUNNING" in out and "unreachable" not in out + err, (out, err)
        assert "bad" in out and "unreadable" in out and "run 'bad'" in err and "status.json" in err, (out, err)
    code, out, err = cli(capsys, "queue", "--store", root)
    assert code == 0 and "good" in out and "run 'bad'" in err and "unreadable" in err, (out, err)
    code, out, err = cli(capsys, "status", "bad", "--store", root)
    assert code == 2 and "status.json" in err and "Traceback" not in err


def test_an_allocator_document_that_is_not_etrains_is_passed_over_by_queue_and_quota(home, root, capsys):
    store = run_with_status(root, "q1", phase="QUEUED", queued_unix=time.time() - 5)
    store.write_if(None, "allocator", json.dumps({"waiting": ["q1"], "targets": {"q1": "many", "q2": 2},
                                                  "teams": {"q2": "\x1b[2Jvision"}}), None)
    code, out, err = cli(capsys, "queue", "--store", root)
    assert code == 0 and "q1" in out, err
    code, out, err = cli(capsys, "quota", "--store", root, "--json")  # entry by entry: what is not one is left out
    assert code == 0 and json.loads(out)["teams"] == {"\x1b[2Jvision": {"held": 2, "max_workers": None}}, (out, err)
    code, out, err = cli(capsys, "quota", "--store", root)
    assert code == 0 and "\x1b" not in out and "many" not in out, out


# --- etrain chaos needs the run's token ------------------------------------------------------------------------------


def test_chaos_needs_the_runs_token(home, root, capsys, monkeypatch, tmp_path):
    live_run(root)
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "bob"))  # another user: no token of this run
    code, _, err = cli(capsys, "chaos", "a1", "--fault", "kind=kill_worker,at_step=10", "--store", root)
    assert code == 2 and "belongs to alice" in err and "--token" in err, err
