"""The seam of the allocator's policy: what it is given, what it decides, and how a policy is made.

    policy = policy_named("default")              # or ETRAIN_SCHEDULING_POLICY's, or RulePolicy(name, rules)
    plan = policy.decide(runs, ClusterView(capacity=64, quotas={"vision": 16}), now)
    plan.targets["llm-a"]          # the size run llm-a should have (0: queued, or suspended and requeued)
    plan.decisions                 # Admit / SetTarget / Suspend / Restore values, each with its reason
    plan.waiting["llm-b"]          # why a queued run is not admitted yet

The inputs are values (:class:`RunDemand` per run, :class:`ClusterView`), the clock is an
argument, and nothing here touches Ray or the run store: the allocator actor gathers the
inputs, asks its policy and writes each run's target; the benchmark
(``bench/scheduler_trace.py``) replays a trace through the same policy on a simulated clock.

A policy is any object with ``decide(runs, cluster, now) -> Plan`` (:class:`SchedulingPolicy`);
:class:`RulePolicy` makes one of ordered rules, each a function that changes the
:class:`Targets`. Today's rules, and the default policy made of them, are
:mod:`orchestrator.service.rules`. A deployment names its policy with
``ETRAIN_SCHEDULING_POLICY`` in the cluster's environment (docs/service.md): a name of
:data:`POLICIES` or ``"package.module:function"``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


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
    # What the run's spec says beside: the size its user asked for (``workers``), the allocator's standing
    # target (0: none), and whether an ``allocated`` event ever shrank it for the cluster's lost capacity.
    requested: int = 0
    target: int = 0
    requeue: bool = False
    shrunk_for_capacity: bool = False
    # The run's own id when ``run_id`` is the allocator's cluster key (a run id and its store): reasons show it.
    shown: str = ""

    @property
    def name(self) -> str:
        return self.shown or self.run_id

    def __post_init__(self):
        problem = demand_problem(self)
        if problem:
            raise ValueError(f"run {self.run_id!r}: {problem}")

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


MAX_WORKERS = 1_000_000  # the most workers one run may name (elastic.max_workers' bound)


def _finite(x: object, low: float = 0.0) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= low


def _count(x: object, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= MAX_WORKERS


def demand_problem(d: RunDemand) -> str | None:
    """What makes ``d`` no demand a policy can decide on (a count out of bounds, a rate or time that is not a
    finite number >= 0), or None. A NaN rate never compares equal: the growth rule would never end."""
    for name in ("min_workers", "max_workers", "allocated", "requested", "target"):
        if not _count(getattr(d, name)):
            return f"{name}={getattr(d, name)!r} is not an integer in [0, {MAX_WORKERS}]"
    if not all(_count(n, 1) for n in d.sizes):
        return f"sizes hold {next(n for n in d.sizes if not _count(n, 1))!r}, not a size in [1, {MAX_WORKERS}]"
    if not isinstance(d.priority, int) or isinstance(d.priority, bool) or abs(d.priority) > MAX_WORKERS:
        return f"priority={d.priority!r} is not an integer in [-{MAX_WORKERS}, {MAX_WORKERS}]"
    if not all(_count(n, 1) and _finite(v) for n, v in d.throughput.items()):
        return "its throughput holds a size or rate that is not finite and >= 0"
    if not (_finite(d.remaining) or d.remaining == math.inf):
        return f"remaining={d.remaining!r} is not a number >= 0 (or inf: unknown)"
    if not _finite(d.resize_cost_s) or not _finite(d.queued_since, -math.inf):
        return "its resize cost or queue time is not a finite number"
    return None


@dataclass(frozen=True)
class ClusterView:
    capacity: int  # workers the cluster holds now, draining and quarantined nodes left out
    quotas: Mapping[str, int] = field(default_factory=dict)  # team -> most workers its runs may hold together
    quarantined: Mapping[str, str] = field(default_factory=dict)  # node id -> why (orchestrator.service.quarantine)


@dataclass(frozen=True)
class Admit:
    run_id: str
    workers: int
    reason: str


@dataclass(frozen=True)
class SetTarget:
    """A run admitted before is given another size."""

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


@dataclass(frozen=True)
class Restore:
    """The allocator's target is withdrawn: the run goes back to the size its user asked for (``workers``)."""

    run_id: str
    workers: int
    reason: str


Decision = Admit | SetTarget | Suspend | Restore


@dataclass
class Plan:
    targets: dict[str, int]
    decisions: list[Decision]
    waiting: dict[str, str]


class Targets:
    """The targets a policy is deciding (every run's size, 0: queued or suspended), with the sums its rules
    read and why each run's target last changed (``causes``: run -> (cause, reason)). Rules change a target
    only through :meth:`set`; a cause of ``"restored"`` makes the run's decision a :class:`Restore`."""

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




# One rule of a policy: it changes the targets (Targets.set) and says why queued runs still wait (waiting).
Rule = Callable[[Targets, dict[str, str]], None]


class SchedulingPolicy(Protocol):
    """What the allocator asks: the cluster's state in (every run's demand, the capacity and quotas, the
    clock), the targets and the decisions that reach them out, each with its reason."""

    name: str

    def decide(self, runs: Iterable[RunDemand], cluster: ClusterView, now: float) -> Plan: ...


@dataclass(frozen=True)
class RulePolicy:
    """A policy made of ordered rules: each runs once, in order, on the targets the ones before it left."""

    name: str
    rules: tuple[Rule, ...]

    def decide(self, runs: Iterable[RunDemand], cluster: ClusterView, now: float) -> Plan:
        runs = list(runs)
        for r in runs:  # a value made without __post_init__ (or changed since) is refused all the same
            problem = demand_problem(r)
            if problem:
                raise ValueError(f"run {r.run_id!r}: {problem}")
        if len({r.run_id for r in runs}) != len(runs):
            raise ValueError("two demands share a run id: key runs by store and run id (cluster_key)")
        st = Targets(runs, cluster)
        waiting: dict[str, str] = {}
        for rule in self.rules:
            rule(st, waiting)
        return Plan(targets=st.target, decisions=[d for r in runs if (d := decision(st, r)) is not None],
                    waiting=waiting)


def decision(st: Targets, r: RunDemand) -> Decision | None:
    """What changed for ``r``: none, an admission, a suspension, a new size or a restored one."""
    old, new = max(r.allocated, 0), st.target[r.run_id]
    if new == old:
        return None
    cause, reason = st.causes.get(r.run_id, ("valid", "the nearest valid size"))
    if cause == "restored":
        return Restore(r.run_id, new, reason)
    if old == 0:
        return Admit(r.run_id, new, reason)
    if new == 0:
        return Suspend(r.run_id, cause, reason)
    return SetTarget(r.run_id, new, "grow" if new > old else "shrink", cause, reason)


# Policies a deployment may name (ETRAIN_SCHEDULING_POLICY): name -> "package.module:function" returning one.
POLICIES: dict[str, str] = {"default": "orchestrator.service.rules:default_policy"}


def register_policy(name: str, factory: str) -> None:
    """Name a policy factory (``"package.module:function"``, called with no argument) for deployments."""
    POLICIES[name] = factory


def policy_named(name: str) -> SchedulingPolicy:
    """The policy a deployment names: a registered name, or ``"package.module:function"`` returning one;
    ConfigError naming ETRAIN_SCHEDULING_POLICY otherwise."""
    from checkpointing.errors import ConfigError
    from trainer.models.refs import resolve_ref

    ref = POLICIES.get(name, name)
    if ":" not in ref:
        raise ConfigError(f"ETRAIN_SCHEDULING_POLICY={name!r} is no scheduling policy: use one of "
                          f"{', '.join(sorted(POLICIES))}, or \"package.module:function\" returning one")
    policy = resolve_ref(ref, "ETRAIN_SCHEDULING_POLICY")()
    if not callable(getattr(policy, "decide", None)):
        raise ConfigError(f"ETRAIN_SCHEDULING_POLICY={name!r}: {ref} returned {type(policy).__name__}, which has "
                          "no decide(runs, cluster, now) method")
    return policy
