"""One run as the allocator sees it, built from what its run store holds: the spec (sizes, the
``[elastic]`` sharing keys, the allocator's own ``target``), the status (phase, step), the step
history (measured throughput at each size) and the ``resized`` events (the measured cost of a resize).

    d = demand_of(spec, status, history, events, sizes=(1, 2, 3))   # a policy.RunDemand, or None
    d = demand_of(...)                                               # None: the run needs no workers now

Pure: no Ray, no store. The allocator (``orchestrator.service.allocator``) reads the documents
and calls this; the tests call it on documents they write.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from ..phase import Phase
from ..store.documents import HistoryRow, RunSpec
from .policy import MAX_WORKERS, RunDemand

# Phases in which a run holds, or waits for, workers of the cluster.
ACTIVE = frozenset({"INITIALIZING", "QUEUED", "SCHEDULING", "RUNNING", "RECOVERING", "RESIZING", "SUSPENDING",
                    "FINISHING"})
DEFAULT_RESIZE_COST_S = 2.0


def desired(spec: RunSpec) -> int:
    """The size the run's controller works toward: the allocator's target, else what the user asked for."""
    return spec.target if spec.target > 0 else spec.workers


def size_reason(spec: RunSpec) -> str:
    """Who decided the size the controller works toward, and why: the allocator (its cause) or the run's user."""
    if spec.target > 0:
        return f"the cluster's allocator: {spec.target} workers ({spec.target_cause or 'its decision'})"
    return f"its user asked for {spec.workers} workers" + (" (pinned)" if spec.pinned else "")


def demand_of(spec: RunSpec, status: dict | None, history: Iterable[HistoryRow], events: Iterable[dict], *,
              sizes: Sequence[int] = (), global_batch: int = 0, total_steps: int = 0) -> RunDemand | None:
    """The run's demand, or None when it holds and wants nothing (ended, suspended by its user, stopping).

    ``allocated`` is what the allocator granted and the run works toward (its desired size), not its
    momentary world size, so a recovery in progress does not free its workers for others; a run in
    QUEUED that the allocator has not admitted, or one requeued, holds 0."""
    phase = (status or {}).get("phase", Phase.INITIALIZING.value)
    if phase not in ACTIVE or spec.stop or spec.suspended:
        return None
    share = spec.sharing
    queued = spec.requeue or (phase == "QUEUED" and spec.target <= 0)
    rows = [HistoryRow.of(r) for r in history]
    step = int((status or {}).get("step") or (rows[-1].step if rows else 0))
    # [elastic] grow_into_idle = false, or a size its user set with `etrain resize` (pinned): idle capacity
    # never takes the run above the size its user asked for.
    grow_to = spec.max_workers if share.grow_into_idle and not spec.pinned else max(spec.workers, spec.min_workers)
    remaining = float("inf")
    if global_batch > 0 and total_steps > 0:
        remaining = float(max(0, total_steps - step) * global_batch)
    return RunDemand(
        run_id=spec.run_id, min_workers=spec.min_workers, max_workers=grow_to, sizes=tuple(sizes),
        priority=share.priority, team=share.team, preemptible=share.preemptible,
        allocated=0 if queued else desired(spec),
        queued_since=_queued_since(spec, events),
        throughput=throughput(rows, global_batch), remaining=remaining,
        resize_cost_s=resize_cost(events), requested=spec.workers, target=spec.target, requeue=spec.requeue,
        shrunk_for_capacity=any(e.get("kind") == "allocated" and e.get("cause") == "capacity" for e in events),
    )


def _queued_since(spec: RunSpec, events: Iterable[dict]) -> float:
    """When the run last joined the queue: its newest ``queued`` or ``preempted`` (suspend) event, else
    its creation. First come first served within a priority."""
    since = spec.created_unix if math.isfinite(spec.created_unix) else 0.0
    for e in events:
        if e.get("kind") == "queued" or (e.get("kind") == "preempted" and e.get("action") == "suspend"):
            t = e.get("time", since)
            if isinstance(t, (int, float)) and math.isfinite(t):
                since = max(since, float(t))
    return since


def throughput(rows: Sequence[HistoryRow], global_batch: int) -> dict[int, float]:
    """Samples per second at each world size the run has trained at: the global batch over the median
    step time there (a fixed global batch: every size trains the same samples per step)."""
    by_size: dict[int, list[float]] = {}
    for r in rows:
        if isinstance(r.world_size, int) and 0 < r.world_size <= MAX_WORKERS and math.isfinite(r.step_s) \
                and r.step_s > 0:
            by_size.setdefault(r.world_size, []).append(r.step_s)
    batch = global_batch if global_batch > 0 else 1
    rates = {n: batch / statistics.median(ts) for n, ts in by_size.items() if len(ts) >= 3}
    return {n: r for n, r in rates.items() if math.isfinite(r)}


def resize_cost(events: Iterable[dict]) -> float:
    """The run's measured cost of one resize: the median ``resize_s`` of its ``resized`` events."""
    costs = [float(e["resize_s"]) for e in events
             if e.get("kind") == "resized" and isinstance(e.get("resize_s"), (int, float))
             and not isinstance(e["resize_s"], bool) and math.isfinite(e["resize_s"]) and e["resize_s"] >= 0]
    return statistics.median(costs) if costs else DEFAULT_RESIZE_COST_S
