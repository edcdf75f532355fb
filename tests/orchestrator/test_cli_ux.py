"""The first hour at the command line: thread count, run discovery, ``etrain ckpt`` URLs, aliases, help, output.

No Ray: runs are prepared in a run store with :func:`orchestrator.driver.run.prepare_run_doc` and looked at with the
control commands; the trainer runs as a subprocess for a step or two.
"""

import json
import os
import subprocess
import sys

import pytest

from orchestrator.cli.main import main as etrain
from tests.harness import ROOT

PY = sys.executable


def _env(**kw):
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "ETRAIN_STORE", "RAY_ADDRESS")}
    e.update(PYTHONPATH=ROOT, **kw)
    return e


# --- 1. the trainer alone picks a thread count -----------------------------------------


def test_trainer_alone_sets_threads_and_says_so(tmp_path):
    code = ("import os, torch; from trainer.cli import pick_threads, usable_cpus; n = pick_threads(); "
            "print(n, torch.get_num_threads(), os.environ['OMP_NUM_THREADS'], usable_cpus())")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, env=_env(ETRAIN_HOME=str(tmp_path)), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    said, (n, used, env, cores) = r.stdout.splitlines()[0], r.stdout.split()[-4:]
    assert said.startswith(f"etrain: {n} compute thread") and "set OMP_NUM_THREADS to choose" in said
    assert n == used == env and int(n) == max(1, int(cores) - 1)
    # A launcher's choice (torchrun, Ray) is kept, silently.
    r = subprocess.run([PY, "-c", code], cwd=ROOT, env=_env(OMP_NUM_THREADS="3"), capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.split()[0::2][:2] == ["None", "3"], r.stdout


def test_python_m_trainer_reports_threads_and_checkpoint_urls_that_etrain_ckpt_takes(tmp_path, capsys, monkeypatch):
    root = f"file://{tmp_path}/ck"  # checkpoint.url, as a config names it
    r = subprocess.run([PY, "-m", "trainer", "examples/tiny.toml", "--set", "train.steps=2", "--set",
                        "metrics.enabled=false", "--set", f"checkpoint.url={root!r}"], cwd=ROOT,
                       env=_env(ETRAIN_HOME=str(tmp_path)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "compute thread" in r.stdout.splitlines()[0]
    step_url = f"{root}/tiny/checkpoints/step_000000002"
    assert f"etrain: checkpoint step 2 committed: {step_url} (" in r.stdout
    # 3. etrain ckpt takes checkpoint.url with --run, the run's directory, or the printed URL.
    for argv in (["ls", root, "--run", "tiny"], ["ls", f"{root}/tiny"], ["verify", root, "--run", "tiny"],
                 ["inspect", step_url]):
        assert etrain(["ckpt", *argv]) == 0, argv
    assert "step_000000002" in capsys.readouterr().out
    # The root alone names its runs; a missing path and an empty run are exit 1 everywhere.
    for cmd in ("ls", "inspect", "verify"):
        assert etrain(["ckpt", cmd, root]) == 1
        assert f"checkpoint root holding the runs tiny; name one: etrain ckpt {cmd} {root} --run tiny" in \
            capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # a root of one path segment names no run: its runs are named all the same
    assert etrain(["ckpt", "ls", "ck"]) == 1 and "root holding the runs tiny" in capsys.readouterr().err
    assert etrain(["ckpt", "ls", "nowhere"]) == 1 and "nothing at nowhere" in capsys.readouterr().err
    (tmp_path / "ck" / "empty" / "checkpoints").mkdir(parents=True)
    for cmd in ("ls", "inspect", "verify"):
        for url in (f"{root}/nope", f"{tmp_path}/nowhere/r"):
            assert etrain(["ckpt", cmd, url]) == 1 and "nothing at" in capsys.readouterr().err
        assert etrain(["ckpt", cmd, root, "--run", "empty"]) == 1
        assert "no " in capsys.readouterr().err
    assert etrain(["ckpt", "ls", root, "--run", "empty", "--json"]) == 1


# --- 2. a run is found from another directory ---------------------------------------------


@pytest.fixture
def prepared_run(tmp_path, monkeypatch):
    from orchestrator.driver.run import prepare_run_doc

    home, here, elsewhere = tmp_path / "home", tmp_path / "project", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("ETRAIN_HOME", str(home))
    monkeypatch.delenv("ETRAIN_STORE", raising=False)
    monkeypatch.chdir(here)
    spec, store = prepare_run_doc({"run_id": "ux1", "train": {"steps": 4}})
    monkeypatch.chdir(elsewhere)
    return store, home


def test_control_commands_find_a_run_from_another_directory(prepared_run, capsys):
    store, home = prepared_run
    assert (home / "runs" / "ux1.json").exists()
    assert etrain(["status", "ux1"]) == 0
    assert "ux1" in capsys.readouterr().out
    assert etrain(["events", "ux1"]) == 0


def test_a_miss_says_where_it_looked(prepared_run, capsys, monkeypatch, tmp_path):
    store, home = prepared_run
    assert etrain(["status", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no run 'nope'" in err and f"{home}/runs" in err and "--store URL or $ETRAIN_STORE" in err
    # --store and $ETRAIN_STORE still win over the registry.
    other = f"file://{tmp_path}/other"
    assert etrain(["status", "ux1", "--store", other]) == 2
    assert "looked in --store" in capsys.readouterr().err
    monkeypatch.setenv("ETRAIN_STORE", other)
    assert etrain(["status", "ux1"]) == 2
    assert "looked in $ETRAIN_STORE" in capsys.readouterr().err


def test_status_lists_the_registered_runs_of_every_store(tmp_path, monkeypatch, capsys):
    """`etrain status`: the runs of the run registry, each read from its own store, beside those of ./runs; a
    store that is not there (etcd on a closed port) and a run its store no longer holds are rows, not a crash."""
    from orchestrator.store import user_runs as registry
    from orchestrator.store.run_store import RunSpec, open_store
    from tests.harness import free_port

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ETRAIN_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    a, b, here, gone = (f"file://{tmp_path}/a", f"file://{tmp_path}/b", f"file://{tmp_path}/runs",
                        f"etcd://127.0.0.1:{free_port()}/etrain")
    for url, run_id in ((a, "a1"), (b, "b1"), (here, "c1")):
        open_store(url).create_run(RunSpec(run_id=run_id, config={}, workers=2, min_workers=1, max_workers=2))
    store = open_store(a)
    store.put_status("a1", {"run_id": "a1", "phase": "RUNNING", "step": 7, "total_steps": 20, "world_size": 2},
                     store.acquire("a1", "ctl"))
    for run_id, url in (("a1", a), ("b1", b), ("u1", gone), ("m1", a)):
        registry.record(run_id, url)
    assert etrain(["status", "--json"]) == 0
    rows = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert {k: (r["phase"], r["store"]) for k, r in rows.items()} == {
        "a1": ("RUNNING", a), "b1": ("PENDING", b), "c1": ("PENDING", here), "u1": ("unreachable", gone),
        "m1": ("missing", a)}
    assert rows["a1"]["step"] == 7 and "is unreachable" in rows["u1"]["reason"]
    assert etrain(["status"]) == 0
    out = capsys.readouterr().out
    assert "store" in out.splitlines()[1] and f"{gone}: etcd at {gone} is unreachable" in out
    assert "7/20" in next(line for line in out.splitlines() if " a1 " in line)
    # One store named: its runs only, as before.
    assert etrain(["status", "--store", b, "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == ["b1"]
    assert etrain(["status", "--store", gone]) == 2  # the one store asked for is not there: an error, as before
    assert f"etrain: etcd at {gone} is unreachable" in capsys.readouterr().err


def test_registry_ignores_a_bad_entry(tmp_path, monkeypatch):
    from orchestrator.store import user_runs as registry

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path))
    assert registry.lookup("r") is None
    registry.record("r", "file:///x/runs")
    assert registry.lookup("r") == "file:///x/runs"
    (tmp_path / "runs" / "r.json").write_text('{"run_id": "other", "store": "file:///y"}')
    assert registry.lookup("r") is None
    (tmp_path / "runs" / "r.json").write_text("[1, 2")
    assert registry.lookup("r") is None


# --- 4. aliases, --version, fast help ----------------------------------------------------------


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        etrain(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"etrain {version('etrain')}"


def test_config_positional_and_option_are_the_same():
    from trainer.cli import parse_args

    assert parse_args(["a.toml"]).config == parse_args(["--config", "a.toml"]).config == "a.toml"
    assert parse_args([]).config is None
    with pytest.raises(SystemExit):
        parse_args(["a.toml", "--config", "b.toml"])


@pytest.mark.parametrize("argv", [["run", "nope.toml"], ["run", "--config", "nope.toml"]])
def test_etrain_run_takes_config_either_way(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path))
    assert etrain(argv) == 2
    assert "config file 'nope.toml' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["run", "--help"], ["ckpt", "--help"]])
def test_help_does_not_import_torch(argv):
    code = ("import sys, time; t = time.monotonic(); from orchestrator.cli.main import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules, round(time.monotonic() - t, 2), file=sys.stderr)")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert "usage: " in r.stdout and "TORCH False" in r.stderr, r.stderr
    if argv == ["train", "--help"]:
        assert "usage: etrain train" in r.stdout and "[CONFIG]" in r.stdout


# --- 5. output --------------------------------------------------------------------------------


def test_progress_and_summary_lines_are_readable():
    from trainer.cli import clock, describe_corpus, format_step, human, summary_line
    from trainer.loop import StepStats

    assert [human(n, "tok/s") for n in (0, 42, 850, 4_370, 12_345, 1_520_000)] == [
        "0 tok/s", "42 tok/s", "850 tok/s", "4.37k tok/s", "12.3k tok/s", "1.52M tok/s"]
    assert [clock(s) for s in (0.94, 75, 3725)] == ["0.9 s", "1:15", "1:02:05"]
    s = StepStats(step=20, loss=3.14159, lr=3e-3, grad_norm=1.0, tokens_per_s=38.0, step_seconds=0.5,
                  data_seconds=0.0, world_size=2, samples_consumed=240)
    assert format_step(s, 200, 2.0) == "step  20/200 | loss 3.1416 | lr 3.00e-03 | 38 tok/s | 2.00 steps/s | " \
                                       "world 2 | ETA 1:30"
    assert format_step(s, 20).endswith("| 2.00 steps/s | world 2")  # the last step: no ETA
    # After a resume from step 6, the summary counts the steps this process ran.
    assert summary_line(7, 9, 1.5, 768, 5.123456, 4.5) == (
        "etrain: trained steps 7-9 (3 after resuming) in 1.5 s, 2.00 steps/s, 1.54k tok/s; loss 5.1235 -> 4.5000")
    assert summary_line(1, 200, 90, 768, 6.0, 2.0).startswith("etrain: trained 200 steps in 1:30, 2.22 steps/s")
    assert describe_corpus({"kind": "text", "files": 671, "tokens": 11354832, "digest": "62", "documents": 671}) == \
        "text, 671 files, 11.4M tokens, documents 671, digest 62"


def test_run_output_is_readable():
    from orchestrator.driver.progress import event_line, info_line

    node = "a1b2c3d4" + "e" * 48
    line = event_line({"kind": "formed", "time": 0, "nodes": [node, node], "world_size": 2})
    assert line == "[formed] nodes=['a1b2c3d4', 'a1b2c3d4'], world_size=2"
    assert info_line({"loss": 3.0, "tokens_per_s": 12345.0, "world_size": 2, "phase": "RUNNING"}) == \
        "loss 3.0000  12.3k tok/s  world 2  RUNNING"
    # Where a recovery or resize restored from, and why not from memory when it did not.
    from orchestrator.driver.progress import describe_event

    rec = {"kind": "recovered", "epoch": 2, "world_before": 2, "world_after": 2, "restored_step": 18,
           "steps_lost": 0, "time_to_recover_s": 0.5, "tier": "memory"}
    assert describe_event(rec) == "[recovered] epoch 2: 2 -> 2 workers, restored step 18 from memory, 0 steps lost, " \
                                  "0.5 s to recover"
    why = "no worker holds a snapshot in memory"
    assert f"restored step 16 from the checkpoint ({why}), 2 steps lost" in describe_event(
        {**rec, "tier": "durable", "tier_reason": why, "restored_step": 16, "steps_lost": 2})


def test_final_report_rounds_the_loss(capsys):
    from orchestrator.cli.main import _report

    assert _report({"run_id": "r", "phase": "FINISHED", "step": 9, "total_steps": 9, "loss": 4.123456789}) == 0
    assert "final loss 4.1235" in capsys.readouterr().out


def test_plain_progress_lines_are_whole_and_carry_an_eta():
    import io

    from rich.console import Console

    from orchestrator.driver.progress import Follower

    out = io.StringIO()
    f = Follower("r", 100, live=False, console=Console(file=out, width=40), every_s=0.0)
    snap = {"step": 10, "total_steps": 100, "loss": 3.0, "tokens_per_s": 5280.0, "world_size": 2, "phase": "RUNNING"}
    with f:
        f.update(snap, [{"kind": "failure", "step": 9, "failure_kind": "worker_died", "message": "x" * 60,
                         "decision": "restart"}])
        f.update({**snap, "step": 20}, [{"kind": "eval", "time": 0, "epoch": 1, "step": 20, "loss": 4.123456}])
        f.update({**snap, "step": 59, "phase": "SUSPENDING"}, [])
        f.update({**snap, "step": 60, "phase": "SUSPENDED"}, [])
        f.update({**snap, "step": 100, "phase": "FINISHED"}, [])
    lines = out.getvalue().splitlines()
    assert len(lines) == 7, lines  # wider than the console, never wrapped
    assert lines[2] == "[eval] step 20 eval loss 4.1235"  # an evaluation: one line of its own
    assert "5.28k tok/s" in lines[3] and " steps/s  ETA " in lines[3]
    assert not any("ETA" in line for line in lines[4:])  # ending, ended early, or done: no time left


def test_plain_progress_lines_show_the_steps_per_second_since_the_line_before(monkeypatch):
    """As tokens/s (the last step's), steps/s is recent: over the steps since the line before, not since the start
    (the ETA stays on the whole run's rate)."""
    import io

    from rich.console import Console

    from orchestrator.driver import progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    f = progress.Follower("r", 100, live=False, console=Console(file=out, width=200), every_s=5.0)
    snap = {"total_steps": 100, "loss": 3.0, "tokens_per_s": 5280.0, "world_size": 2, "phase": "RUNNING"}
    with f:
        for t, step in ((0.0, 10), (10.0, 20), (20.0, 60)):
            now[0] = t
            f.update({**snap, "step": step}, [])
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert "  1.00 steps/s  ETA 1:20" in lines[1]  # 10 steps in 10 s; 80 left at 1.0 steps/s
    assert "  4.00 steps/s  ETA 16.0 s" in lines[2], lines[2]  # 40 steps in the last 10 s; 40 left at 2.5 steps/s


# --- 6. logs, submit (the detached run itself: tried by hand, it needs Ray) ------------------------------


def test_logs_of_a_detached_run(tmp_path, monkeypatch, capsys):
    from orchestrator.store import user_runs as registry

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path))
    assert etrain(["logs", "r"]) == 1
    assert "only `etrain run --detach` keeps one" in capsys.readouterr().err
    # A driver that writes a line, then ends: -f prints everything and returns when it is gone.
    log = registry.log_path("r")
    os.makedirs(os.path.dirname(log))
    proc = subprocess.Popen([PY, "-c", f"import time; time.sleep(0.5); open({log!r}, 'a').write('done\\n')"])
    (tmp_path / "logs" / "r.pid").write_text(str(proc.pid))
    with open(log, "w") as f:
        f.write("started\n")
    assert etrain(["logs", "r", "-f"]) == 0
    proc.wait()
    assert capsys.readouterr().out == "started\ndone\n"


def test_submit_fills_in_the_working_directory_and_store(tmp_path, monkeypatch, capsys):
    import orchestrator.driver.run

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path))
    monkeypatch.delenv("ETRAIN_STORE", raising=False)
    monkeypatch.chdir(ROOT)
    argv = ["submit", "examples/tiny.toml", "--address", "http://head:8265", "--workers", "4"]
    assert etrain(argv) == 2  # ./runs would be in the job's temporary directory
    assert "needs a run store that the cluster and this machine both reach" in capsys.readouterr().err
    jobs = []
    monkeypatch.setattr(orchestrator.driver.run, "submit_job", lambda *a, **kw: jobs.append((a, kw)) or "raysubmit_1")
    assert etrain([*argv, "--store", "etcd://10.0.0.5:2379/etrain", "--set", "train.steps=9"]) == 0
    (address, entry), kw = jobs[0]
    assert address == "http://head:8265" and kw == {"working_dir": "."}
    from orchestrator.service import auth
    from orchestrator.store import user_runs as registry

    # The job gets the run's owner and its token's hash; the token stays in this user's run registry.
    token = registry.token_of("tiny")
    assert entry == ["-m", "orchestrator", "run", "examples/tiny.toml", "--no-progress", "--store",
                     "etcd://10.0.0.5:2379/etrain", "--run-id", "tiny", "--owner", auth.current_user(),
                     "--token-hash", auth.digest(token), "--workers", "4", "--set", "train.steps=9"]
    out = capsys.readouterr().out
    assert "Ray job raysubmit_1" in out and token not in out
    assert registry.lookup("tiny") == "etcd://10.0.0.5:2379/etrain"
    assert etrain(["submit", str(tmp_path / "x.toml"), "--store", "s3://b/runs", "--address", "http://h:8265"]) == 2


# --- 7. a listing cut short by its reader (`| head -1`) -----------------------------------------------------


@pytest.mark.parametrize("argv", [["ckpt", "ls", "{root}/p1"], ["status"], ["status", "p1"], ["events", "p1"],
                                  ["logs", "p1"]])
def test_a_listing_whose_reader_went_away_ends_quietly(argv, tmp_path):
    """`etrain ckpt ls URL | head -1` and the other listings: the reader of stdout is gone before the command
    writes (the pipe's read end is closed first, so the write fails every time): no traceback, status 141."""
    from orchestrator.store import user_runs as registry
    from orchestrator.store.run_store import RunSpec, open_store

    root = f"file://{tmp_path}/runs"
    store = open_store(root)
    store.create_run(RunSpec(run_id="p1", config={"run_id": "p1"}, workers=1, min_workers=1, max_workers=1))
    for step in range(1, 40):
        (tmp_path / "runs" / "p1" / "checkpoints" / f"step_{step:09d}").mkdir(parents=True)
        store.add_event("p1", {"kind": "eval", "time": 1_800_000_000.0 + step, "step": step, "loss": 1.0})
    env = _env(ETRAIN_HOME=str(tmp_path / "home"))
    os.environ["ETRAIN_HOME"], old = env["ETRAIN_HOME"], os.environ["ETRAIN_HOME"]
    try:
        registry.record("p1", root)
        log = registry.log_path("p1")
    finally:
        os.environ["ETRAIN_HOME"] = old
    os.makedirs(os.path.dirname(log))
    with open(log, "w") as f:
        f.write("line\n" * 1000)
    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write fails with EPIPE
    try:
        r = subprocess.run([os.path.join(os.path.dirname(PY), "etrain"), *(a.format(root=root) for a in argv)],
                           cwd=tmp_path, env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == "", r.stderr


def test_a_broken_pipe_that_is_not_stdout_is_an_error():
    """A connection to a server that breaks is not a reader gone away: raised on, not turned into a quiet 141."""
    from checkpointing.cli import quiet_when_pipe_closes

    def talk_to_a_server():
        raise BrokenPipeError(32, "Broken pipe (a socket)")

    with pytest.raises(BrokenPipeError):
        quiet_when_pipe_closes(talk_to_a_server)
    assert quiet_when_pipe_closes(lambda: 3) == 3


def test_demo_with_a_missing_config_exits_2_naming_the_flag_before_ray_starts(tmp_path, capsys, monkeypatch):
    """Before: a traceback (ConfigError from the run's preparation), after a local Ray had started."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        etrain(["demo", "--config", "missing.toml"])
    assert e.value.code == 2 and "--config 'missing.toml' does not exist" in capsys.readouterr().err
    from orchestrator.cli.demo import CHECKOUT, TINY

    assert os.path.isfile(os.path.join(CHECKOUT, TINY))  # the default outside the checkout: its examples/tiny.toml
