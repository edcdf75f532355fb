"""The first hour at the command line: thread count, run discovery, ``etrain ckpt`` URLs, aliases, help, output.

No Ray: runs are prepared in a run store with :func:`orchestrator.run.prepare_run_doc` and looked at with the
control commands; the trainer runs as a subprocess for a step or two.
"""

import os
import subprocess
import sys

import pytest

from orchestrator.cli import main as etrain
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


def test_python_m_trainer_reports_threads_and_checkpoint_urls_that_etrain_ckpt_takes(tmp_path, capsys):
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
    from orchestrator.run import prepare_run_doc

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


def test_registry_ignores_a_bad_entry(tmp_path, monkeypatch):
    from orchestrator import registry

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
    code = ("import sys, time; t = time.monotonic(); from orchestrator.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules, round(time.monotonic() - t, 2), file=sys.stderr)")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert "usage: " in r.stdout and "TORCH False" in r.stderr, r.stderr
    if argv == ["train", "--help"]:
        assert "usage: etrain train" in r.stdout and "[CONFIG]" in r.stdout
