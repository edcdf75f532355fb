"""Spec writes are compare-and-swap: two writers interleaved lose neither change, on every store backend
(a local directory, S3 on a real moto server, a real etcd)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from orchestrator.service.auth import change_run
from orchestrator.store.run_store import RunSpec, SpecConflict, open_store
from tests.conftest import new_bucket


@pytest.fixture(params=["file", "s3", "etcd"])
def store_url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/runs"
    if request.param == "s3":
        return f"s3://{new_bucket(request.getfixturevalue('s3_server'))}/runs"
    return request.getfixturevalue("etcd_server").url + "-" + uuid.uuid4().hex[:6]


def new_run(store, run_id="r1"):
    store.create_run(RunSpec(run_id=run_id, config={"run_id": run_id}, workers=2, min_workers=1, max_workers=4))


def test_a_writer_whose_read_is_stale_is_refused_and_a_fresh_read_keeps_both(store_url):
    a, b = open_store(store_url), open_store(store_url)  # two clients, as two machines would have
    new_run(a)
    seen_a, seen_b = a.get_spec("r1"), b.get_spec("r1")
    assert seen_a.generation == seen_b.generation == 0
    a.update_spec("r1", expected=seen_a.generation, suspended=True)  # the allocator, say
    with pytest.raises(SpecConflict, match="changed"):
        b.update_spec("r1", expected=seen_b.generation, workers=3)  # the user's resize, decided on the old spec
    spec = b.get_spec("r1")
    assert spec.suspended and spec.workers == 2 and spec.generation == 1
    b.update_spec("r1", expected=spec.generation, workers=3)  # read again, decided again
    spec = a.get_spec("r1")
    assert spec.suspended and spec.workers == 3 and spec.generation == 2


def test_a_write_that_another_lands_in_the_middle_of_is_applied_again_on_a_fresh_read(store_url):
    a, b = open_store(store_url), open_store(store_url)
    new_run(a)
    read = b.read_versioned
    interleaved = []

    def read_then_the_other_writes(run_id, name):  # b has read; a writes before b does
        out = read(run_id, name)
        if name == "spec" and not interleaved:
            interleaved.append(a.update_spec("r1", suspended=True).generation)
        return out

    b.read_versioned = read_then_the_other_writes
    spec = b.update_spec("r1", workers=3)
    assert interleaved == [1] and spec.generation == 2
    spec = a.get_spec("r1")
    assert spec.suspended and spec.workers == 3  # neither change lost


def test_a_resize_racing_another_writers_change_is_decided_again_and_loses_neither(store_url, monkeypatch, tmp_path):
    monkeypatch.delenv("ETRAIN_RUN_TOKEN", raising=False)
    a, b = open_store(store_url), open_store(store_url)
    new_run(a)  # no token: a run of before tokens, so that this test is about the race alone
    decided = []

    def resize(spec):  # the CLI's decision, made on the spec it read; another writer lands right after
        decided.append(spec.generation)
        if len(decided) == 1:
            a.update_spec("r1", expected=spec.generation, max_workers=3)
        assert 3 <= spec.max_workers
        return {"workers": 3}

    change_run(b, "r1", resize)
    assert decided == [0, 1]  # refused once, decided again on the fresh read
    spec = a.get_spec("r1")
    assert spec.workers == 3 and spec.max_workers == 3 and spec.generation == 2


def test_creating_a_run_is_a_create_if_absent(store_url):
    a, b = open_store(store_url), open_store(store_url)
    assert a.write_if("r2", "spec", RunSpec("r2", {}, 1, 1, 1).to_json(), None)
    assert not b.write_if("r2", "spec", RunSpec("r2", {}, 2, 1, 2).to_json(), None)
    assert a.get_spec("r2").workers == 1
    raw, version = a.read_versioned("r2", "spec")
    assert b.write_if("r2", "spec", RunSpec("r2", {}, 3, 1, 3).to_json(), version)
    assert not a.write_if("r2", "spec", RunSpec("r2", {}, 4, 1, 4).to_json(), version)  # that version is gone
    assert a.get_spec("r2").workers == 3


def test_a_local_lock_file_left_by_a_writer_that_died_blocks_nobody(tmp_path):
    store = open_store(f"file://{tmp_path}/runs")
    new_run(store)
    lock = f"{tmp_path}/runs/r1/control/spec.json.lock"
    open(lock, "w").close()  # nobody holds it: the kernel drops a holder's lock when its process ends
    future = time.time() + 3600  # whatever its age, even one in the future (tests/checkpointing/test_store_lock.py)
    os.utime(lock, (future, future))
    assert store.update_spec("r1", workers=3).workers == 3
