"""A run whose controller is gone is marked INTERRUPTED by whoever notices first, never left RUNNING
(orchestrator.store.liveness), on both store backends (the embedded one and a real etcd)."""

from __future__ import annotations

import json
import time

import pytest

from orchestrator.store import liveness
from orchestrator.cli.main import main as etrain
from orchestrator.store.documents import Lease
from orchestrator.store.run_store import RunConflict, RunSpec


def running(store, run_id="r1", controller="ctl-1", ttl_s=None):
    """A run whose controller ``controller`` holds a lease of ``ttl_s`` and has written a RUNNING status."""
    store.create_run(RunSpec(run_id=run_id, config={"run_id": run_id}, workers=2, min_workers=1, max_workers=4))
    ttl = ttl_s if ttl_s is not None else (0.3 if store.url.startswith("file") else 2.0)  # etcd: 2 s at least
    lease = store.acquire(run_id, controller, ttl_s=ttl)
    store.put_status(run_id, {"run_id": run_id, "phase": "RUNNING", "step": 7, "latest_checkpoint": 4,
                              "controller_id": controller}, lease)
    return lease


def status_json(capsys, store, run_id="r1") -> dict:
    capsys.readouterr()
    assert etrain(["status", run_id, "--json", "--store", store.url]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_run_whose_controller_vanished_is_shown_and_marked_interrupted_and_resumable(store, capsys, monkeypatch):
    monkeypatch.setattr(liveness, "STALE_S", 0.3)
    running(store)  # and then its driver is SIGKILLed: no one renews the lease or writes the status again
    time.sleep(3.0 if store.url.startswith("etcd") else 0.8)
    st = status_json(capsys, store)
    assert st["phase"] == "INTERRUPTED" and "etrain resume r1" in st["reason"] and "step 4" in st["reason"]
    assert store.get_status("r1")["phase"] == "INTERRUPTED"  # written, not only shown
    events = [e for e in store.events("r1") if e["kind"] == "interrupted"]
    assert len(events) == 1 and events[0]["noticed_by"] == "etrain status" and events[0]["step"] == 7
    status_json(capsys, store)
    assert len([e for e in store.events("r1") if e["kind"] == "interrupted"]) == 1  # marked once
    store.check_resumable("r1")  # `etrain resume r1` may continue it
    with pytest.raises(RunConflict, match="was interrupted.*etrain resume r1"):
        store.create_run(RunSpec(run_id="r1", config={}, workers=1, min_workers=1, max_workers=1))
    capsys.readouterr()
    assert etrain(["suspend", "r1", "--store", store.url, "--no-wait"]) == 2
    assert "was interrupted" in capsys.readouterr().err


def test_a_controller_that_holds_its_lease_is_not_marked_even_when_its_status_is_old(store, capsys, monkeypatch):
    monkeypatch.setattr(liveness, "STALE_S", 0.3)
    running(store, ttl_s=60)  # alive, in a long group call that writes no status
    time.sleep(0.6)
    assert status_json(capsys, store)["phase"] == "RUNNING"
    assert not [e for e in store.events("r1") if e["kind"] == "interrupted"]


def test_a_driver_that_saw_its_controller_die_marks_it_and_frees_the_lease(store):
    running(store, ttl_s=60)  # the lease would outlive the dead controller by a minute
    marked = liveness.mark(store, "r1", "interrupted: its controller died", by="etrain run", controller="ctl-1")
    assert marked["phase"] == "INTERRUPTED" and store.get_status("r1")["phase"] == "INTERRUPTED"
    assert not store.leader_alive("r1")
    store.acquire("r1", "ctl-2", ttl_s=10)  # a resumed run's controller need not wait the lease out
    assert liveness.mark(store, "r1", "again", by="etrain run", controller="ctl-1") is None  # terminal now


def test_a_controller_that_took_the_run_over_meanwhile_is_never_overwritten(store, monkeypatch):
    monkeypatch.setattr(liveness, "STALE_S", 0.0)
    running(store, ttl_s=60)
    store.release(Lease("r1", "ctl-1", 0.0))  # the first controller is gone
    new = store.acquire("r1", "ctl-2", ttl_s=60)
    read = store.read_versioned

    def read_then_the_new_controller_writes(run_id, name):
        out = read(run_id, name)
        if name == "status":
            store.put_status("r1", {"run_id": "r1", "phase": "RUNNING", "step": 8, "controller_id": "ctl-2"}, new)
        return out

    monkeypatch.setattr(store, "read_versioned", read_then_the_new_controller_writes)
    assert liveness.mark(store, "r1", "interrupted", by="etrain status") is None
    assert store.get_status("r1")["phase"] == "RUNNING" and store.get_status("r1")["controller_id"] == "ctl-2"
