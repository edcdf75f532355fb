"""A draining node makes the run shrink off it (orchestrator/controller/drain.py): the decision as a pure function,
and the controller stepped against the fake group with a drain source the test controls (no Ray).

The Ray test (a node drained through Ray's own drain call under a training run, then a node added)
is in tests/orchestrator/test_drain_ray.py.
"""

from __future__ import annotations

import time

import pytest

from orchestrator.controller.drain import DrainCommit, DrainHold, DrainShrink, DrainWatch, decide
from orchestrator.controller.run_policy import ScalingPolicy
from tests.orchestrator import test_controller as base
from tests.orchestrator.test_controller import STEPS, assert_finished_cleanly

rig = base.rig  # the controller rig's fixture

VALID = (1, 2, 3, 4, 6, 12)


def decision(members=("a", "b", "c"), draining=None, ready=0, started=0, desired=3, lo=1, hi=3,
             deadline_in=60.0, committed=False):
    node_of = {w: f"n-{w}" for w in members}
    draining = draining if draining is not None else {"n-b": time.time() + deadline_in}
    return decide(members=list(members), node_of=node_of, draining=draining, ready_elsewhere=ready,
                  started_elsewhere=started, desired=desired, scaling=ScalingPolicy(min_workers=lo, max_workers=hi),
                  valid_sizes=VALID, now_unix=time.time(), commit_margin_s=30.0, committed=committed)


def test_no_member_on_a_draining_node_is_no_decision():
    assert decision(draining={"n-elsewhere": time.time() + 5}) is None
    assert decision(draining={}) is None


def test_enough_members_elsewhere_shrink_off_the_node():
    d = decision()
    assert isinstance(d, DrainShrink) and d.size == 2 and d.leaving == ("b",)
    assert "draining" in d.reason
    # a spare that is up elsewhere takes the leaving member's place: same size, without it
    d = decision(ready=1)
    assert isinstance(d, DrainShrink) and d.size == 3 and d.leaving == ("b",)


def test_below_min_workers_holds_while_replacements_start_then_commits_near_the_deadline():
    d = decision(members=("a", "b"), desired=2, lo=2, hi=2)
    assert isinstance(d, DrainHold) and d.replacements == 1
    assert isinstance(decision(members=("a", "b"), desired=2, lo=2, hi=2, started=1), DrainHold)
    assert decision(members=("a", "b"), desired=2, lo=2, hi=2, started=1).replacements == 0
    near = decision(members=("a", "b"), desired=2, lo=2, hi=2, deadline_in=10.0)
    assert isinstance(near, DrainCommit) and "committing a checkpoint" in near.reason
    assert isinstance(decision(members=("a", "b"), desired=2, lo=2, hi=2, deadline_in=10.0, committed=True), DrainHold)
    # no deadline: never "near"
    assert isinstance(decision(members=("a", "b"), desired=2, lo=2, hi=2, draining={"n-b": None}), DrainHold)


def watch(r, draining: dict) -> None:
    r.ctl.drains = DrainWatch(source=lambda: draining, poll_s=0.0)


def node_of_rank(r, rank: int) -> str:
    return r.group.info(r.ctl.members[rank])["node_id"]


def test_a_draining_node_shrinks_the_run_off_it_with_no_step_lost_and_a_joining_node_grows_it_back(rig):
    r = rig(workers=3, max_workers=3, capacity=3)
    draining: dict = {}
    watch(r, draining)
    r.drive_to_step(6)
    leaving = r.ctl.members[1]
    draining[node_of_rank(r, 1)] = time.time() + 60
    r.group.capacity -= 1  # the draining node's slot goes with it: its replacement waits for a node
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 2 and leaving not in r.ctl.members and leaving not in r.group.workers
    pre = r.events("preempted")
    assert len(pre) == 1 and pre[0]["reason"] == "drain" and pre[0]["action"] == "shrink"
    assert pre[0]["node"] == f"node{int(leaving[1:].split('-')[0]):04d}-fake"
    assert pre[0]["from_workers"] == 3 and pre[0]["to_workers"] == 2 and pre[0]["ranks"] == [1]
    assert 55 < pre[0]["deadline_in_s"] <= 60
    r.drive_to_step(r.ctl.last_completed_step() + 3)
    assert len(r.ctl.members) == 2 and len(r.ctl.spares) == 1  # the replacement waits for capacity
    r.group.add_capacity(1)  # a node joins
    r.drive(lambda r: len(r.ctl.members) == 3 and r.ctl.state.name == "RUNNING")
    r.drive()
    assert_finished_cleanly(r)
    assert [e["world_size"] for e in r.events("formed")] == [3, 2, 3]
    assert r.events("failure") == [] and r.status()["failures"] == 0  # not a failure
    assert r.group.steps_trained == STEPS  # no step lost
    assert "draining" in r.events("resized")[0]["reason"]


def test_below_min_workers_the_run_trains_on_the_draining_node_until_its_replacement_is_up(rig):
    r = rig(workers=2, min_workers=2, max_workers=2, capacity=2)
    draining: dict = {}
    watch(r, draining)
    r.drive_to_step(6)
    leaving = r.ctl.members[1]
    draining[node_of_rank(r, 1)] = time.time() + 600
    r.drive_to_step(9)
    assert leaving in r.ctl.members and len(r.ctl.spares) == 1  # held; a replacement started, pending
    assert [e["action"] for e in r.events("preempted")] == ["hold"]
    r.group.add_capacity(1)
    r.drive(lambda r: leaving not in r.ctl.members and r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 2
    assert [e["action"] for e in r.events("preempted")] == ["hold", "shrink"]
    r.drive()
    assert_finished_cleanly(r)
    assert r.events("failure") == [] and r.group.steps_trained == STEPS


def test_below_min_workers_with_the_deadline_near_a_checkpoint_is_committed(rig):
    r = rig(workers=2, min_workers=2, max_workers=2, capacity=2)
    draining: dict = {}
    watch(r, draining)
    r.drive_to_step(6)  # the last commit: step 5
    draining[node_of_rank(r, 1)] = time.time() + 10
    r.drive_to_step(10)
    commit = r.events("preempted")[0]
    assert commit["action"] == "commit" and r.ctl.committed_step >= commit["step"] >= 6
    # then it trains on there while a replacement starts; the node's loss would be recovered from that commit
    assert [e["action"] for e in r.events("preempted")] == ["commit", "hold"] and len(r.ctl.spares) == 1
    assert len(r.ctl.members) == 2 and r.events("failure") == []


def test_a_failing_drain_read_keeps_the_last_one():
    calls = []

    def source():
        calls.append(1)
        if len(calls) > 1:
            raise ConnectionError("gcs away")
        return {"n": None}

    w = DrainWatch(source=source, poll_s=1.0)
    assert w.poll(0.0) == {"n": None}
    assert w.poll(0.5) == {"n": None} and len(calls) == 1  # throttled
    assert w.poll(1.5) == {"n": None} and len(calls) == 2  # the read failed: the last one kept


# --- the chaos kinds drain_node and add_node (plan and report; injected on Ray in tests/orchestrator/test_drain_ray.py) ---


def test_drain_and_add_node_faults_load_and_bad_values_name_the_field():
    from checkpointing.errors import ConfigError
    from orchestrator.chaos.plan import load_plan

    plan = load_plan(None, ["kind=drain_node,at_step=5,rank=1,deadline_s=30", "kind=add_node,after_fault=0,cpus=2"])
    assert (plan.faults[0].deadline_s, plan.faults[1].cpus) == (30.0, 2)
    for bad, says in (("kind=drain_node,at_step=1,deadline_s=0", "deadline_s=0 must be > 0"),
                      ("kind=add_node,at_step=1,cpus=0", "cpus=0 must be >= 1")):
        try:
            load_plan(None, [bad])
        except ConfigError as e:
            assert says in str(e)
        else:
            raise AssertionError(f"{bad} loaded")


def test_a_drain_row_is_detected_by_the_notice_and_recovered_by_the_resize_off_the_node():
    from orchestrator.chaos.injector import Injection
    from orchestrator.chaos.report import assess

    drain = Injection(0, "drain_node", 10.0, 5, {"rank": 1, "node": "n1", "deadline_s": 60.0}, committed=4)
    add = Injection(1, "add_node", 14.0, 9, {"cpus": 1, "node": "n9"})
    events = [{"kind": "preempted", "time": 10.4, "reason": "drain", "action": "shrink"},
              {"kind": "resized", "time": 11.6, "first_step_unix": 11.8, "from_workers": 3, "to_workers": 2,
               "reason": "node n1 is draining: 3 -> 2 workers"},
              {"kind": "resized", "time": 20.0, "first_step_unix": 20.3, "from_workers": 2, "to_workers": 3,
               "reason": "growing 2 -> 3 workers"}]
    d, a = assess([drain, add], events, [])
    assert d["detected"] and d["time_to_detect_s"] == pytest.approx(0.4) and d["action"] == "shrink"
    assert d["recovered"] and d["steps_lost"] == 0 and d["before_deadline"]
    assert a["recovered"] and a["grew"] == [2, 3] and a["time_to_recover_s"] == pytest.approx(6.3)
    # the node went before the run could leave it: recovered as a failure, its steps lost counted
    lost = [events[0], {"kind": "recovered", "time": 30.0, "first_step_unix": 31.0, "steps_lost": 1,
                        "restored_step": 4}]
    (d,) = assess([drain], lost, [])
    assert d["recovered"] and d["steps_lost"] == 1 and "as a failure" in d["note"]


def test_preemptions_are_counted_by_action_and_reason(rig):
    from trainer.observe.endpoint import MetricsEndpoint
    from trainer.observe.metrics import RunMetrics
    from orchestrator.controller.observers import MetricsObserver
    from tests.trainer.test_metrics import sample, scrape

    r = rig(workers=3, max_workers=3, capacity=3)
    draining: dict = {}
    watch(r, draining)
    metrics = RunMetrics("r")

    class Counting(MetricsObserver):
        def on_poll(self, ctl):  # the fake workers have no telemetry
            pass

    r.ctl.observers.observers.append(Counting(metrics))
    ep = MetricsEndpoint(metrics, addr="127.0.0.1", port=0, file_sd_dir="")
    try:
        r.drive_to_step(4)
        draining[node_of_rank(r, 2)] = None  # a drain without a deadline
        r.drive(lambda r: len(r.ctl.members) == 2 and r.ctl.state.name == "RUNNING")
        s = scrape(ep.url)
        assert sample(s, "etrain_preemptions_total", action="shrink", reason="drain") == 1
        assert r.events("preempted")[0]["deadline_unix"] is None
    finally:
        ep.close()
