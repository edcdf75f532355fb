"""The allocator's policy (orchestrator.service.policy): pure logic, plain pytest, no Ray.

Scenarios a platform team would check by hand, then the properties over 600 seeded random clusters:
an admitted run never below its minimum, capacity and quotas hold, only valid sizes, no priority
inversion, no resize whose cost exceeds its gain, and never a non-preemptible run preempted.
"""

from __future__ import annotations

import math
import random

from orchestrator.service.policy import Admit, ClusterView, RunDemand, SetTarget, Suspend
from orchestrator.service.rules import decide


def linear(n_max: int, per_worker: float = 10.0) -> dict[int, float]:
    return {n: per_worker * n for n in range(1, n_max + 1)}


def apply(runs: list[RunDemand], plan) -> list[RunDemand]:
    """The runs as they are once the plan is carried out (targets become their sizes)."""
    from dataclasses import replace

    return [replace(r, allocated=plan.targets[r.run_id]) for r in runs]


def test_a_run_grows_into_an_idle_cluster_shrinks_for_a_higher_priority_run_and_grows_back():
    a = RunDemand(run_id="a", priority=0, min_workers=1, max_workers=3, throughput=linear(3))
    plan = decide([a], ClusterView(capacity=3), now=0)
    assert plan.targets == {"a": 3} and plan.decisions == [Admit("a", 3, "idle capacity")]
    runs = apply([a], plan)
    b = RunDemand(run_id="b", priority=10, min_workers=2, max_workers=2, queued_since=5)
    plan = decide([*runs, b], ClusterView(capacity=3), now=5)
    assert plan.targets == {"a": 1, "b": 2}
    assert plan.decisions == [SetTarget("a", 1, "shrink", "preempted", "preempted by run 'b' (priority 10)"),
                              Admit("b", 2, "admitted by preemption")]
    runs = apply([*runs, b], plan)
    plan = decide([runs[0]], ClusterView(capacity=3), now=9)  # b finished
    assert plan.targets == {"a": 3} and plan.decisions == [SetTarget("a", 3, "grow", "idle", "idle capacity")]


def test_no_room_for_either_the_second_run_waits_and_says_why():
    a = RunDemand(run_id="a", priority=0, min_workers=3, max_workers=3, allocated=3)
    b = RunDemand(run_id="b", priority=0, min_workers=2, max_workers=2, queued_since=1)
    plan = decide([a, b], ClusterView(capacity=3), now=1)
    assert plan.targets == {"a": 3, "b": 0} and plan.decisions == []
    assert plan.waiting == {"b": "needs 2 workers together: 0 free"}


def test_the_ladder_shrinks_first_then_suspends_the_lowest_priority_and_never_touches_the_rest():
    low = RunDemand(run_id="low", priority=0, min_workers=2, max_workers=4, allocated=4)
    mid = RunDemand(run_id="mid", priority=5, min_workers=2, max_workers=4, allocated=4)
    fixed = RunDemand(run_id="fixed", priority=-1, preemptible=False, min_workers=2, max_workers=2, allocated=2)
    cluster = ClusterView(capacity=10)
    # 3 needed: shrinking is enough (the lowest priority first), nobody is suspended.
    plan = decide([low, mid, fixed, RunDemand(run_id="hi", priority=9, min_workers=3, max_workers=3)], cluster, 0)
    assert plan.targets == {"low": 2, "mid": 3, "fixed": 2, "hi": 3}
    assert not any(isinstance(d, Suspend) for d in plan.decisions)
    # 6 needed: shrinking gives 4 at most: the lowest-priority run is suspended, the other shrunk by what is left.
    plan = decide([low, mid, fixed, RunDemand(run_id="hi", priority=9, min_workers=6, max_workers=6)], cluster, 0)
    assert plan.targets == {"low": 0, "mid": 2, "fixed": 2, "hi": 6}
    assert Suspend("low", "preempted", "preempted by run 'hi' (priority 9)") in plan.decisions
    # 9 needed: more than the preemptible runs of lower priority hold: nothing moves, it waits.
    plan = decide([low, mid, fixed, RunDemand(run_id="hi", priority=9, min_workers=9, max_workers=9)], cluster, 0)
    assert plan.targets == {"low": 4, "mid": 4, "fixed": 2, "hi": 0} and plan.decisions == []
    assert plan.waiting["hi"] == "needs 9 workers together: 0 free, 8 reclaimable from preemptible runs"


def test_growth_follows_priority_then_the_largest_gain_per_worker_and_respects_quotas():
    flat = RunDemand(run_id="flat", min_workers=1, max_workers=4, allocated=1, throughput={1: 10, 2: 11, 3: 11.5,
                                                                                          4: 11.8})
    steep = RunDemand(run_id="steep", min_workers=1, max_workers=4, allocated=1, throughput=linear(4))
    plan = decide([flat, steep], ClusterView(capacity=5), 0)
    assert plan.targets == {"flat": 1, "steep": 4}
    plan = decide([flat, steep], ClusterView(capacity=5, quotas={"": 3}), 0)  # both in the default team
    assert plan.targets == {"flat": 1, "steep": 2}
    vip = RunDemand(run_id="vip", priority=3, min_workers=1, max_workers=3, allocated=1, throughput={1: 1, 3: 1.2})
    plan = decide([flat, steep, vip], ClusterView(capacity=6), 0)
    assert plan.targets["vip"] == 3 and plan.targets["steep"] == 2


def test_a_resize_must_save_more_than_it_costs():
    """10 samples/s a worker; 1,000 samples left at 1 worker: 100 s, at 2 workers 50 s. With a resize cost of
    20 s (x2 margin: 40 s) it grows; with 30 s (60 s) it does not."""
    from dataclasses import replace

    r = RunDemand(run_id="r", min_workers=1, max_workers=2, allocated=1, throughput=linear(2), remaining=1000)

    assert decide([replace(r, resize_cost_s=20)], ClusterView(capacity=2), 0).targets == {"r": 2}
    assert decide([replace(r, resize_cost_s=30)], ClusterView(capacity=2), 0).targets == {"r": 1}


def test_lost_capacity_and_quota_cuts_shrink_the_lowest_priority_first_and_never_below_a_minimum():
    a = RunDemand(run_id="a", priority=0, min_workers=2, max_workers=4, allocated=4, team="x")
    b = RunDemand(run_id="b", priority=5, min_workers=2, max_workers=4, allocated=4, team="x")
    plan = decide([a, b], ClusterView(capacity=6), 0)  # a node of 2 drained
    assert plan.targets == {"a": 2, "b": 4}
    assert plan.decisions == [SetTarget("a", 2, "shrink", "capacity", "the cluster holds 6 workers")]
    plan = decide([a, b], ClusterView(capacity=3), 0)
    assert plan.targets == {"a": 0, "b": 3}
    plan = decide([a, b], ClusterView(capacity=8, quotas={"x": 5}), 0)
    assert plan.targets == {"a": 2, "b": 3}  # shrinking both is enough: nobody is suspended


def test_only_valid_sizes():
    r = RunDemand(run_id="r", min_workers=2, max_workers=8, sizes=(2, 4, 8), allocated=5, throughput=linear(8))
    assert decide([r], ClusterView(capacity=7), 0).targets == {"r": 4}
    assert decide([r], ClusterView(capacity=9), 0).targets == {"r": 8}


def random_cluster(rng: random.Random):
    runs = []
    capacity = rng.randint(1, 40)
    for i in range(rng.randint(1, 12)):
        lo = rng.randint(1, 6)
        hi = lo + rng.randint(0, 8)
        sizes = tuple(n for n in range(lo, hi + 1) if rng.random() < 0.7) or (lo,)
        tp = {n: n ** rng.uniform(0.3, 1.0) * 10 for n in sizes}
        runs.append(RunDemand(run_id=f"r{i}", priority=rng.choice([0, 0, 1, 5, 10]), team=rng.choice("xyz"),
                              preemptible=rng.random() < 0.8, min_workers=lo, max_workers=hi, sizes=sizes,
                              allocated=rng.choice([0, 0, rng.choice(sizes), rng.randint(1, hi + 2)]),
                              queued_since=rng.uniform(0, 100), throughput=tp,
                              remaining=rng.choice([math.inf, rng.uniform(10, 1e5)]),
                              resize_cost_s=rng.choice([1.0, 2.0, 60.0])))
    quotas = {t: rng.randint(2, 30) for t in "xyz" if rng.random() < 0.4}
    return runs, ClusterView(capacity=capacity, quotas=quotas)


def test_properties_over_random_clusters():
    rng = random.Random(30)
    for _ in range(600):
        runs, cluster = random_cluster(rng)
        plan = decide(runs, cluster, now=100.0)
        by_id = {r.run_id: r for r in runs}
        t = plan.targets
        assert sum(t.values()) <= cluster.capacity
        for team, q in cluster.quotas.items():
            assert sum(n for rid, n in t.items() if by_id[rid].team == team) <= q
        for rid, n in t.items():
            r = by_id[rid]
            assert n == 0 or (n in r.valid() and n >= r.min_workers), (r, n)  # valid, never below the minimum
        free = cluster.capacity - sum(t.values())
        for rid, why in plan.waiting.items():
            w = by_id[rid]
            assert t[rid] == 0
            if why.startswith("needs"):  # no priority inversion: reclaiming all it may reclaim was not enough
                lent = sum(n - by_id[o].valid()[0] for o, n in t.items()
                           if n and by_id[o].preemptible and by_id[o].priority == w.priority)
                lower = sum(n for o, n in t.items() if by_id[o].preemptible and by_id[o].priority < w.priority)
                assert free + lent + lower < w.valid()[0], (w, plan)
        for d in plan.decisions:
            r = by_id[d.run_id]
            if not r.preemptible and r.allocated in r.valid():
                assert not (isinstance(d, Suspend) and d.cause == "preempted"), d
                assert not (isinstance(d, SetTarget) and d.cause == "preempted"), d
            if isinstance(d, SetTarget) and d.action == "grow" and r.allocated in r.valid():
                saved = r.seconds_left(r.allocated) - r.seconds_left(d.workers)
                assert math.isinf(r.remaining) or saved > 2.0 * r.resize_cost_s, (r, d)
        # A second decision on the plan's outcome changes nothing: no thrashing.
        again = decide(apply(runs, plan), cluster, now=100.0)
        assert again.targets == t, (runs, plan, again)
