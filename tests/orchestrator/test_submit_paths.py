"""``etrain submit``: the local paths a run names, as its Ray job must be given them.

A job runs in a temporary copy of ``--working-dir`` on the cluster's machines: a relative
``checkpoint.url`` or run store there would be inside that copy (and lost with it). They are made
absolute ``file://`` URLs against the submitting directory when the cluster reaches them (the cluster
is on this machine, or the path is on a shared filesystem named in ``$ETRAIN_SHARED_PATHS``), and
refused otherwise, naming the fix. Relative data paths are given relative to the job's working
directory. The job itself is not started: ``submit_job`` (the Ray dashboard) is replaced by a list.
"""

from __future__ import annotations

import json

import pytest

from orchestrator.cli.main import main as etrain

LOCAL, REMOTE = "http://127.0.0.1:8265", "http://head.example:8265"


@pytest.fixture
def submitted(tmp_path, monkeypatch):
    """A directory holding a run config, made current; returns the list the "submitted" jobs go to."""
    import orchestrator.driver.run

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    for name in ("ETRAIN_STORE", "ETRAIN_SHARED_PATHS", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "run.toml").write_text('run_id = "p"\n[model]\npreset = "tiny"\n')
    monkeypatch.chdir(tmp_path / "proj")
    jobs: list = []
    monkeypatch.setattr(orchestrator.driver.run, "submit_job",
                        lambda address, entry, **kw: jobs.append({"address": address, "entry": entry, **kw}) or "j1")
    return jobs


def options(entry: list[str]) -> tuple[str, dict[str, str]]:
    """The job entrypoint's --store and its --set overrides (field -> raw value)."""
    sets = [entry[i + 1] for i, a in enumerate(entry) if a == "--set"]
    return entry[entry.index("--store") + 1], dict(s.partition("=")[::2] for s in sets)


def test_a_relative_checkpoint_url_becomes_this_directorys_on_a_cluster_on_this_machine(submitted, tmp_path):
    from orchestrator.store import user_runs as registry

    assert etrain(["submit", "run.toml", "--address", LOCAL, "--set", 'checkpoint.url="ckpt"']) == 0
    store, sets = options(submitted[0]["entry"])
    want = f"file://{tmp_path}/proj/ckpt"
    assert store == want and json.loads(sets["checkpoint.url"]) == want  # the last --set: it wins
    assert submitted[0]["entry"][-2:] == ["--set", f"checkpoint.url={json.dumps(want)}"]
    assert registry.lookup("p") == want  # `etrain status p` / `etrain ckpt ls` find it from anywhere


def test_an_unset_checkpoint_url_is_this_directorys_runs_on_a_cluster_on_this_machine(submitted, tmp_path):
    assert etrain(["submit", "run.toml", "--address", "http://localhost:8265"]) == 0
    store, sets = options(submitted[0]["entry"])
    assert store == f"file://{tmp_path}/proj/runs" and json.loads(sets["checkpoint.url"]) == store


@pytest.mark.parametrize("given", ["ckpt", "file://ckpt", "./ckpt"])
def test_a_local_checkpoint_url_is_refused_for_a_cluster_elsewhere_naming_the_fix(given, submitted, capsys):
    assert etrain(["submit", "run.toml", "--address", REMOTE, "--set", f"checkpoint.url={json.dumps(given)}"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.url is " in err and "/proj/ckpt" in err, err
    assert "s3://" in err and "ETRAIN_SHARED_PATHS" in err and not submitted, err


def test_a_path_on_a_shared_filesystem_the_user_names_is_reached_from_anywhere(submitted, tmp_path, monkeypatch):
    monkeypatch.setenv("ETRAIN_SHARED_PATHS", f"/nonexistent:{tmp_path}")
    assert etrain(["submit", "run.toml", "--address", REMOTE, "--set", 'checkpoint.url="ckpt"']) == 0
    assert options(submitted[0]["entry"])[0] == f"file://{tmp_path}/proj/ckpt"
    monkeypatch.setenv("ETRAIN_SHARED_PATHS", f"{tmp_path}/pro")  # a prefix of the name is not its directory
    assert etrain(["submit", "run.toml", "--address", REMOTE, "--set", 'checkpoint.url="ckpt"']) == 2


def test_an_absolute_file_store_is_accepted_by_the_same_rules(submitted, tmp_path, capsys):
    store = f"file://{tmp_path}/proj/runs"  # file://$PWD/runs: the same directory as ./runs, named absolutely
    assert etrain(["submit", "run.toml", "--address", LOCAL, "--store", store]) == 0
    assert options(submitted[0]["entry"])[0] == store
    assert etrain(["submit", "run.toml", "--address", REMOTE, "--store", store,
                   "--set", 'checkpoint.url="s3://b/runs"']) == 2
    err = capsys.readouterr().err
    assert "run store" in err and f"{tmp_path}/proj/runs" in err and "./runs would" not in err, err


def test_a_store_elsewhere_with_no_checkpoint_url_warns_that_its_checkpoints_would_be_lost(submitted, capsys):
    assert etrain(["submit", "run.toml", "--address", REMOTE, "--store", "etcd://10.0.0.5:2379/etrain"]) == 0
    assert "checkpoint.url" not in options(submitted[0]["entry"])[1]
    assert "checkpoints will be lost" in capsys.readouterr().err


def test_relative_data_paths_are_given_relative_to_the_jobs_working_directory(submitted, tmp_path, capsys):
    (tmp_path / "proj" / "data").mkdir()
    argv = ["submit", "proj/run.toml", "--address", LOCAL, "--working-dir", "proj"]
    import os

    os.chdir(tmp_path)
    assert etrain([*argv, "--set", 'data.source="proj/data/*.txt"']) == 0
    assert json.loads(options(submitted[0]["entry"])[1]["data.source"]) == "data/*.txt"
    assert etrain([*argv, "--set", 'data.source="other/x.txt"']) == 2  # outside the working directory
    err = capsys.readouterr().err
    assert "data.source='other/x.txt' is outside --working-dir proj" in err, err


def test_what_is_local_and_what_is_a_local_path():
    from orchestrator.driver.job_paths import cluster_is_local, local_path

    assert [cluster_is_local(a) for a in ("http://127.0.0.1:8265", "127.0.0.1:6379", "localhost:6379",
                                          "http://[::1]:8265", "http://10.0.0.5:8265", "head:6379")] == \
        [True, True, True, True, False, False]
    assert [local_path(u) for u in ("runs", "/abs", "file://runs", "file:///abs", "s3://b/x",
                                    "simplecache::s3://b/x", "etcd://h:2379/p")] == \
        ["runs", "/abs", "runs", "/abs", None, None, None]
