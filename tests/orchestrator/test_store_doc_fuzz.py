"""Seeded fuzz of the run store's documents against the ``etrain`` command: hostile specs, statuses, events,
step histories and the allocator's and quotas' documents, written into real file stores beside a good run.

Each case is a store of its own holding the run ``good`` (a spec, a RUNNING status and events as etrain writes
them) and the run ``bad``, whose documents are random JSON (wrong types and shapes, nan and inf, numbers past
any float, bogus phases, control characters and escape sequences, rich markup, lone surrogates, nesting past
Python's limit) or no JSON at all; the store's own ``allocator`` and ``quotas`` documents are hostile too.
Then ``etrain status`` (of the store, and of the run registry), ``status RUN``, ``queue``, ``events RUN`` and
``quota``, in-process, must each:

* end with exit 0, 1 or 2, never an exception out of ``orchestrator.cli.main.main``;
* end within a few seconds;
* print no control character but newline (no ESC: stored text never reaches the terminal as a command);
* show the good run whenever it lists runs: a bad run never hides the run beside it.

    pytest tests/orchestrator/test_store_doc_fuzz.py               # 30 cases (make test)
    pytest tests/orchestrator/test_store_doc_fuzz.py -m slow       # 200 more
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time

import pytest

from orchestrator.cli.main import main as etrain
from orchestrator.phase import Phase
from orchestrator.store import user_runs as registry
from orchestrator.store.documents import RunSpec
from orchestrator.store.run_store import open_store

CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
LIMIT_S = 10.0  # one invocation, on a slow shared machine
TEXT = ["", "x", "\x1b[2J\x1b[H", "\x1b]0;owned\x07", "\x9b31m", "[bold red]markup[/]", "[link=file:///etc]x[/link]",
        "\u202eevil", "\ud800", "\x00\x08\r", "line\nline", "é" * 300, "%s%n{0}", "RUNNING", "nlp", "9" * 50]
NUMBERS = [0, 1, -1, 7, 2**31, 2**63, -(2**63), 10**30, 10**400, 0.5, -2.5, 1e308, math.nan, math.inf, -math.inf]
STATUS_KEYS = ["phase", "reason", "step", "total_steps", "world_size", "loss", "eval_loss", "goodput", "priority",
               "team", "owner", "queued_unix", "queue_wait_s", "queue_reason", "updated_unix", "metrics_url",
               "memory_tier", "requeue", "min_workers", "max_workers", "target", "latest_checkpoint", "recoveries",
               "steps_lost", "controller_id", "run_id", "epoch"]
EVENT_KINDS = ["failure", "recovered", "resized", "eval", "memory_tier", "tracker", "metrics", "checkpoint_failed",
               "suspended", "failed", "interrupted", "allocated", "\x1b[31mkind"]


def hostile(rng: random.Random, depth: int = 0):
    """A random JSON value: text, a number, a bool, null, a list or an object (nested a little)."""
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(TEXT)
    if kind == 1:
        return rng.choice(NUMBERS)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(list(Phase)).value if rng.random() < 0.5 else rng.choice(["BOGUS", "running", ""])
    if kind == 4:
        return [hostile(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(TEXT + STATUS_KEYS): hostile(rng, depth + 1) for _ in range(rng.randrange(4))}


def document(rng: random.Random, fields: list[str], base: dict) -> str:
    """``base`` as it is (its text hostile, its shape etrain's), or with some ``fields`` made hostile, or a
    hostile value, or bytes that are no JSON at all."""
    roll = rng.random()
    if roll < 0.4:
        return json.dumps(base)
    if roll < 0.46:
        return rng.choice(["{oops", "\xff\xfe", "[" * 5000, "", "null", "1e999999", '{"a": 1, "a": [}'])
    if roll < 0.54:
        return json.dumps(hostile(rng))
    doc = dict(base)
    for key in rng.sample(fields, rng.randrange(1, min(5, len(fields)) + 1)):
        doc[key] = hostile(rng)
    return json.dumps(doc)


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)


def hostile_store(rng: random.Random, root: str, now: float) -> None:
    """A store holding the good run and the bad one, and hostile documents of the store itself."""
    store = open_store(f"file://{root}")
    for run_id in ("good", "bad"):
        store.create_run(RunSpec(run_id=run_id, config={"elastic": {"team": "nlp"}}, workers=2, min_workers=1,
                                 max_workers=4, owner="alice"))
    def control(run_id: str, name: str) -> str:
        return os.path.join(root, run_id, "control", name)

    write(control("good", "status.json"), json.dumps({
        "run_id": "good", "phase": "RUNNING", "step": 7, "total_steps": 100, "world_size": 2, "loss": 2.5,
        "goodput": 0.9, "priority": 1, "team": "nlp", "owner": "alice", "min_workers": 1, "max_workers": 4,
        "updated_unix": now}))
    store.add_event("good", {"kind": "eval", "step": 5, "loss": 2.4})
    store.put_history("good", [[1, 3.0, 2, 12, now, 0.1, 900.0, None]])
    spec = json.loads(store.read_versioned("bad", "spec")[0])
    write(control("bad", "spec.json"), document(rng, list(spec), spec) if rng.random() < 0.3 else json.dumps(
        {**spec, "owner": rng.choice(TEXT)}))
    write(control("bad", "status.json"), document(rng, STATUS_KEYS, {
        "run_id": "bad", "phase": rng.choice(["QUEUED", "RUNNING", "SUSPENDED"]), "updated_unix": now,
        "queued_unix": now - 5, "priority": rng.choice([-3, 0, 9]), "memory_tier": {"state": "off", "reason": "\x1b"},
        **{k: rng.choice(TEXT) for k in ("reason", "team", "owner", "queue_reason", "controller_id")}}))
    for i in range(rng.randrange(4)):
        event = {"kind": rng.choice(EVENT_KINDS), "time": now, "step": 3, "bytes": 10, "budget_bytes": 5,
                 "action": rng.choice(["off", "refused", "fallback"]), "tracker": "x", "state": "y",
                 **{k: rng.choice(TEXT) for k in ("message", "reason", "failure_kind", "url", "error")}}
        write(control("bad", f"events/{i:020d}-aaaaaa.json"),
              document(rng, [*event, "loss"], event))
    write(control("bad", "history.json"), json.dumps(hostile(rng)) if rng.random() < 0.5 else
          json.dumps([[hostile(rng) for _ in range(8)]]))
    allocator = {"waiting": {"bad": rng.choice(TEXT), "good": rng.choice(TEXT)}, "targets": {"bad": 1},
                 "teams": {"bad": "nlp"}}
    write(os.path.join(root, "_etrain-allocator.json"), document(rng, list(allocator), allocator))
    write(os.path.join(root, "_etrain-quotas.json"), document(rng, ["teams"], {"teams": {"nlp": 4}}))


def invocations(rng: random.Random, url: str) -> list[tuple[list[str], bool]]:
    """(argv, whether its output lists the good run) of one case."""
    store = ["--store", url]
    def json_() -> list[str]:
        return ["--json"] if rng.random() < 0.3 else []

    return [(["status", *store, *json_()], True), (["status", *json_()], True), (["status", "good", *store], True),
            (["status", "bad", *store, *json_()], False), (["queue", *store, *json_()], True),
            (["events", "good", *store], False), (["events", "bad", *store, *json_()], False),
            (["quota", *store, *json_()], False)]


def run_cases(seeds: range, tmp_path, capsys, monkeypatch) -> None:
    for var in ("ETRAIN_STORE", "ETRAIN_RUN_TOKEN", "ETRAIN_ADMIN_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # ./runs of `etrain status` without --store: none here
    etrain(["status", "--store", f"file://{tmp_path}/empty"])  # the command's imports, before any clock runs
    capsys.readouterr()
    for seed in seeds:
        rng = random.Random(seed)
        root = str(tmp_path / f"case{seed}" / "runs")
        monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / f"case{seed}" / "home"))
        now = time.time()
        hostile_store(rng, root, now)
        registry.record("good", f"file://{root}")
        registry.record("bad", f"file://{root}")
        for argv, lists_good in invocations(rng, f"file://{root}"):
            started = time.monotonic()
            try:
                code = etrain(argv)
            except SystemExit as e:
                code = e.code
            took = time.monotonic() - started
            out = capsys.readouterr()
            said = out.out + out.err
            where = (seed, argv, said[-3000:])
            assert code in (0, 1, 2), where
            assert took < LIMIT_S, (took, *where)
            assert not CONTROL.search(said), (CONTROL.search(said), *where)
            if lists_good:
                assert "good" in out.out and "unreachable" not in said, where


def test_thirty_hostile_stores(tmp_path, capsys, monkeypatch):
    run_cases(range(30), tmp_path, capsys, monkeypatch)


@pytest.mark.slow
def test_two_hundred_hostile_stores(tmp_path, capsys, monkeypatch):
    run_cases(range(1000, 1200), tmp_path, capsys, monkeypatch)
