"""The run store on a real etcd server and on the embedded storage backend."""

import time
import uuid

import pytest

from checkpointing.errors import FencedError
from orchestrator.store.run_store import RunConflict, RunSpec, StoreUnavailable, UnknownRun, open_store


def spec(run_id="r1", **kw):
    return RunSpec(run_id=run_id, config={"run_id": run_id}, workers=2, min_workers=1, max_workers=4, **kw)


def test_spec_status_events(store):
    with pytest.raises(UnknownRun, match="no run 'r1'"):
        store.get_spec("r1")
    store.create_run(spec())
    assert store.get_spec("r1").workers == 2
    s = store.update_spec("r1", workers=3)
    assert s.workers == 3 and s.generation == 1
    lease = store.acquire("r1", "c1", ttl_s=10)
    store.put_status("r1", {"phase": "RUNNING", "step": 5}, lease)
    assert store.get_status("r1")["step"] == 5
    store.add_event("r1", {"kind": "failure", "rank": 1})
    store.add_event("r1", {"kind": "recovered", "seconds": 1.5})
    assert [e["kind"] for e in store.events("r1")] == ["failure", "recovered"]
    assert store.list_runs() == ["r1"]


def test_live_run_id_is_refused(store):
    store.create_run(spec())
    lease = store.acquire("r1", "c1")
    store.put_status("r1", {"phase": "RUNNING"}, lease)
    with pytest.raises(RunConflict, match="already exists"):
        store.create_run(spec())
    store.put_status("r1", {"phase": "SUSPENDED"}, lease)
    with pytest.raises(RunConflict, match="etrain resume r1"):
        store.create_run(spec())


def test_second_controller_is_fenced(store):
    store.create_run(spec())
    first = store.acquire("r1", "c1", ttl_s=10)
    with pytest.raises(RunConflict, match="led by controller"):
        store.acquire("r1", "c2", ttl_s=10)
    assert store.bump_epoch("r1", first, expected=0) == 1
    assert store.current_epoch("r1") == 1
    with pytest.raises(FencedError):
        store.bump_epoch("r1", first, expected=0)  # stale expectation
    stale = type(first)("r1", "c2", 10)
    with pytest.raises(FencedError):
        store.put_status("r1", {"phase": "RUNNING"}, stale)
    with pytest.raises(FencedError):
        store.bump_epoch("r1", stale, expected=1)
    assert store.current_epoch("r1") == 1
    assert store.renew(first)
    store.release(first)
    second = store.acquire("r1", "c2", ttl_s=10)
    assert store.bump_epoch("r1", second, expected=1) == 2


def test_etcd_outage_is_a_clear_error_and_recovers(etcd_server):
    store = open_store(etcd_server.url + "-" + uuid.uuid4().hex[:6])
    store.create_run(spec())
    etcd_server.stop()
    try:
        with pytest.raises(StoreUnavailable, match="unreachable"):
            store.get_spec("r1")
    finally:
        etcd_server.start()
    assert store.get_spec("r1").workers == 2


def test_a_renewal_never_shows_a_reader_an_empty_lease(tmp_path):
    """The lease keeper rewrites the leader document every few seconds while the controller's own writes (the
    epoch's compare-and-swap) read it: on a local disk a reader must see the old or the new document, never a
    truncated one (which fenced a live controller: 'does not lead run')."""
    import threading

    store = open_store(f"file://{tmp_path}/runs")
    store.create_run(spec("r"))
    lease = store.acquire("r", "ctl-a", ttl_s=30)
    stop, seen = threading.Event(), []

    def renew():
        while not stop.is_set():
            store.renew(lease)

    t = threading.Thread(target=renew)
    t.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            seen.append(store.leader_alive("r"))
    finally:
        stop.set()
        t.join()
    assert len(seen) > 100 and all(seen), f"{seen.count(False)} of {len(seen)} reads saw no leader"
    assert [e for e in store.events("r")] == []
