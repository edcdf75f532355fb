"""What `etrain quota`, `etrain grant --list` and `etrain events` print: tables like `etrain status` and
`etrain queue`, and event lines in words, not Python literals. Real file stores in ``tmp_path``."""

from __future__ import annotations

import json
import time

import pytest

from orchestrator.cli.main import main as etrain
from orchestrator.service.docs import set_quota
from orchestrator.store.documents import RunSpec
from orchestrator.store.run_store import open_store


@pytest.fixture
def root(tmp_path, monkeypatch):
    for var in ("ETRAIN_RUN_TOKEN", "ETRAIN_ADMIN_TOKEN", "ETRAIN_STORE", "ETRAIN_SERVICE_STORE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    return f"file://{tmp_path}/runs"


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = etrain(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_quota_lists_its_teams_as_a_table(root, capsys):
    store = open_store(root)
    set_quota(store, "vision", 16)
    store.write_if(None, "allocator", json.dumps({"targets": {"a1": 3, "b2": 2}, "teams": {"a1": "vision",
                                                                                          "b2": "nlp"}}), None)
    code, out, err = cli(capsys, "quota", "--store", root)
    assert code == 0, err
    rows = [[c.strip() for c in line.strip("┃│ ").replace("┃", "│").split("│")] for line in out.splitlines()
            if line[:1] in "┃│"]  # rich's table, as etrain status and etrain queue print theirs
    assert rows == [["team", "max workers", "held"], ["nlp", "-", "2"], ["vision", "16", "3"]], out
    code, out, err = cli(capsys, "quota", "--store", root, "--json")  # --json stays one object
    assert json.loads(out)["teams"] == {"nlp": {"held": 2, "max_workers": None},
                                        "vision": {"held": 3, "max_workers": 16}}


def test_events_show_a_formed_group_in_words(root, capsys):
    store = open_store(root)
    store.create_run(RunSpec(run_id="r1", config={}, workers=2, min_workers=1, max_workers=2))
    node = "a1b2c3d4" + "e" * 48
    store.add_event("r1", {"kind": "formed", "time": time.time(), "epoch": 2, "world_size": 2, "step": 18,
                           "restored_from": 10, "tier": "memory", "tier_reason": "",
                           "memory_tier": {"budget": "derived", "min_budget_bytes": 1 << 30,
                                           "describe": "1.0 GiB per rank (0.5 of 4.0 GiB available on its host, "
                                                       "2 ranks)"},
                           "ep": 2, "rendezvous": "10.0.0.5:29500", "members": ["a1b2c3d4", "a1b2c3d4"],
                           "nodes": [node, node], "pids": [811, 812]})
    code, out, err = cli(capsys, "events", "r1", "--store", root)
    assert code == 0, err
    line = next(line for line in out.splitlines() if "[formed]" in line)
    assert line.split("  ", 1)[1] == (
        "[formed] epoch 2: 2 workers at step 18, restored from memory, ep 2, memory tier 1.0 GiB per rank (0.5 of "
        "4.0 GiB available on its host, 2 ranks), members a1b2c3d4,a1b2c3d4, pids 811,812, rendezvous "
        "10.0.0.5:29500"), line
    assert "{" not in line and "[8" not in line and "'" not in line


def test_grant_list_is_a_table(root, capsys):
    from orchestrator.service.grants import Grant, init_service, set_grant

    store = open_store(root)
    init_service(store)
    set_grant(store, "alice", Grant(max_priority=5, teams=("vision", "nlp"), nonpreemptible=True))
    code, out, err = cli(capsys, "grant", "--list", "--store", root)
    assert code == 0, err
    rows = [[c.strip() for c in line.strip("┃│ ").replace("┃", "│").split("│")] for line in out.splitlines()
            if line[:1] in "┃│"]
    assert rows == [["owner", "max priority", "nonpreemptible", "teams"], ["alice", "5", "true", "vision,nlp"]], out
