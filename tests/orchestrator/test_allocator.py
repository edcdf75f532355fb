"""The cluster's allocator (orchestrator/service/allocator.py) on real run stores (file://), with the
cluster's capacity given: what it writes into the runs' specs, the events it leaves, its state read back
after a restart, quotas, and a user's change racing its decision (docs/service.md#the-allocator).

The policy's own properties are tests/orchestrator/test_scheduling_policy.py; the allocator on a live Ray cluster is
tests/orchestrator/test_service.py."""

from __future__ import annotations

import time

import pytest

from orchestrator.store.cluster_names import cluster_key
from orchestrator.store.documents import HistoryRow, RunSpec
from orchestrator.service.allocator import STATE_DOC, AllocatorCore, read_doc, set_quota
from orchestrator.service.demand import demand_of, resize_cost, throughput
from orchestrator.store.run_store import StorageRunStore, open_store
from trainer.config.load import load_raw

BASE = ["data.max_bytes=200000", "data.seq_len=16", "train.global_batch=12", "train.micro_batch=1",
        "train.steps=1000"]


def key(store, run_id: str) -> str:
    """The allocator's name for ``run_id`` of ``store``: its run id and its store."""
    return cluster_key(run_id, store.url)


def make_run(store, run_id: str, *, workers: int, min_workers: int, max_workers: int, phase: str = "RUNNING",
             world: int | None = None, elastic: dict | None = None, step: int = 10) -> RunSpec:
    raw = load_raw("examples/tiny.toml", BASE)
    raw["elastic"] = {**raw.get("elastic", {}), **(elastic or {})}
    spec = RunSpec(run_id=run_id, config=raw, workers=workers, min_workers=min_workers, max_workers=max_workers)
    store.create_run(spec)
    lease = store.acquire(run_id, f"ctl-{run_id}")
    store.put_status(run_id, {"run_id": run_id, "phase": phase, "step": step, "total_steps": 1000,
                              "world_size": workers if world is None else world}, lease)
    store.release(lease)
    return spec


def allocator(store, capacity: int) -> AllocatorCore:
    core = AllocatorCore(store, capacity=lambda cpw, gpw: capacity)
    for run_id in store.list_runs():
        core.register(run_id, store.url)
    return core


def kinds(store, run_id: str, kind: str) -> list[dict]:
    return [e for e in store.events(run_id) if e["kind"] == kind]


@pytest.fixture
def store(tmp_path):
    return open_store(f"file://{tmp_path}/runs")


def test_a_higher_priority_arrival_shrinks_a_preemptible_run_and_is_admitted(store):
    a_running_and_b_queued_above_it(store)
    core = allocator(store, capacity=3)
    core.tick()
    a, b = store.get_spec("a"), store.get_spec("b")
    assert (a.target, a.requeue) == (1, False), "A gives B two workers by shrinking to its minimum"
    assert (b.target, b.requeue) == (2, False)
    (pre,) = kinds(store, "a", "preempted")
    assert pre["action"] == "shrink" and pre["cause"] == "preempted" and "'b'" in pre["reason"]
    (adm,) = kinds(store, "b", "allocated")
    assert adm["action"] == "admit" and adm["workers"] == 2
    assert not kinds(store, "b", "preempted")


def test_suspends_the_lowest_priority_run_whole_when_shrinking_is_not_enough(store):
    make_run(store, "low", workers=2, min_workers=2, max_workers=2, elastic={"priority": 1})
    make_run(store, "keep", workers=1, min_workers=1, max_workers=1, elastic={"preemptible": False})
    make_run(store, "high", workers=2, min_workers=2, max_workers=2, phase="QUEUED", world=0,
             elastic={"priority": 5})
    core = allocator(store, capacity=3)
    core.tick()
    low, keep, high = (store.get_spec(r) for r in ("low", "keep", "high"))
    assert low.requeue and low.target == 0
    assert not keep.requeue and keep.target == 0, "a run that is not preemptible keeps its workers"
    assert high.target == 2
    (sus,) = kinds(store, "low", "allocated")
    assert sus["action"] == "suspend" and sus["cause"] == "preempted" and "'high'" in sus["reason"]
    assert not kinds(store, "low", "preempted"), "the controller writes a suspend's preempted event, at its commit"
    # Once "high" ends, "low" is admitted again: requeue cleared, back at its size.
    lease = store.acquire("high", "ctl-high")
    store.put_status("high", {"run_id": "high", "phase": "FINISHED", "step": 1000}, lease)
    core.tick()
    low = store.get_spec("low")
    assert not low.requeue and low.target == 2
    assert key(store, "high") not in core.runs(), "an ended run leaves the registry"


def a_running_and_b_queued_above_it(store) -> None:
    make_run(store, "a", workers=3, min_workers=1, max_workers=3)
    make_run(store, "b", workers=2, min_workers=2, max_workers=2, phase="QUEUED", world=0,
             elastic={"priority": 10})


def test_a_restarted_allocator_reads_its_state_back_and_changes_nothing(store):
    a_running_and_b_queued_above_it(store)
    first = allocator(store, capacity=3)
    first.tick()
    events = {r: len(store.events(r)) for r in ("a", "b")}
    specs = {r: store.get_spec(r) for r in ("a", "b")}
    again = AllocatorCore(open_store(store.url), capacity=lambda cpw, gpw: 3)  # no register calls
    assert again.runs() == {key(store, "a"): ("a", store.url), key(store, "b"): ("b", store.url)}
    plan = again.tick()
    assert plan.targets == {key(store, "a"): 1, key(store, "b"): 2}
    assert {r: len(store.events(r)) for r in ("a", "b")} == events, "a restart decided again"
    assert {r: store.get_spec(r).generation for r in ("a", "b")} == {r: s.generation for r, s in specs.items()}
    doc = read_doc(store, STATE_DOC)[0]
    assert doc["targets"] == {key(store, "a"): 1, key(store, "b"): 2} and doc["capacity"] == 3


def test_a_team_over_its_quota_gives_back_first(store):
    make_run(store, "v1", workers=2, min_workers=1, max_workers=2, elastic={"team": "vision"})
    make_run(store, "l1", workers=1, min_workers=1, max_workers=1, elastic={"team": "lang"})
    set_quota(store, "vision", 1)
    allocator(store, capacity=8).tick()
    assert store.get_spec("v1").target == 1
    assert kinds(store, "v1", "preempted")[0]["cause"] == "quota"
    assert store.get_spec("l1").target == 0


def test_a_waiting_run_says_why(store):
    make_run(store, "big", workers=3, min_workers=3, max_workers=3, elastic={"preemptible": False})
    make_run(store, "next", workers=2, min_workers=2, max_workers=2, phase="QUEUED", world=0)
    core = allocator(store, capacity=3)
    core.tick()
    why = read_doc(store, STATE_DOC)[0]["waiting"][key(store, "next")]
    assert "needs 2 workers together" in why and "0 free" in why
    assert store.get_spec("next").target == 0


class RacingStore(StorageRunStore):
    """A real store in which a user's resize lands between the allocator's read of a spec and its write."""

    race: dict | None = None

    def get_spec(self, run_id):
        spec = super().get_spec(run_id)
        if self.race and self.race.get("run_id") == run_id:
            race, self.race = self.race, None
            self.update_spec(run_id, expected=spec.generation, **race["changes"])
        return spec


def test_a_users_resize_racing_a_decision_loses_neither(tmp_path):
    store = RacingStore(f"file://{tmp_path}/runs")
    a_running_and_b_queued_above_it(store)
    core = allocator(store, capacity=3)
    store.race = {"run_id": "a", "changes": {"workers": 2, "target": 0}}  # `etrain resize a --workers 2`
    core.tick()
    a = store.get_spec("a")
    assert a.workers == 2 and a.target == 0, "the allocator overwrote the user's resize"
    assert not kinds(store, "a", "preempted")
    core.tick()  # the next decision reads the user's size and still makes room for b
    a = store.get_spec("a")
    assert a.workers == 2 and a.target == 1 and store.get_spec("b").target == 2


def test_demand_reads_throughput_resize_cost_and_queue_time(store):
    spec = make_run(store, "r", workers=2, min_workers=1, max_workers=4, elastic={"priority": 3, "team": "t"})
    now = time.time()
    rows = [HistoryRow(i, 1.0, 2 if i < 10 else 4, 0, now, 0.5 if i < 10 else 0.3) for i in range(1, 20)]
    events = [{"kind": "resized", "resize_s": 1.2, "time": now}, {"kind": "resized", "resize_s": 3.0, "time": now},
              {"kind": "queued", "time": now + 5}]
    d = demand_of(spec, {"phase": "RUNNING", "step": 19}, rows, events, sizes=(1, 2, 4), global_batch=12,
                  total_steps=100)
    assert d.throughput == {2: pytest.approx(24.0), 4: pytest.approx(40.0)}
    assert d.resize_cost_s == pytest.approx(2.1) and d.queued_since == pytest.approx(now + 5)
    assert (d.priority, d.team, d.preemptible, d.allocated, d.remaining) == (3, "t", True, 2, 81 * 12)
    assert demand_of(spec, {"phase": "FINISHED"}, rows, events) is None
    assert demand_of(spec, {"phase": "QUEUED"}, [], []).allocated == 0
    assert throughput(rows[:2], 12) == {}, "fewer than 3 steps at a size is no measurement"
    assert resize_cost([]) == 2.0


def test_etrain_quota_needs_the_admin_token_and_lists_what_teams_hold(store, capsys, monkeypatch):
    import json

    from orchestrator.service.auth import ADMIN_TOKEN_ENV, new_admin_token
    from orchestrator.cli.main import main

    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    assert main(["quota", "vision", "--max-workers", "4", "--store", store.url]) == 2
    assert "has none yet" in capsys.readouterr().err
    with open(new_admin_token(store)) as f:
        admin = f.read().strip()
    monkeypatch.setenv("ETRAIN_HOME", str(store.url[len("file://"):]) + "-elsewhere")  # not this user's file
    assert main(["quota", "vision", "--max-workers", "4", "--store", store.url, "--token", "etr_" + "0" * 64]) == 2
    assert "needs the admin token" in capsys.readouterr().err
    assert main(["quota", "vision", "--max-workers", "4", "--store", store.url, "--token", admin]) == 0
    assert main(["quota", "vision", "--max-workers", "-1", "--store", store.url, "--token", admin]) == 2
    assert "--max-workers -1" in capsys.readouterr().err
    make_run(store, "v1", workers=2, min_workers=1, max_workers=2, elastic={"team": "vision"})
    allocator(store, capacity=8).tick()
    assert main(["quota", "--json", "--store", store.url]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["teams"]["vision"] == {"max_workers": 4, "held": 2}
    assert main(["quota", "vision", "--remove", "--store", store.url, "--token", admin]) == 0
    assert main(["quota", "--json", "--store", store.url]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["teams"]["vision"]["max_workers"] is None


def test_the_cluster_metrics_show_the_decision(store):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    a_running_and_b_queued_above_it(store)
    core = allocator(store, capacity=3)
    core.tick()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(core.metrics)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples}
    assert samples[("etrain_cluster_capacity_workers", ())] == 3
    assert samples[("etrain_cluster_runs", (("phase", "QUEUED"),))] == 1
    assert samples[("etrain_cluster_runs", (("phase", "RUNNING"),))] == 1
    assert samples[("etrain_cluster_allocated_workers", (("priority", "0"), ("run_id", "a"), ("run_key", key(store, "a")), ("team", "default")))] == 1
    assert samples[("etrain_cluster_allocated_workers", (("priority", "10"), ("run_id", "b"), ("run_key", key(store, "b")), ("team", "default")))] == 2
    assert samples[("etrain_cluster_preemptions_total", (("action", "shrink"), ("cause", "preempted")))] == 1
    assert samples[("etrain_cluster_decisions_total", (("action", "admit"),))] == 1
    assert samples[("etrain_allocator_decision_seconds_count", ())] == 1
    assert 0 < samples[("etrain_allocator_decision_seconds_sum", ())] < 5


def test_etrain_queue_says_why_the_allocator_does_not_admit_a_run(store, capsys):
    import json

    from orchestrator.cli.main import main

    make_run(store, "big", workers=3, min_workers=3, max_workers=3, elastic={"preemptible": False})
    make_run(store, "next", workers=2, min_workers=2, max_workers=2, phase="QUEUED", world=0)
    allocator(store, capacity=3).tick()
    capsys.readouterr()
    assert main(["queue", "--json", "--store", store.url]) == 0
    rows = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert "needs 2 workers together: 0 free" in rows["next"]["allocator"]
    assert "the allocator: needs 2 workers together" in rows["next"]["waits_for"]
    assert "allocator" not in rows["big"]


def test_a_run_still_initializing_is_neither_holding_nor_queued(store):
    """A run registers before its gang is asked for: counted as holding its size then, it made the allocator
    shrink others for "capacity" before the newcomer had even queued."""
    make_run(store, "a", workers=3, min_workers=1, max_workers=3)
    make_run(store, "new", workers=2, min_workers=2, max_workers=2, phase="INITIALIZING", world=0,
             elastic={"priority": 10})
    core = allocator(store, capacity=3)
    core.tick()
    assert store.get_spec("a").target == 0 and not kinds(store, "a", "preempted")
    assert core.runs()[key(store, "new")] == ("new", store.url), "an initializing run stays registered"


def test_a_lost_node_alone_writes_no_target(store):
    """The controller already runs at what it can form and keeps its replacements pending: a target would
    only keep it small once a node joins."""
    make_run(store, "r", workers=3, min_workers=1, max_workers=3)
    allocator(store, capacity=2).tick()
    assert store.get_spec("r").target == 0 and not kinds(store, "r", "allocated")


def test_a_run_shrunk_for_lost_capacity_gets_its_size_back_when_the_capacity_returns(store):
    make_run(store, "r", workers=3, min_workers=1, max_workers=3)
    make_run(store, "q", workers=3, min_workers=3, max_workers=3, phase="QUEUED", world=0)  # waits for room
    allocator(store, capacity=2).tick()  # a node lost while a run waits: the run gives back
    assert store.get_spec("r").target == 2 and kinds(store, "r", "allocated")[0]["cause"] == "capacity"
    # The node is back: the user's size again. A run with measurements that show no gain from a grow
    # would not be grown into idle capacity; it is restored all the same (the size it asked for).
    flat = {2: 10.0, 3: 10.0}  # no gain from a third worker
    lease = store.acquire("r", "ctl-r")
    store.put_history("r", [HistoryRow(i, 1.0, n, 12 * i, time.time(), 1.2) for n in (2, 3) for i in range(1, 5)])
    store.release(lease)
    assert throughput(store.get_history("r"), 12) == flat
    core = allocator(store, capacity=3)
    core.tick()
    r = store.get_spec("r")
    assert r.target == 0 and r.workers == 3
    assert kinds(store, "r", "allocated")[-1]["cause"] == "restored"
    core.tick()
    assert len(kinds(store, "r", "allocated")) == 2, "restored twice"


def test_grow_into_idle_false_keeps_a_run_at_the_size_its_user_asked_for(store):
    """Idle capacity grows a run up to max_workers, unless its [elastic] grow_into_idle is false: then only its
    user's resizes take it above `workers` (and a bad value is refused naming the key)."""
    from checkpointing.errors import ConfigError
    from orchestrator.config import ElasticConfig

    make_run(store, "free", workers=1, min_workers=1, max_workers=3)
    make_run(store, "pinned", workers=1, min_workers=1, max_workers=3, elastic={"grow_into_idle": False})
    allocator(store, capacity=8).tick()
    assert store.get_spec("free").target == 3
    assert store.get_spec("pinned").target in (0, 1) and not kinds(store, "pinned", "allocated")
    with pytest.raises(ConfigError, match="elastic.grow_into_idle='no' must be true or false"):
        ElasticConfig(workers=1, grow_into_idle="no")


def first_come_no_preemption(st, waiting: dict[str, str]) -> None:
    """A second policy's admission rule: queued runs in the order they came, each admitted at its minimum
    when that fits in what is free; nobody gives anything back for it, whatever its priority."""
    for r in sorted((r for r in st.runs.values() if st.target[r.run_id] == 0), key=lambda r: r.queued_since):
        need = st.smallest(r)
        if need and need <= st.free():
            st.set(r, need, "admitted", "first come, first served")
        else:
            waiting[r.run_id] = f"needs {need} workers: {max(0, st.free())} free (first come, first served)"


def fcfs_policy():
    from orchestrator.service.policy import RulePolicy
    from orchestrator.service.rules import hold_limits

    return RulePolicy("fcfs", (hold_limits, first_come_no_preemption))


def test_another_policy_through_the_seam_admits_in_order_and_preempts_nobody(store, monkeypatch):
    """The allocator asks whatever policy it is given: under a first-come-first-served policy without
    preemption, the higher-priority newcomer that the default rules admit by shrinking A waits instead, and
    is admitted once A ends. A deployment names the policy (ETRAIN_SCHEDULING_POLICY), a bad name is refused
    naming the variable."""
    from checkpointing.errors import ConfigError
    from orchestrator.service.policy import POLICIES, policy_named, register_policy

    a_running_and_b_queued_above_it(store)
    monkeypatch.setitem(POLICIES, "fcfs", "")  # the name is gone again after the test
    register_policy("fcfs", f"{__name__}:fcfs_policy")
    policy = policy_named("fcfs")
    assert policy.name == "fcfs" and policy_named("default").name == "default"
    core = AllocatorCore(store, capacity=lambda cpw, gpw: 3, policy=policy)
    for run_id in store.list_runs():
        core.register(run_id, store.url)
    core.tick()
    a, b = store.get_spec("a"), store.get_spec("b")
    assert (a.target, b.target) == (0, 0) and not kinds(store, "a", "preempted"), "nobody gives back"
    assert "first come, first served" in core.last["waiting"][key(store, "b")]
    lease = store.acquire("a", "ctl-a")
    store.put_status("a", {"run_id": "a", "phase": "FINISHED", "step": 1000}, lease)
    store.release(lease)
    core.tick()
    assert store.get_spec("b").target == 2 and kinds(store, "b", "allocated")[0]["reason"] == "first come, first served"
    with pytest.raises(ConfigError, match=r"ETRAIN_SCHEDULING_POLICY='lifo' is no scheduling policy"):
        policy_named("lifo")
