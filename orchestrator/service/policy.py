"""The allocator's policy: how many workers each run of a cluster should have, as one pure function.

    plan = decide(runs, ClusterView(capacity=64, quotas={"vision": 16}), now)
    plan.targets["llm-a"]          # the size run llm-a should have (0: queued, or suspended and requeued)
    plan.decisions                 # Admit / Resize / Suspend values, each with its reason, in order
    plan.waiting["llm-b"]          # why a queued run is not admitted yet

The inputs are values (:class:`RunDemand` per run, :class:`ClusterView`), the clock is an
argument, and nothing here touches Ray or the run store: the allocator actor gathers the
inputs, calls :func:`decide` and writes each run's target; the benchmark
(``bench/scheduler_trace.py``) replays a trace through the same function on a simulated clock.

The rules, in the order they apply:

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
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# A resize must save this many times its own cost to be worth making.
MARGIN = 2.0


@dataclass(frozen=True, kw_only=True)
class RunDemand:
    """One run as the allocator sees it."""

    run_id: str
    min_workers: int
    max_workers: int
    sizes: tuple[int, ...] = ()  # the valid sizes in [min, max] (the dims value's rule); () = every size
    priority: int = 0
    team: str = ""
    preemptible: bool = True
    allocated: int = 0  # workers it holds now; 0: queued (new, or suspended and requeued)
    queued_since: float = 0.0  # when it was submitted or requeued: first come first served within a priority
    throughput: Mapping[int, float] = field(default_factory=dict)  # samples/s by size, measured or planned
    remaining: float = math.inf  # samples still to train (inf: unknown, so any positive gain is worth a resize)
    resize_cost_s: float = 2.0  # the run's measured cost of one resize (seconds without progress)

    def valid(self) -> tuple[int, ...]:
        s = self.sizes or tuple(range(self.min_workers, self.max_workers + 1))
        return tuple(sorted(n for n in s if self.min_workers <= n <= self.max_workers))

    def rate(self, n: int) -> float:
        """Samples/s at ``n`` workers: measured, else interpolated (linear scaling between known sizes, and
        from the nearest one outside them); every size alike when nothing was measured."""
        if n <= 0:
            return 0.0
        if n in self.throughput:
            return self.throughput[n]
        known = sorted(self.throughput)
        if not known:
            return float(n)
        i = bisect.bisect_left(known, n)
        if i == 0:
            return self.throughput[known[0]] * n / known[0]
        if i == len(known):
            return self.throughput[known[-1]] * n / known[-1] if len(known) == 1 else self._extrapolate(known, n)
        a, b = known[i - 1], known[i]
        return self.throughput[a] + (self.throughput[b] - self.throughput[a]) * (n - a) / (b - a)

    def _extrapolate(self, known: list[int], n: int) -> float:
        """Above the largest measured size: the last measured gain per worker, never more than linear."""
        a, b = known[-2], known[-1]
        per_worker = max(0.0, (self.throughput[b] - self.throughput[a]) / (b - a))
        return min(self.throughput[b] + per_worker * (n - b), self.throughput[b] * n / b)

    def seconds_left(self, n: int) -> float:
        r = self.rate(n)
        return math.inf if r <= 0 else self.remaining / r


@dataclass(frozen=True)
class ClusterView:
    capacity: int  # workers the cluster holds now, draining nodes left out
    quotas: Mapping[str, int] = field(default_factory=dict)  # team -> most workers its runs may hold together


@dataclass(frozen=True)
class Admit:
    run_id: str
    workers: int
    reason: str


@dataclass(frozen=True)
class Resize:
    run_id: str
    workers: int
    action: str  # "grow" or "shrink"
    cause: str  # "idle" (growth), "preempted", "capacity", "quota"
    reason: str


@dataclass(frozen=True)
class Suspend:
    run_id: str
    cause: str  # "preempted", "capacity", "quota"
    reason: str


Decision = Admit | Resize | Suspend


@dataclass
class Plan:
    targets: dict[str, int]
    decisions: list[Decision]
    waiting: dict[str, str]


class _State:
    """The targets being decided, with the sums the rules read."""

    def __init__(self, runs: list[RunDemand], cluster: ClusterView):
        self.runs = {r.run_id: r for r in runs}
        self.cluster = cluster
        self.valid = {r.run_id: r.valid() for r in runs}
        self.target = {r.run_id: self._snap(r) for r in runs}
        self.used = sum(self.target.values())
        self.team_used: dict[str, int] = {}
        for r in runs:
            self.team_used[r.team] = self.team_used.get(r.team, 0) + self.target[r.run_id]
        self.causes: dict[str, tuple[str, str]] = {}  # run -> (cause, reason) of the last change

    def _snap(self, r: RunDemand) -> int:
        """A held size as a valid one: the largest valid size it covers; 0 for a queued run."""
        valid = self.valid[r.run_id]
        if r.allocated <= 0 or not valid:
            return 0
        i = bisect.bisect_right(valid, r.allocated)
        return valid[i - 1] if i else valid[0]

    def free(self) -> int:
        return self.cluster.capacity - self.used

    def quota_room(self, r: RunDemand) -> float:
        q = self.cluster.quotas.get(r.team)
        return math.inf if q is None else q - self.team_used.get(r.team, 0)

    def set(self, r: RunDemand, n: int, cause: str, reason: str) -> None:
        d = n - self.target[r.run_id]
        self.target[r.run_id] = n
        self.used += d
        self.team_used[r.team] = self.team_used.get(r.team, 0) + d
        self.causes[r.run_id] = (cause, reason)

    def smaller(self, r: RunDemand, n: int) -> int:
        """The next valid size below ``n`` (0 below the minimum: suspended)."""
        valid = self.valid[r.run_id]
        i = bisect.bisect_left(valid, n)
        return valid[i - 1] if i else 0

    def larger(self, r: RunDemand, n: int) -> int | None:
        """The next valid size above ``n``; None at the top."""
        valid = self.valid[r.run_id]
        i = bisect.bisect_right(valid, n)
        return valid[i] if i < len(valid) else None

    def smallest(self, r: RunDemand) -> int:
        """The smallest valid size (its minimum, snapped)."""
        return self.valid[r.run_id][0] if self.valid[r.run_id] else self.target[r.run_id]


def _give_back(st: _State, shrinkable: list[RunDemand], suspendable: list[RunDemand], need: float, cause: str,
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


def _hold_limits(st: _State) -> None:
    """Rule 1: the cluster's capacity and each team's quota."""
    if st.free() < 0:
        order = _shed_order(r for r in st.runs.values() if st.target[r.run_id])
        _give_back(st, order, order, -st.free(), "capacity", f"the cluster holds {st.cluster.capacity} workers")
    for team, quota in st.cluster.quotas.items():
        over = st.team_used.get(team, 0) - quota
        if over > 0:
            members = _shed_order(r for r in st.runs.values() if r.team == team and st.target[r.run_id])
            _give_back(st, members, members, over, "quota", f"team {team!r} is over its quota of {quota}")


def _admit(st: _State, waiting: dict[str, str]) -> None:
    """Rule 2: queued runs, highest priority first, then first come; by preemption of lower priorities.
    Passes until one admits nobody: a run suspended for a higher one may fit in what that left free (a
    preemption only ever takes from a lower priority, so this ends)."""
    for _ in range(len(st.runs) + 1):
        waiting.clear()
        if not _admit_pass(st, waiting):
            return


def _admit_pass(st: _State, waiting: dict[str, str]) -> bool:
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
            left = _give_back(st, lenders, lower, missing, "preempted", f"preempted by run {r.run_id!r} (priority "
                              f"{r.priority})")
            assert left <= 0, (r.run_id, left)  # reclaimable covered it
        # A run suspended earlier in this decision and let back in smaller keeps the cause it was cut for.
        st.set(r, need, *st.causes.get(r.run_id, ("admitted", "its minimum fits" if missing <= 0
                                                   else "admitted by preemption")))
        admitted = True
    return admitted


def _grow(st: _State, waiting: dict[str, str], margin: float) -> None:
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


def decide(runs: Iterable[RunDemand], cluster: ClusterView, now: float, *, margin: float = MARGIN) -> Plan:
    """Every run's target size and the decisions that reach it (see the module's rules). ``now`` is the
    decision's time (the allocator's clock; a simulated one in the benchmark)."""
    runs = list(runs)
    st = _State(runs, cluster)
    _hold_limits(st)
    waiting: dict[str, str] = {}
    _admit(st, waiting)
    _grow(st, waiting, margin)
    decisions: list[Decision] = []
    for r in runs:
        old, new = max(r.allocated, 0), st.target[r.run_id]
        if new == old:
            continue
        cause, reason = st.causes.get(r.run_id, ("valid", "the nearest valid size"))
        if old == 0:
            decisions.append(Admit(r.run_id, new, reason))
        elif new == 0:
            decisions.append(Suspend(r.run_id, cause, reason))
        else:
            decisions.append(Resize(r.run_id, new, "grow" if new > old else "shrink", cause, reason))
    return Plan(targets=st.target, decisions=decisions, waiting=waiting)
