"""The default scheduling policy: how many workers each run of a cluster should have, as ordered rules.

    plan = decide(runs, ClusterView(capacity=64, quotas={"vision": 16}), now)   # default_policy().decide
    policy = RulePolicy("fcfs", (hold_limits, my_admission))                    # rules reused in another

The values and the seam are :mod:`orchestrator.service.policy`. The rules, in the order they apply:

1. **Capacity and quotas hold.** Runs keep their size (snapped to a valid one). When the
   cluster holds fewer workers than the runs have (nodes drained or lost) or a team is
   over its quota, the lowest-priority runs give back first: preemptible before not,
   shrunk a valid size at a time toward their minimum, suspended (and requeued) only
   below it. An admitted run is never below its minimum.
2. **Admission, highest priority first, then first come.** A queued run is admitted
   when its minimum fits together (a gang; the workers above it are its elastic part).
   If the free workers are too few, capacity is taken from preemptible runs by the
   cheapest rung: shrink toward their minimum (from memory, no step lost) the runs of
   the same or a lower priority (what idle capacity lent them above their minimum goes
   back first), else suspend the lowest-priority runs below the newcomer's priority
   whole. Never kill. It is all or
   nothing: a run that cannot get its minimum even so takes nothing and waits, with the
   reason; runs of lower priority may still be admitted into what is free (they can be
   shrunk or suspended for it later), so nothing waits behind a run that cannot start.
3. **Growth into idle capacity**, highest priority first, then the largest throughput
   gain per added worker (from the run's measured, or planned, throughput at each size),
   up to ``max_workers`` and the team's quota, leaving free the minimum of every queued
   run that waits at the same or a higher priority (no starvation). A run grows only
   when the time it saves on its remaining work exceeds ``margin`` times its measured
   resize cost: no resize whose cost exceeds its gain, and no thrashing.
4. **Restoring what a lost node took.** A run shrunk below the size its user asked for
   (``workers``) while the cluster had lost capacity gets that size back once it fits
   again, whatever its measured gain: a lost node is not a decision to keep the run small.
   Its target is withdrawn (:class:`~orchestrator.service.policy.Restore`).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterable

from .policy import ClusterView, Plan, RulePolicy, RunDemand, Targets

# A resize must save this many times its own cost to be worth making.
MARGIN = 2.0


def _give_back(st: Targets, shrinkable: list[RunDemand], suspendable: list[RunDemand], need: float, cause: str,
               why: str) -> float:
    """Free ``need`` workers by the cheapest rung: shrink the ``shrinkable`` runs (in order) a valid size at
    a time toward their minimum; where that cannot be enough, first suspend as few of the ``suspendable``
    runs as will do (in order), then shrink. Returns what is still missing (> 0: not enough)."""
    room = {r.run_id: st.target[r.run_id] - st.smallest(r) for r in shrinkable}
    reach = sum(room.values())
    suspended = []
    for r in suspendable:
        if reach >= need:
            break
        if st.target[r.run_id]:
            suspended.append(r)
            reach += st.target[r.run_id] - room.get(r.run_id, 0)  # its minimum is freed too
    for r in suspended:
        need -= st.target[r.run_id]
        st.set(r, 0, cause, why)
    for r in shrinkable:
        while need > 0 and st.target[r.run_id] > r.min_workers:
            n = st.smaller(r, st.target[r.run_id])
            if n < r.min_workers:
                break
            need -= st.target[r.run_id] - n
            st.set(r, n, cause, why)
    return need


def _shed_order(runs: Iterable[RunDemand]) -> list[RunDemand]:
    """Who gives back first: preemptible before not, lower priority first, the newest first."""
    return sorted(runs, key=lambda r: (not r.preemptible, r.priority, -r.queued_since, r.run_id))


def hold_limits(st: Targets, waiting: dict[str, str]) -> None:
    """Rule 1: the cluster's capacity and each team's quota."""
    if st.free() < 0:
        order = _shed_order(r for r in st.runs.values() if st.target[r.run_id])
        _give_back(st, order, order, -st.free(), "capacity", f"the cluster holds {st.cluster.capacity} workers")
    for team, quota in st.cluster.quotas.items():
        over = st.team_used.get(team, 0) - quota
        if over > 0:
            members = _shed_order(r for r in st.runs.values() if r.team == team and st.target[r.run_id])
            _give_back(st, members, members, over, "quota", f"team {team!r} is over its quota of {quota}")


def admit(st: Targets, waiting: dict[str, str]) -> None:
    """Rule 2: queued runs, highest priority first, then first come; by preemption of lower priorities.
    Passes until one admits nobody: a run suspended for a higher one may fit in what that left free (a
    preemption only ever takes from a lower priority, so this ends)."""
    for _ in range(len(st.runs) + 1):
        waiting.clear()
        if not _admit_pass(st, waiting):
            return


def _admit_pass(st: Targets, waiting: dict[str, str]) -> bool:
    admitted = False
    queued = sorted((r for r in st.runs.values() if st.target[r.run_id] == 0),
                    key=lambda r: (-r.priority, r.queued_since, r.run_id))
    running = _shed_order(r for r in st.runs.values() if st.target[r.run_id] and r.preemptible)
    for r in queued:
        need = st.smallest(r)
        if not st.valid[r.run_id]:
            waiting[r.run_id] = f"no valid size in [{r.min_workers}, {r.max_workers}]"
            continue
        if st.quota_room(r) < need:
            waiting[r.run_id] = (f"team {r.team!r} quota: {max(0, int(st.quota_room(r)))} of "
                                 f"{st.cluster.quotas[r.team]} workers left, {need} needed")
            continue
        missing = need - st.free()
        if missing > 0:
            # What idle capacity lent above their minimum goes back to any run of the same or a higher
            # priority; a whole run is suspended only for a higher one.
            lenders = [v for v in running if v.priority <= r.priority and st.target[v.run_id] > st.smallest(v)]
            lower = [v for v in running if v.priority < r.priority and st.target[v.run_id]]
            reclaimable = (sum(st.target[v.run_id] - st.smallest(v) for v in lenders if v.priority == r.priority)
                           + sum(st.target[v.run_id] for v in lower))
            if reclaimable < missing:
                waiting[r.run_id] = (f"needs {need} workers together: {max(0, st.free())} free"
                                     + (f", {reclaimable} reclaimable from preemptible runs" if reclaimable else ""))
                continue
            left = _give_back(st, lenders, lower, missing, "preempted", f"preempted by run {r.name!r} (priority "
                              f"{r.priority})")
            assert left <= 0, (r.run_id, left)  # reclaimable covered it
        # A run suspended earlier in this decision and let back in smaller keeps the cause it was cut for.
        st.set(r, need, *st.causes.get(r.run_id, ("admitted", "its minimum fits" if missing <= 0
                                                   else "admitted by preemption")))
        admitted = True
    return admitted


def grow(st: Targets, waiting: dict[str, str], margin: float) -> None:
    """Rule 3: idle capacity to admitted runs below their maximum, worth its resize cost. A heap holds each
    run's next step; free capacity and quota room only shrink while this runs, so a step that no longer
    fits never fits again this round."""
    reserved: dict[int, int] = {}  # priority -> the minimum of the queued runs that wait for capacity there
    for w, why in waiting.items():
        if why.startswith("needs"):
            p = st.runs[w].priority
            reserved[p] = reserved.get(p, 0) + st.smallest(st.runs[w])

    def reserve(priority: int) -> int:
        return sum(m for p, m in reserved.items() if p >= priority)

    paid: set[str] = set()  # runs whose resize cost this round already counted

    def step(r: RunDemand):
        cur = st.target[r.run_id]
        n = st.larger(r, cur) if cur > 0 else None
        if n is None or n - cur > min(st.free() - reserve(r.priority), st.quota_room(r)):
            return None
        gain = r.rate(n) - r.rate(cur)
        if gain <= 0 or (r.run_id not in paid and not _worth(r, cur, n, margin)):
            return None
        return (-r.priority, -gain / (n - cur), r.queued_since, r.run_id), n

    heap = [c[0] for r in st.runs.values() if (c := step(r)) is not None]
    heapq.heapify(heap)
    while heap:
        key = heapq.heappop(heap)
        r = st.runs[key[3]]
        c = step(r)
        if c is None:
            continue
        if c[0] != key:  # its gain changed since it was queued: queue it again as it is now
            heapq.heappush(heap, c[0])
            continue
        paid.add(r.run_id)
        st.set(r, c[1], "idle", "idle capacity")
        if (c := step(r)) is not None:
            heapq.heappush(heap, c[0])


def _worth(r: RunDemand, cur: int, n: int, margin: float) -> bool:
    """Whether growing from ``cur`` to ``n`` saves more than ``margin`` resize costs of the run's remaining time."""
    if math.isinf(r.remaining):
        return True
    return r.seconds_left(cur) - r.seconds_left(n) > margin * r.resize_cost_s


def restore(st: Targets, waiting: dict[str, str]) -> None:
    """Rule 4: runs shrunk below their user's size for the cluster's lost capacity get it back once it is free
    again, highest priority first, then first come."""
    for r in sorted(st.runs.values(), key=lambda r: (-r.priority, r.queued_since)):
        want = r.requested - st.target[r.run_id]
        if (r.requeue or not 0 < r.target < r.requested or want > st.free() or r.allocated != r.target
                or not r.shrunk_for_capacity):
            continue
        st.set(r, r.requested, "restored", "the cluster has room again for the size the run asked for")


def default_policy(margin: float = MARGIN) -> RulePolicy:
    """Today's rules, in their order (the module's docstring)."""
    return RulePolicy("default", (hold_limits, admit, functools.partial(grow, margin=margin), restore))


def decide(runs: Iterable[RunDemand], cluster: ClusterView, now: float, *, margin: float = MARGIN) -> Plan:
    """Every run's target size and the decisions that reach it, by the default policy. ``now`` is the
    decision's time (the allocator's clock; a simulated one in the benchmark)."""
    return default_policy(margin).decide(runs, cluster, now)
