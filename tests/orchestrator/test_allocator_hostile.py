"""The cluster's allocator among hostile and clumsy tenants, on real file stores: one run's documents never
stop a decision (a phase that is none, absurd sizes, non-finite rates, a FIFO for a document, quotas of the
wrong shape), a run's claims are bounded by its owner's grant in the cluster's service store (a quota a
tenant sets on her own store is not the cluster's), runs of one id in two stores are two runs, and a seeded
fuzz of everything the allocator reads (docs/service.md#a-shared-cluster)."""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time

import pytest

from checkpointing.errors import ConfigError
from orchestrator.config import sharing_from_raw
from orchestrator.service import auth
from orchestrator.service.allocator import STATE_DOC, AllocatorCore
from orchestrator.service.docs import QUOTAS_DOC, read_doc, set_quota
from orchestrator.service.grants import Grant, clamp, grants_of, init_service, problems, refuse_ungranted, set_grant
from orchestrator.service.policy import ClusterView, RunDemand
from orchestrator.service.rules import decide
from orchestrator.store.cluster_names import cluster_key
from orchestrator.store.documents import RunSpec
from orchestrator.store.run_store import open_store
from trainer.config.load import load_raw

BASE = ["data.max_bytes=200000", "data.seq_len=16", "train.global_batch=12", "train.micro_batch=1",
        "train.steps=1000"]


def make_run(store, run_id: str, *, workers: int, min_workers: int = 1, max_workers: int = 3,
             phase: str = "RUNNING", world: int | None = None, elastic: dict | None = None,
             owner: str = "") -> RunSpec:
    raw = load_raw("examples/tiny.toml", BASE)
    raw["elastic"] = {**raw.get("elastic", {}), **(elastic or {})}
    spec = RunSpec(run_id=run_id, config=raw, workers=workers, min_workers=min_workers, max_workers=max_workers,
                   owner=owner)
    store.create_run(spec)
    lease = store.acquire(run_id, f"ctl-{run_id}")
    store.put_status(run_id, {"run_id": run_id, "phase": phase, "step": 10, "total_steps": 1000,
                              "world_size": workers if world is None else world}, lease)
    store.release(lease)
    return spec


def put_status(store, run_id: str, raw: str) -> None:
    """A status document as its bytes, fresh (as its live controller would have written it just now)."""
    raw = raw.replace("{", '{"updated_unix": %f, ' % time.time(), 1) if raw.startswith("{") else raw
    _, version = store.read_versioned(run_id, "status")
    assert store.write_if(run_id, "status", raw, version)


def put_raw(store, run_id: str | None, name: str, raw: str) -> None:
    _, version = store.read_versioned(run_id, name)
    assert store.write_if(run_id, name, raw, version)


def core_of(state, *stores, capacity: int = 3, **kw) -> AllocatorCore:
    core = AllocatorCore(state, capacity=lambda cpw, gpw: capacity, **kw)
    for st in stores or (state,):
        for run_id in st.list_runs():
            core.register(run_id, st.url)
    return core


def ticked(core: AllocatorCore, within_s: float = 20.0):
    """One decision, which must end within ``within_s``."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(plan=core.tick()), daemon=True)
    t.start()
    t.join(within_s)
    assert not t.is_alive(), f"a decision did not end within {within_s} s"
    return out["plan"]


@pytest.fixture
def store(tmp_path):
    return open_store(f"file://{tmp_path}/runs")


# --- one run's documents never stop the allocator ------------------------------------------------


@pytest.mark.parametrize("hostile", ["bogus_phase", "huge_max", "nan_rate", "inf_rate", "quotas_list",
                                     "state_runs_list", "nan_status"])
def test_one_runs_documents_never_stop_a_decision(store, hostile):
    make_run(store, "good", workers=1, max_workers=1, phase="QUEUED", world=0)
    make_run(store, "bad", workers=2)
    if hostile == "bogus_phase":
        put_status(store, "bad", '{"run_id": "bad", "phase": "BOGUS", "step": 1}')
    elif hostile == "huge_max":
        raw, version = store.read_versioned("bad", "spec")
        doc = json.loads(raw)
        doc["max_workers"] = 1_000_000_000
        assert store.write_if("bad", "spec", json.dumps(doc), version)
    elif hostile in ("nan_rate", "inf_rate"):
        step_s = "NaN" if hostile == "nan_rate" else "Infinity"
        put_raw(store, "bad", "history", "[" + ",".join(f"[{s}, 1.0, 2, {12 * s}, {1000 + s}, {step_s}]"
                                                        for s in range(1, 8)) + "]")
        store.add_event("bad", {"kind": "resized", "resize_s": float("nan")})
    elif hostile == "quotas_list":
        put_raw(store, None, QUOTAS_DOC, '{"teams": []}')
    elif hostile == "state_runs_list":
        put_raw(store, None, STATE_DOC, '{"runs": [1, 2], "targets": "x"}')
    elif hostile == "nan_status":
        put_status(store, "bad", '{"run_id": "bad", "phase": "RUNNING", "step": 1, "world_size": NaN}')
    core = core_of(store)
    if hostile == "state_runs_list":  # the registry itself was garbage: registered again, as a driver would
        put_raw(store, None, STATE_DOC, '{"runs": [1, 2], "targets": "x"}')
        core.register("good", store.url)
    started = time.monotonic()
    plan = ticked(core)
    assert time.monotonic() - started < 10
    assert plan.targets.get(cluster_key("good", store.url)) == 1, "the good run beside it is admitted"
    assert store.get_spec("good").target == 1


def test_a_skipped_run_leaves_an_allocator_event_and_a_metric_once(store):
    make_run(store, "good", workers=1, max_workers=1, phase="QUEUED", world=0)
    make_run(store, "bad", workers=2)
    put_status(store, "bad", '{"run_id": "bad", "phase": "BOGUS", "step": 1}')
    core = core_of(store)
    for _ in range(3):
        ticked(core)
    events = [e for e in store.events("bad") if e["kind"] == "allocator" and e["action"] != "registered"]
    assert len(events) == 1 and events[0]["action"] == "skipped", "said once per reason, not every round"
    assert "BOGUS" in events[0]["reason"] or "phase" in events[0]["reason"]
    assert sum(core.metrics.skipped.values()) == 3
    assert cluster_key("bad", store.url) in read_doc(store, STATE_DOC)[0]["skipped"]


def test_a_fifo_for_a_document_costs_one_read_budget_not_the_allocator(store, tmp_path):
    make_run(store, "good", workers=1, max_workers=1, phase="QUEUED", world=0)
    make_run(store, "bad", workers=2)
    import trainer.parallel.dims  # noqa: F401  (the first read of a config imports the layout's rules: torch)

    core = core_of(store, read_budget_s=2.0)
    ticked(core)
    store.update_spec("good", target=0)
    fifo = tmp_path / "runs" / "bad" / "control" / "status.json"
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        started = time.monotonic()
        ticked(core)
        ticked(core)  # a read still stuck is not started again
        assert time.monotonic() - started < 12
        assert store.get_spec("good").target == 1
        assert cluster_key("bad", store.url) in core.last["skipped"]
    finally:  # a reader still blocked on the FIFO is let go
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waits
            pass


def test_decide_refuses_non_finite_rates_and_counts_out_of_bounds():
    with pytest.raises(ValueError, match="throughput"):
        RunDemand(run_id="a", min_workers=1, max_workers=4, throughput={2: math.nan})
    with pytest.raises(ValueError, match="max_workers"):
        RunDemand(run_id="a", min_workers=1, max_workers=10**9)
    with pytest.raises(ValueError, match="remaining"):
        RunDemand(run_id="a", min_workers=1, max_workers=4, remaining=-math.inf)
    ok = RunDemand(run_id="a", min_workers=1, max_workers=4, throughput={1: 1.0, 2: 2.0})
    object.__setattr__(ok, "throughput", {1: 1.0, 2: math.inf})  # a value changed behind the check
    with pytest.raises(ValueError, match="throughput"):
        decide([ok], ClusterView(capacity=4), 0.0)


# --- grants and the service store ----------------------------------------------------------------


def service(tmp_path):
    svc = open_store(f"file://{tmp_path}/service")
    init_service(svc)
    return svc


def test_a_self_granted_priority_preempts_no_one_on_a_service_with_an_admin(tmp_path, store):
    svc = service(tmp_path)
    make_run(store, "victim", workers=3, min_workers=3, max_workers=3, owner="ana")
    make_run(store, "greedy", workers=2, min_workers=2, max_workers=2, phase="QUEUED", world=0, owner="mallory",
             elastic={"priority": 1000000, "preemptible": False, "team": "vision"})
    core = core_of(svc, store, capacity=3)
    ticked(core)
    assert store.get_spec("victim").target == 0 and not store.get_spec("victim").requeue, "nobody was preempted"
    assert store.get_spec("greedy").target == 0
    (ev,) = [e for e in store.events("greedy") if e["kind"] == "allocator" and e["action"] != "registered"]
    assert ev["action"] == "granted" and "priority 1000000 -> 0" in ev["reason"] and "team 'vision'" in ev["reason"]
    set_grant(svc, "mallory", Grant(max_priority=10))  # what the admin grants, the allocator applies
    ticked(core)
    assert store.get_spec("victim").requeue and store.get_spec("greedy").target == 2, "suspended for it now"


def test_a_tenants_own_store_quota_is_not_the_clusters(tmp_path, store):
    svc = service(tmp_path)
    auth.new_admin_token(store)  # the tenant made herself admin of her own store ...
    set_quota(store, "default", 0)  # ... and set a quota there
    make_run(store, "a", workers=2, max_workers=2)
    core = core_of(svc, store, capacity=3)
    ticked(core)
    assert store.get_spec("a").target == 0 and not store.get_spec("a").requeue, "the service store's quotas only"
    set_quota(svc, "default", 1)  # the operator's quota is obeyed
    ticked(core)
    assert store.get_spec("a").target == 1


def test_claims_beyond_the_grant_are_refused_naming_the_key_and_the_grant(tmp_path):
    raw = {"elastic": {"priority": 50, "team": "vision", "preemptible": False}}
    share = sharing_from_raw(raw)
    grants = {"ana": Grant(max_priority=10, teams=("nlp",))}
    found = problems("ana", share, grants)
    assert len(found) == 3
    assert "elastic.priority = 50" in found[0] and "max_priority 10" in found[0] and "--max-priority 50" in found[0]
    assert "elastic.team = 'vision'" in found[1] and "nlp" in found[1]
    assert "elastic.preemptible = false" in found[2] and "--nonpreemptible" in found[2]
    with pytest.raises(ConfigError, match="elastic.priority"):
        refuse_ungranted("ana", share, grants)
    refuse_ungranted("ana", share, None)  # no service with an admin: taken as written
    refuse_ungranted("ana", sharing_from_raw({"elastic": {"priority": 10, "team": "nlp"}}), grants)
    svc = service(tmp_path)
    assert grants_of(svc) == {} and grants_of(open_store(f"file://{tmp_path}/plain")) is None


def test_clamp_keeps_what_was_granted():
    d = RunDemand(run_id="k", min_workers=1, max_workers=2, priority=7, team="vision", preemptible=False)
    same, cut = clamp(d, "ana", {"ana": Grant(max_priority=7, teams=("vision",), nonpreemptible=True)})
    assert same == d and cut == ""
    less, cut = clamp(d, "bo", {"ana": Grant(max_priority=100)})
    assert (less.priority, less.team, less.preemptible) == (0, "default", True) and "owner 'bo'" in cut
    assert clamp(d, "bo", None) == (d, "")


# --- names on the cluster ------------------------------------------------------------------------


def test_runs_of_one_id_in_two_stores_are_two_runs(tmp_path):
    a, b = open_store(f"file://{tmp_path}/ana"), open_store(f"file://{tmp_path}/bo")
    make_run(a, "tiny", workers=1, phase="QUEUED", world=0)
    make_run(b, "tiny", workers=2, min_workers=2, max_workers=2, phase="QUEUED", world=0)
    core = core_of(a, a, b, capacity=3)
    assert len(core.runs()) == 2
    plan = ticked(core)
    assert plan.targets == {cluster_key("tiny", a.url): 1, cluster_key("tiny", b.url): 2}
    assert a.get_spec("tiny").target == 1 and b.get_spec("tiny").target == 2


# --- a seeded fuzz of what the allocator reads ------------------------------------------------------

JUNK = [None, True, -1, 0, 1, 2**63, -(2**63), 1e308, "NaN", "Infinity", "-Infinity", "x", "BOGUS", "\x1b[31m",
        [], {}, [1, 2], {"a": 1}, "RUNNING", "QUEUED", 3.5, -0.0]
DOCS = ["spec", "status", "history", "event", "quotas", "state", "grants", "service"]


def _junk(rng: random.Random) -> str:
    v = rng.choice(JUNK)
    if isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity"):
        return v  # bare JSON extensions Python's json accepts
    return json.dumps(v)


def _hostile(rng: random.Random, store, svc) -> None:
    doc = rng.choice(DOCS)
    if doc == "spec":
        raw, version = store.read_versioned("bad", "spec")
        spec = json.loads(raw)
        key = rng.choice(["workers", "min_workers", "max_workers", "target", "requeue", "owner", "config",
                          "created_unix", "generation"])
        text = json.dumps(spec).replace(json.dumps({key: spec[key]})[1:-1], f'"{key}": {_junk(rng)}', 1)
        store.write_if("bad", "spec", text, version)
    elif doc == "status":
        key = rng.choice(["phase", "step", "world_size", "updated_unix", "loss", "reason"])
        put_status(store, "bad", '{"run_id": "bad", "phase": "RUNNING", "step": 5, "%s": %s}' % (key, _junk(rng)))
    elif doc == "history":
        rows = ",".join(f"[{s}, {_junk(rng)}, {rng.choice(['2', _junk(rng)])}, 1, 1, {_junk(rng)}]" for s in range(6))
        put_raw(store, "bad", "history", rng.choice([f"[{rows}]", _junk(rng)]))
    elif doc == "event":
        put_raw(store, "bad", f"events/{time.time_ns():020d}-fz", rng.choice([
            '{"kind": "resized", "resize_s": %s, "time": 1}' % _junk(rng),
            '{"kind": "queued", "time": %s}' % _junk(rng), '{"kind": "allocated", "cause": %s}' % _junk(rng),
            _junk(rng)]))
    else:
        name = {"quotas": QUOTAS_DOC, "state": STATE_DOC, "grants": "grants", "service": "service"}[doc]
        field = {"quotas": "teams", "state": "runs", "grants": "owners", "service": "service"}[doc]
        put_raw(svc, None, name, rng.choice(['{"%s": %s}' % (field, _junk(rng)),
                                            '{"%s": {"default": %s}}' % (field, _junk(rng)), _junk(rng)]))


def fuzz(tmp_path, seed: int, cases: int) -> None:
    rng = random.Random(seed)
    for case in range(cases):
        root = tmp_path / f"c{case}"
        store, svc = open_store(f"file://{root}/runs"), open_store(f"file://{root}/service")
        init_service(svc)
        make_run(store, "good", workers=1, max_workers=1, phase="QUEUED", world=0)
        make_run(store, "bad", workers=1, max_workers=2)
        core = core_of(svc, store, capacity=3, read_budget_s=2.0)
        for _ in range(rng.randint(1, 4)):
            _hostile(rng, store, svc)
        core.register("good", store.url)  # the registry may have been the hostile document
        ticked(core, within_s=15)
        good = store.get_spec("good")
        assert good.target == 1 or read_doc(svc, "quotas")[0], (case, "the good run was not admitted")


def test_a_fuzz_of_what_the_allocator_reads(tmp_path):
    fuzz(tmp_path, seed=39, cases=30)


@pytest.mark.slow
def test_a_longer_fuzz_of_what_the_allocator_reads(tmp_path):
    fuzz(tmp_path, seed=3939, cases=200)
