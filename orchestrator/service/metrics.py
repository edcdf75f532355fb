"""The allocator's Prometheus metrics: the cluster row of the dashboard (docs/metrics.md#the-cluster).

    metrics = ClusterMetrics()
    metrics.observe(demands, plan, phases, applied, seconds, capacity, now)   # after every decision
    endpoint = MetricsEndpoint(metrics, addr=..., port=0)                     # trainer.observe.endpoint

Served by the allocator actor and registered for Prometheus file_sd discovery like a run's endpoint
(target label ``etrain_run="allocator"``, file ``allocator-<pid>.json``). A detached allocator is not closed
when its Ray is stopped, so its file outlives it: the next endpoint on that machine, a run's or a new
allocator's, removes it (:func:`trainer.observe.endpoint.sweep_stale_targets`).
"""

from __future__ import annotations

import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from .policy import Plan, RunDemand


class ClusterMetrics:
    """What the allocator saw and did at its last decision, and counters since it started."""

    run_id = "allocator"  # the endpoint's file_sd target name

    def __init__(self):
        self._lock = threading.Lock()
        self.capacity = 0
        self.phases: dict[str, int] = {}
        self.waiting = 0
        self.runs: dict[str, dict] = {}
        self.preemptions: dict[tuple[str, str], int] = {}
        self.decisions: dict[str, int] = {}
        self.decision_sum = 0.0
        self.decision_count = 0
        self.decision_last = 0.0
        self.skipped: dict[str, int] = {}
        self.quarantined = 0

    def quarantine(self, nodes: int) -> None:
        """How many nodes are quarantined (orchestrator.service.quarantine), at the last decision."""
        with self._lock:
            self.quarantined = nodes

    def skip(self, kind: str) -> None:
        """A run left out of a decision: its documents ``unreadable``, ``invalid`` or ``slow`` to read."""
        with self._lock:
            self.skipped[kind] = self.skipped.get(kind, 0) + 1

    def observe(self, demands: list[RunDemand], plan: Plan, phases: dict[str, str], applied: list[dict],
                seconds: float, capacity: int, now: float) -> None:
        with self._lock:
            self.capacity = capacity
            self.phases = {}
            for phase in phases.values():
                self.phases[phase] = self.phases.get(phase, 0) + 1
            self.waiting = len(plan.waiting)
            self.runs = {d.run_id: {"name": d.name, "allocated": plan.targets.get(d.run_id, 0),
                                    "requested": d.max_workers, "minimum": d.min_workers, "priority": d.priority,
                                    "team": d.team,
                                    "queue_wait": max(0.0, now - d.queued_since) if d.run_id in plan.waiting
                                    else 0.0} for d in demands}
            for a in applied:
                self.decisions[a["action"]] = self.decisions.get(a["action"], 0) + 1
                if a["action"] in ("shrink", "suspend") and a["cause"] in ("preempted", "capacity", "quota"):
                    key = (a["action"], a["cause"])
                    self.preemptions[key] = self.preemptions.get(key, 0) + 1
            self.decision_sum += seconds
            self.decision_count += 1
            self.decision_last = seconds

    def collect(self):
        with self._lock:
            yield from self._collect()

    def _collect(self):
        yield _gauge("etrain_cluster_capacity_workers", "workers the cluster holds for the runs at the last "
                     "decision", [([], self.capacity)])
        yield _gauge("etrain_cluster_runs", "registered runs by phase", [([p], n) for p, n in self.phases.items()],
                     ["phase"])
        yield _gauge("etrain_cluster_queue_length", "runs waiting for their minimum", [([], self.waiting)])
        yield _gauge("etrain_quarantined_nodes", "nodes kept out of the cluster until an admin releases them "
                     "(etrain nodes)", [([], self.quarantined)])
        for name, key, doc in (("etrain_cluster_allocated_workers", "allocated", "workers the allocator gives the run"),
                               ("etrain_cluster_requested_workers", "requested", "the most workers the run may use "
                                "(max_workers)"),
                               ("etrain_cluster_queue_wait_seconds", "queue_wait", "how long the run has waited in "
                                "the queue (0 once admitted)")):
            yield _gauge(name, doc, [([r["name"], r["team"], str(r["priority"]), rid], r[key])
                                     for rid, r in self.runs.items()], ["run_id", "team", "priority", "run_key"])
        c = CounterMetricFamily("etrain_cluster_preemptions", "workers taken from runs: shrinks and suspends, by "
                                "cause (preempted: for another run; capacity; quota)", labels=["action", "cause"])
        for (action, cause), n in self.preemptions.items():
            c.add_metric([action, cause], n)
        yield c
        c = CounterMetricFamily("etrain_cluster_decisions", "the allocator's decisions written, by action",
                                labels=["action"])
        for action, n in self.decisions.items():
            c.add_metric([action], n)
        yield c
        c = CounterMetricFamily("etrain_allocator_skipped_runs", "runs left out of a decision, by why: their "
                                "documents unreadable, invalid, or slow to read", labels=["reason"])
        for kind, n in self.skipped.items():
            c.add_metric([kind], n)
        yield c
        yield SummaryMetricFamily("etrain_allocator_decision_seconds", "time of one allocator decision: gather, "
                                  "decide, write", count_value=self.decision_count, sum_value=self.decision_sum)
        yield _gauge("etrain_allocator_last_decision_seconds", "time of the last decision", [([], self.decision_last)])


def _gauge(name: str, doc: str, values: list[tuple[list[str], float]], labels: list[str] | None = None):
    g = GaugeMetricFamily(name, doc, labels=labels or [])
    for label_values, value in values:
        g.add_metric(label_values, value)
    return g
