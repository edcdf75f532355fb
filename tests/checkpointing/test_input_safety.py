"""Input that could reach storage unsafely is refused with one clear line (exit 2), before anything is written.

Run ids become path components and etcd keys; floats steer the optimizer and the timeouts; URLs are
logged and kept in the run's spec; run-store documents are read back from storage. Each is checked
where it enters: the config (``python -m trainer``), the ``etrain`` command, ``prepare_run`` and both
run stores (a real etcd, and real files for the storage backend).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid

import pytest

from checkpointing.errors import ConfigError
from orchestrator.cli.main import main as etrain_main
from orchestrator.config import ElasticConfig, elastic_from_raw, recovery_from_raw
from orchestrator.store.run_store import CorruptRunStore, Lease, RunSpec, open_store
from tests.harness import ROOT
from trainer.config import SECTIONS, TrainConfig
from trainer.config.load import load_config

PY = sys.executable
CONFIG = os.path.join(ROOT, "examples", "tiny.toml")
SECRET_URL = "s3://AKIAXXXX:SUPERSECRET@bucket/x"

BAD_RUN_IDS = [".", "..", "a/b", "x" * 300, "a\tb", "a\nb", "a\u200fb", "-lead"]
BAD_IDS = pytest.mark.parametrize("bad", BAD_RUN_IDS, ids=["dot", "dotdot", "slash", "300-chars", "tab", "newline",
                                                           "rtl-mark", "leading-dash"])


def run_module(module: str, args: list[str], cwd: str = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    # WORLD_SIZE=2 with no peer at MASTER_PORT: a run that got as far as a process group would hang, not exit 2.
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
             MASTER_PORT="1")
    e.update(env or {})
    return subprocess.run([PY, "-m", module, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=120)


def etrain(argv: list[str], capsys) -> tuple[int, str, str]:
    """``etrain ARGV`` in this process: exit status, stdout, stderr."""
    try:
        code = etrain_main(argv)
    except SystemExit as e:  # argparse refuses a bad argument with exit 2
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def tree(path) -> list[str]:
    """Every file and directory under ``path``, relative to it."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def spec(run_id: str = "r1") -> RunSpec:
    return RunSpec(run_id=run_id, config={"run_id": run_id}, workers=2, min_workers=1, max_workers=4)


# --- 1. run ids -----------------------------------------------------------------------


@BAD_IDS
def test_config_refuses_unsafe_run_id(bad):
    r = run_module("trainer", ["--config", CONFIG, "--set", f"run_id={bad}"])
    assert r.returncode == 2, r.stderr
    assert "run_id=" in r.stderr and "is not a valid run id" in r.stderr
    assert "Traceback" not in r.stderr


@BAD_IDS
def test_cli_refuses_unsafe_run_id_everywhere(bad, tmp_path, capsys):
    store = f"file://{tmp_path}/runs"
    before = tree(tmp_path)
    commands = [["status", "--store", store, "--", bad], ["events", "--store", store, "--", bad],
                ["suspend", "--no-wait", "--store", store, "--", bad],
                ["stop", "--no-wait", "--store", store, "--", bad],
                ["resume", "--store", store, "--", bad], ["resize", "--workers", "2", "--store", store, "--", bad],
                ["top", "--once", "--store", store, "--", bad], ["chaos", "--store", store, "--", bad],
                ["chaos", f"--reference={bad}", "--store", store, "--", "r1"],
                ["run", CONFIG, "--store", store, f"--run-id={bad}"]]
    for argv in commands:
        code, _, err = etrain(argv, capsys)
        assert code == 2, (argv, err)
        assert "is not a valid run id" in err, (argv, err)
    assert tree(tmp_path) == before


def test_etrain_status_dotdot_exits_2(tmp_path):
    r = run_module("orchestrator", ["status", "..", "--store", f"file://{tmp_path}/runs"])
    assert r.returncode == 2, r.stderr
    assert "RUN='..' is not a valid run id" in r.stderr and "Traceback" not in r.stderr


@BAD_IDS
def test_prepare_run_writes_nothing_for_unsafe_run_id(bad, tmp_path):
    from orchestrator.driver.run import prepare_run

    root = tmp_path / "runs"
    before = tree(tmp_path)
    with pytest.raises(ConfigError, match="--run-id=.* is not a valid run id"):
        prepare_run(CONFIG, [], run_id=bad, store=f"file://{root}")
    assert tree(tmp_path) == before
    # The same id from the config file (no --run-id) is refused as well.
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"run_id = {json.dumps(bad)}\n")
    before = tree(tmp_path)
    with pytest.raises(ConfigError, match="run_id=.* is not a valid run id"):
        prepare_run(str(cfg), [], store=f"file://{root}")
    assert tree(tmp_path) == before
    assert not any(p.name == "spec.json" for p in tmp_path.rglob("*"))


def test_prepare_resume_refuses_unsafe_run_id(tmp_path):
    from orchestrator.driver.run import prepare_resume

    with pytest.raises(ConfigError, match="run_id='..' is not a valid run id"):
        prepare_resume("..", f"file://{tmp_path}/runs", None)
    assert tree(tmp_path) == []


@BAD_IDS
def test_run_stores_refuse_unsafe_run_id(bad, store, tmp_path):
    lease = Lease(bad, "c1", 10.0)
    calls = {
        "create_run": lambda: store.create_run(spec(bad)),
        "get_spec": lambda: store.get_spec(bad),
        "update_spec": lambda: store.update_spec(bad, workers=3),
        "check_resumable": lambda: store.check_resumable(bad),
        "get_status": lambda: store.get_status(bad),
        "put_status": lambda: store.put_status(bad, {"phase": "RUNNING"}, lease),
        "add_event": lambda: store.add_event(bad, {"kind": "failure"}),
        "events": lambda: store.events(bad),
        "put_history": lambda: store.put_history(bad, [[1, 5.0]]),
        "get_history": lambda: store.get_history(bad),
        "acquire": lambda: store.acquire(bad, "c1", ttl_s=10),
        "renew": lambda: store.renew(lease),
        "leader_alive": lambda: store.leader_alive(bad),
        "current_epoch": lambda: store.current_epoch(bad),
        "bump_epoch": lambda: store.bump_epoch(bad, lease, expected=0),
    }
    if store.url.startswith("file://"):
        calls["release"] = lambda: store.release(lease)  # etcd's release only revokes the lease it holds
    before = tree(tmp_path)
    for name, call in calls.items():
        with pytest.raises(ConfigError, match="is not a valid run id"):
            call()
            pytest.fail(f"{name} accepted run id {bad!r}")
    assert tree(tmp_path) == before
    if not store.url.startswith("file://"):
        assert store.client.get_prefix(f"/{store.prefix}/") == []
    # The store still works, and lists only runs with valid ids.
    store.create_run(spec("ok"))
    assert store.list_runs() == ["ok"]


def test_storage_store_lists_only_valid_run_dirs(tmp_path):
    store = open_store(f"file://{tmp_path}/runs")
    store.create_run(spec("ok"))
    bad = tmp_path / "runs" / "has space" / "control"
    bad.mkdir(parents=True)
    (bad / "spec.json").write_text(spec("ok").to_json())
    assert store.list_runs() == ["ok"]


# --- 2. floats --------------------------------------------------------------------------


@pytest.mark.parametrize("override, field", [("train.lr=inf", "train.lr"), ("train.grad_clip=nan", "train.grad_clip"),
                                             ("checkpoint.timeout_s=nan", "checkpoint.timeout_s"),
                                             ("metrics.every_s=nan", "metrics.every_s")])
def test_trainer_refuses_non_finite_float(override, field):
    r = run_module("trainer", ["--config", CONFIG, "--set", override])
    assert r.returncode == 2, r.stderr
    assert f"{field}=" in r.stderr and "is not a finite number" in r.stderr
    assert "Traceback" not in r.stderr


def _float_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.type in ("float", float)]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+inf"])
def test_every_float_field_must_be_finite(value):
    checked = 0
    for section, cls in SECTIONS.items():
        for name in _float_fields(cls):
            with pytest.raises(ConfigError, match=f"{section}.{name}=.* is not a finite number"):
                load_config(None, [f"{section}.{name}={value}"])
            checked += 1
    for name in _float_fields(ElasticConfig):
        with pytest.raises(ConfigError, match=f"elastic.{name}=.* is not a finite number"):
            elastic_from_raw({"elastic": {name: float(value)}})
        checked += 1
    assert checked >= 18
    # Built directly, without the TOML loader, a dataclass checks itself too.
    with pytest.raises(ConfigError, match="train.lr=nan is not a finite number"):
        TrainConfig(lr=float("nan"))


@pytest.mark.parametrize("override, message", [
    ("train.lr=0", "train.lr=0.0 must be > 0"),
    ("train.weight_decay=-0.1", "train.weight_decay=-0.1 must be >= 0"),
    ("train.eps=0", "train.eps=0.0 must be > 0"),
    ("train.beta2=1", "train.beta2=1.0 must be in [0, 1)"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio=1.5 must be in [0, 1]"),
    ("train.grad_clip=-1", "train.grad_clip=-1.0 must be >= 0"),
    ("model.dropout=1", "model.dropout=1.0 must be in [0, 1)"),
    ("model.norm_eps=0", "model.norm_eps=0.0 must be > 0"),
    ("model.rope_theta=-1", "model.rope_theta=-1.0 must be > 0"),
    ("checkpoint.timeout_s=0", "checkpoint.timeout_s=0.0 must be > 0"),
    ("metrics.every_s=-1", "metrics.every_s=-1.0 must be > 0"),
])
def test_float_ranges(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


@pytest.mark.parametrize("field, value, message", [
    ("gpus_per_worker", -0.5, "elastic.gpus_per_worker=-0.5 must be >= 0, or -1"),
    ("cpus_per_worker", -1.0, "elastic.cpus_per_worker=-1.0 must be >= 0"),
    ("hang_timeout_s", -1.0, "elastic.hang_timeout_s=-1.0 must be >= 0"),
])
def test_elastic_float_ranges(field, value, message):
    with pytest.raises(ConfigError) as e:
        elastic_from_raw({"elastic": {field: value}})
    assert message in str(e.value)
    assert elastic_from_raw({"elastic": {"gpus_per_worker": -1.0}}).gpus_per_worker == -1.0


@pytest.mark.parametrize("table, message", [
    ({"memory_every_steps": -1}, "recovery.memory_every_steps=-1 must be an integer >= 0 (0: no memory tier)"),
    ({"replicas": -2}, "recovery.replicas=-2 must be an integer >= 0"),
    ({"memory_budget_bytes": -5}, "recovery.memory_budget_bytes=-5 must be an integer: bytes per rank, 0 to derive"),
    ({"replica": 1}, "unknown key recovery.replica"),
    ({"replicas": "two"}, "recovery.replicas"),
])
def test_recovery_section_errors_name_the_field(table, message, tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        recovery_from_raw({"recovery": table})
    assert message in str(e.value)
    assert recovery_from_raw({}).memory_every_steps == 1 and recovery_from_raw({}).replicas == 1
    # `etrain run` refuses it before anything starts (exit 2), naming the field.
    key, value = next(iter(table.items()))
    code, _, err = etrain(["run", CONFIG, "--set", f"recovery.{key}={value!r}".replace("'", '"'),
                           "--store", f"file://{tmp_path}/runs"], capsys)
    assert code == 2 and f"recovery.{key}" in err, err


# --- 3. a directory as the config file -------------------------------------------------


def test_directory_as_config_file(tmp_path, capsys):
    r = run_module("trainer", ["--config", str(tmp_path)])
    assert r.returncode == 2, r.stderr
    assert f"config file {str(tmp_path)!r} is a directory; give the TOML file" in r.stderr
    assert "Traceback" not in r.stderr
    code, _, err = etrain(["run", str(tmp_path), "--store", f"file://{tmp_path}/runs"], capsys)
    assert code == 2 and "is a directory; give the TOML file" in err
    assert tree(tmp_path) == []


# --- 4. credentials in URLs ---------------------------------------------------------------


def test_trainer_refuses_credentials_in_checkpoint_url():
    r = run_module("trainer", ["--config", CONFIG, "--set", f'checkpoint.url="{SECRET_URL}"'])
    assert r.returncode == 2, r.stderr
    assert "checkpoint.url=s3://***@bucket/x carries credentials" in r.stderr
    assert "SUPERSECRET" not in r.stderr + r.stdout


def test_trainer_refuses_credentials_in_the_data_source():
    r = run_module("trainer", ["--config", CONFIG, "--set", 'data.source="s3://bucket/corpus/*.txt?token=SUPERSECRET"'])
    assert r.returncode == 2, r.stderr
    assert "data.source=s3://bucket/corpus/*.txt?*** carries credentials" in r.stderr
    assert "SUPERSECRET" not in r.stderr + r.stdout


def test_etrain_run_with_secret_url_writes_nothing(tmp_path):
    """A user's `etrain run` with a key in checkpoint.url: refused, not echoed, no spec.json kept anywhere."""
    r = run_module("orchestrator", ["run", CONFIG, "--set", f'checkpoint.url="{SECRET_URL}"',
                                    "--store", f"file://{tmp_path}/runs"], cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert "checkpoint.url=s3://***@bucket/x carries credentials" in r.stderr
    assert "SUPERSECRET" not in r.stderr + r.stdout
    assert tree(tmp_path) == []


@pytest.mark.parametrize("where", ["--store", "$ETRAIN_STORE", "elastic.store"])
def test_store_url_with_credentials_is_refused(where, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["run", CONFIG, "--set", f'checkpoint.url="file://{tmp_path}/runs"']
    if where == "--store":
        argv += ["--store", SECRET_URL]
    elif where == "$ETRAIN_STORE":
        monkeypatch.setenv("ETRAIN_STORE", SECRET_URL)
    else:
        monkeypatch.delenv("ETRAIN_STORE", raising=False)
        argv += ["--set", f'elastic.store="{SECRET_URL}"']
    code, out, err = etrain(argv, capsys)
    assert code == 2, err
    assert f"{where}=s3://***@bucket/x carries credentials" in err
    assert "SUPERSECRET" not in out + err
    assert tree(tmp_path) == []


@pytest.mark.parametrize("command", [["status"], ["status", "r1"], ["events", "r1"], ["resume", "r1"]])
def test_control_commands_refuse_credentials_in_store(command, tmp_path, capsys):
    url = f"file://{tmp_path}/runs?X-Amz-Signature=SUPERSECRET"
    code, out, err = etrain([*command, "--store", url], capsys)
    assert code == 2, err
    assert "--store=" in err and "carries credentials" in err
    assert "SUPERSECRET" not in out + err
    assert tree(tmp_path) == []


# --- 5. unknown URL scheme ---------------------------------------------------------------


def test_unknown_checkpoint_url_scheme():
    r = run_module("trainer", ["--config", CONFIG, "--set", 'checkpoint.url="foo://bucket/x"'])
    assert r.returncode == 2, r.stderr
    assert "checkpoint.url='foo://bucket/x' has an unknown URL scheme 'foo'" in r.stderr
    assert all(s in r.stderr for s in ("file://", "s3://", "gs://", "memory://"))
    for good in ("file:///tmp/ckpt", "/tmp/ckpt", "s3://bucket/x", "gs://bucket/x", "memory://x",
                 "simplecache::s3://bucket/x"):
        assert load_config(None, [f'checkpoint.url="{good}"']).checkpoint.url == good


# --- 6. garbage in the run store -----------------------------------------------------------


GARBAGE = [
    ("spec", "{not json", "is not valid JSON"),
    ("spec", '{"run_id": "r1", "config": {}, "workers": "two", "min_workers": 1, "max_workers": 4}',
     'has workers="two", not an integer'),
    ("spec", '{"run_id": "r1", "config": {}}', "lacks the field 'workers'"),
    ("spec", '{"run_id": "../x", "config": {}, "workers": 2, "min_workers": 1, "max_workers": 4}',
     "which is not a valid run id"),
    ("status", "[1, 2]", "is not a JSON object"),
    ("status", '{"phase": 3}', "has phase=3, not a string"),
    ("status", "\xff\xfe", "is not valid JSON"),
    ("history", '{"rows": 1}', "is not a JSON list of rows"),
]


def _doc_path(tmp_path, name):
    return tmp_path / "runs" / "r1" / "control" / f"{name}.json"


@pytest.mark.parametrize("name, garbage, problem", GARBAGE)
def test_garbage_documents_raise_corrupt_run_store(name, garbage, problem, store, tmp_path):
    store.create_run(spec())
    if store.url.startswith("file://"):
        path = _doc_path(tmp_path, name)
        path.write_text(garbage)
        where = f"file://{path}"
    else:
        store._write("r1", name, garbage)
        where = f"etcd key /{store.prefix}/runs/r1/{name}"
    read = {"spec": lambda: store.get_spec("r1"), "status": lambda: store.get_status("r1"),
            "history": lambda: store.get_history("r1")}[name]
    with pytest.raises(CorruptRunStore) as e:
        read()
    assert str(e.value).startswith(where) and problem in str(e.value), str(e.value)


@pytest.mark.parametrize("garbage, problem", [("{", "is not valid JSON"),
                                              ('{"id": "c1"}', "lacks the field 'expires_unix'"),
                                              ('{"id": 1, "expires_unix": 0}', "has id=1, not a string")])
def test_garbage_leader_file(garbage, problem, tmp_path):
    """The storage backend's leader document (etcd's leader key is a plain id bound to a lease)."""
    store = open_store(f"file://{tmp_path}/runs")
    store.create_run(spec())
    path = _doc_path(tmp_path, "leader")
    path.write_text(garbage)
    for call in (lambda: store.leader_alive("r1"), lambda: store.acquire("r1", "c2")):
        with pytest.raises(CorruptRunStore) as e:
            call()
        assert str(e.value).startswith(f"file://{path} ") and problem in str(e.value), str(e.value)


def test_garbage_event_is_named(store, tmp_path):
    store.create_run(spec())
    store.add_event("r1", {"kind": "failure"})
    if store.url.startswith("file://"):
        path = next((tmp_path / "runs" / "r1" / "control" / "events").iterdir())
        path.write_text("{truncated")
        where = f"file://{path}"
    else:
        store._write("r1", "events/zzz", '{"kind": 7}')
        where = f"etcd key /{store.prefix}/runs/r1/events/zzz"
    with pytest.raises(CorruptRunStore) as e:
        store.events("r1")
    assert str(e.value).startswith(where), str(e.value)


@pytest.mark.parametrize("garbage, problem", [("garbage", "not valid JSON"), ("[3]", "should hold"),
                                              ('{"nope": 1}', "should hold"),
                                              ('{"epoch": "3"}', "N an integer >= 0, not {'epoch': '3'}"),
                                              ('{"epoch": true}', "N an integer >= 0, not {'epoch': True}")])
def test_garbage_fence_file(garbage, problem, tmp_path):
    store = open_store(f"file://{tmp_path}/runs")
    store.create_run(spec())
    fence = tmp_path / "runs" / "r1" / "FENCE"
    fence.write_text(garbage)
    with pytest.raises(CorruptRunStore) as e:
        store.current_epoch("r1")
    assert str(e.value).startswith(f"file://{fence} ") and problem in str(e.value), str(e.value)
    lease = store.acquire("r1", "c1")
    with pytest.raises(CorruptRunStore):
        store.bump_epoch("r1", lease, expected=0)
    fence.write_text('{"epoch": 4}')
    assert store.current_epoch("r1") == 4


@pytest.mark.parametrize("garbage", ["garbage", "-1", "3.5", "{}"])
def test_garbage_etcd_epoch(garbage, etcd_server):
    store = open_store(etcd_server.url + "-" + uuid.uuid4().hex[:6])
    store.create_run(spec())
    store._write("r1", "epoch", garbage)
    with pytest.raises(CorruptRunStore) as e:
        store.current_epoch("r1")
    assert str(e.value).startswith(f"etcd key /{store.prefix}/runs/r1/epoch at etcd://"), str(e.value)
    assert "not an epoch" in str(e.value)


@pytest.mark.parametrize("backend", ["storage", "etcd"])
def test_cli_reports_corrupt_store(backend, tmp_path, capsys, request):
    """`etrain status RUN`, `etrain status` and `etrain events RUN` print the message and exit 2, no traceback."""
    if backend == "storage":
        url = f"file://{tmp_path}/runs"
    else:
        url = request.getfixturevalue("etcd_server").url + "-" + uuid.uuid4().hex[:6]
    store = open_store(url)
    store.create_run(spec())
    store._write("r1", "status", "{oops")
    for argv in (["status", "r1"], ["status"]):
        code, _, err = etrain([*argv, "--store", url], capsys)
        assert code == 2, err
        assert "status" in err and "is not valid JSON" in err and "Traceback" not in err
    store._write("r1", "status", '{"phase": "RUNNING"}')
    store._write("r1", "events/0", "[]")
    code, _, err = etrain(["events", "r1", "--store", url], capsys)
    assert code == 2 and "events/0" in err and "is not a JSON object" in err, err
    store._write("r1", "spec", "not json")
    for argv in (["status", "r1"], ["events", "r1"]):
        code, _, err = etrain([*argv, "--store", url], capsys)
        assert code == 2 and "spec" in err and "is not valid JSON" in err, err
