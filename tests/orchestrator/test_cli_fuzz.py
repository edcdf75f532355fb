"""Seeded fuzz of the ``etrain`` command line: hostile values for every flag of the commands that do not
start a run, against a real run store holding one finished run, a real step log and a real checkpoint root.

Every invocation ends with exit 0, 1 or 2 and a message, never a traceback (an exception escaping
``orchestrator.cli.main.main``); a credential given on the command line is never printed back.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from orchestrator.cli.main import main as etrain
from orchestrator.store.documents import RunSpec
from orchestrator.store.run_store import open_store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "tiny.toml")
SECRET = "hunter2pw"
HOSTILE = ["", "-1", "0", "1", "3", "nan", "inf", "-inf", "1e999", "abc", "../../etc/passwd", "/nonexistent/x.png",
           "x.foo", f"s3://bob:{SECRET}@bucket/runs", f"http://127.0.0.1:1/?token={SECRET}", "file:///dev/null",
           "é" * 200, "9" * 40, "1..0", "3..2", "2..4", "0..1", "80GiB", "450GB/s", "-5GB", "1e999GB", "h100", "cpu",
           "custom", "--json", "-", " ", "run.png", "run.svg", "%s%n", "${HOME}", "; rm -rf /", "\\", "'\"", "🙂"]


@pytest.fixture
def world(tmp_path):
    """A file store with one finished run (spec, status, history, events), a step log, and paths."""
    root = f"file://{tmp_path}/runs"
    store = open_store(root)
    store.create_run(RunSpec(run_id="done", config={"data": {"seq_len": 32}}, workers=2, min_workers=1,
                             max_workers=3))
    store.put_history("done", [[s, 3.0 - s / 10, 2, 12 * s, 1000.0 + s, 0.1, 900.0] for s in range(1, 11)])
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10, "time": 1000.0 + s, "world_size": 1,
                                       "step_seconds": 0.1}) + "\n" for s in range(1, 6)))
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\x00\xff{not json\n[1,2]\n")
    return {"root": root, "log": str(log), "garbage": str(garbage), "out": str(tmp_path / "pic.png")}


def invocations(rng: random.Random, w: dict):
    v = lambda: rng.choice(HOSTILE)  # noqa: E731
    run = lambda: rng.choice(["done", "missing", v()])  # noqa: E731
    store = ["--store", w["root"]]
    small = ["--workers", rng.choice(["1", "1..2", "2", v()]), "--budget-s", rng.choice(["0.05", "0", "nan", "-1"])]
    return [
        ["status", *([run()] if rng.random() < 0.7 else []), *store, *(["--json"] if rng.random() < 0.5 else [])],
        ["events", run(), *store, *(["--json"] if rng.random() < 0.5 else [])],
        [rng.choice(["suspend", "stop"]), run(), *store, "--no-wait"],
        ["resize", run(), "--workers", v(), *store],
        ["plot", run(), "-o", rng.choice([v(), w["out"]]), *store],
        ["plot", "--log-file", rng.choice([w["log"], w["garbage"], v()]), "-o", rng.choice([v(), w["out"]])],
        ["plan", TINY, *small, rng.choice(["--tflops", "--device-memory", "--intra-node-bw",
                                                          "--inter-node-bw", "--gpus-per-node", "--device"]), v()],
        ["plan", rng.choice([TINY, v()]), *small, "--set", f"{v()}={v()}"],
        ["ckpt", rng.choice(["ls", "inspect", "verify"]), rng.choice([v(), w["root"], w["root"] + "/done"])],
        ["logs", run()],
    ]


def invoke(argv: list[str], capsys):
    """``etrain ARGV`` in this process: its exit status (0, 1 or 2, never a traceback) and its output, which
    never holds the credential a command line carried."""
    try:
        code = etrain(argv)
    except SystemExit as e:  # argparse's usage errors: exit 2 with its message
        code = e.code
    out = capsys.readouterr()
    assert code in (0, 1, 2), (argv, code, out.err[-2000:])
    assert SECRET not in out.out + out.err, (argv, out.err[-2000:])
    return code, out


def test_two_hundred_hostile_command_lines_exit_cleanly(world, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ETRAIN_STORE", world["root"])
    monkeypatch.chdir(tmp_path)  # a relative -o (run.png) is written here, not into the checkout
    rng = random.Random(31)
    seen = 0
    while seen < 240:
        for argv in invocations(rng, world):
            seen += 1
            invoke(argv, capsys)
    assert seen >= 200


@pytest.mark.parametrize("flag,value", [("--tflops", "nan"), ("--tflops", "inf"), ("--tflops", "-3"),
                                        ("--budget-s", "inf"), ("--device-memory", "1e999GB"),
                                        ("--intra-node-bw", "1e999GB/s")])
def test_plan_refuses_numbers_that_are_not_finite(flag, value, capsys):
    """Before: `--tflops inf` was a traceback and `--tflops nan` planned with NaN times, exit 0."""
    code = etrain(["plan", "examples/tiny.toml", "--workers", "1..2", flag, value])
    assert code == 2 and flag in capsys.readouterr().err


def test_plot_output_that_cannot_be_written_names_the_flag(world, capsys, tmp_path):
    """Before: a traceback from matplotlib for an unknown format, a missing directory or a directory."""
    for out, why in [(str(tmp_path / "run.foo"), "unknown picture format 'foo'"),
                     ("/nonexistent/dir/run.png", "/nonexistent/dir is not a writable directory"),
                     (str(tmp_path), "is a directory")]:
        code = etrain(["plot", "--log-file", world["log"], "-o", out])
        err = capsys.readouterr().err
        assert code == 2 and f"-o {out!r}" in err and why in err, err
    assert etrain(["plot", "--log-file", world["log"], "-o", str(tmp_path / "run.svg")]) == 0
    assert (tmp_path / "run.svg").read_bytes().startswith(b"<?xml")


def service_invocations(rng: random.Random, svc: str, other: str):
    """Hostile command lines of the shared cluster's commands: quota, grant, service, queue, resize."""
    v = lambda: rng.choice(HOSTILE)  # noqa: E731
    store = rng.choice([["--store", svc], ["--store", other], ["--store", v()], []])
    return [
        ["quota", *([v()] if rng.random() < 0.7 else []), *rng.choice([["--max-workers", v()], ["--remove"], []]),
         *store, *(["--json"] if rng.random() < 0.3 else [])],
        ["grant", *([v()] if rng.random() < 0.7 else []),
         *rng.choice([["--max-priority", v()], ["--teams", v()], ["--nonpreemptible"], ["--revoke"], ["--list"]]),
         *store, *(["--token", v()] if rng.random() < 0.3 else [])],
        ["service", rng.choice(["show", "init", v()]), *store, *(["--address", v()] if rng.random() < 0.5 else [])],
        ["queue", *store, *(["--json"] if rng.random() < 0.5 else [])],
    ]


def service_fuzz(tmp_path, capsys, monkeypatch, seed: int, cases: int) -> None:
    from orchestrator.service.grants import init_service

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    svc, other = f"file://{tmp_path}/service", f"file://{tmp_path}/mine"
    init_service(open_store(svc))  # its admin token in this ETRAIN_HOME: changes are authorized and go through
    (tmp_path / "home" / "service_store").write_text(svc + "\n")
    rng = random.Random(seed)
    seen = 0
    while seen < cases:
        for argv in service_invocations(rng, svc, other):
            seen += 1
            code, out = invoke(argv, capsys)
            assert "Traceback" not in out.err and "\x1b" not in out.out + out.err, (argv, out.err[-2000:])
            if code == 2:  # a refusal names what it refuses: a flag, an argument, or the store
                named = [a for a in argv if a.startswith("--")] + ["argument", "store", "team", "owner", "grant"]
                assert any(n in out.err for n in named), (argv, out.err[-2000:])
    assert json.loads(open_store(svc).read_versioned(None, "quotas")[0] or "{}") is not None


def test_hostile_service_command_lines_exit_cleanly(tmp_path, capsys, monkeypatch):
    service_fuzz(tmp_path, capsys, monkeypatch, seed=39, cases=30)


@pytest.mark.slow
def test_two_hundred_hostile_service_command_lines_exit_cleanly(tmp_path, capsys, monkeypatch):
    service_fuzz(tmp_path, capsys, monkeypatch, seed=3939, cases=200)
