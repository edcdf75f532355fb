"""What the queue shows of a run: its share of the cluster, and the rows of ``etrain queue``.

    status.update(sharing(spec))          # the controller: priority, team, owner, min..max, target, requeue
    rows = queue_rows(statuses, now)      # etrain queue: the QUEUED and admitted runs, highest priority first

The controller writes :func:`sharing` into every status it publishes, so that
``etrain queue`` reads one document per run (through the same listing as
``etrain status``: the runs of the store and of the run registry) and the
allocator sees the same figures. A run is *admitted* once its gang (its
``min_workers`` reserved together) holds its workers: phases SCHEDULING to
FINISHING; a QUEUED run waits for its gang, or is held by the allocator
(``spec.requeue``). docs/service.md#the-queue.
"""

from __future__ import annotations

from ..phase import ORDER, Phase

# The phases `etrain queue` lists: QUEUED, then the admitted ones.
LISTED = ORDER[ORDER.index(Phase.QUEUED): ORDER.index(Phase.FINISHING) + 1]


def sharing(spec) -> dict:
    """The run's share of the cluster as its status shows it (its claims: ``spec.sharing``)."""
    share = spec.sharing
    return {"priority": share.priority, "team": share.team, "preemptible": share.preemptible, "owner": spec.owner,
            "min_workers": spec.min_workers, "max_workers": spec.max_workers, "target": spec.target,
            "requeue": spec.requeue}


def waits_for(status: dict) -> str | None:
    """Why a QUEUED run waits (None for an admitted one)."""
    if status.get("phase") != Phase.QUEUED:
        return None
    if status.get("requeue"):
        return "held by the cluster's allocator (requeued for a higher-priority run): resumes when it is re-admitted"
    why = status.get("queue_reason") or "starting"
    return (f"its gang: {status.get('min_workers', '?')} workers (min_workers) reserved together, which the "
            f"cluster cannot hold now ({why})")


def queue_rows(statuses: list[dict], now: float) -> list[dict]:
    """The rows of ``etrain queue`` from status rows (``registry.statuses``): the QUEUED and admitted runs,
    highest priority first, admitted before queued, then the longest waiting. ``waiting_s``: a QUEUED run's
    current wait, an admitted one's time spent queued before it was admitted."""
    rows = []
    for s in statuses:
        if s.get("phase") not in LISTED:
            continue
        queued = s.get("phase") == Phase.QUEUED and s.get("queued_unix")
        waiting = max(0.0, now - s["queued_unix"]) if queued else float(s.get("queue_wait_s") or 0.0)
        rows.append({"run_id": s.get("run_id"), "phase": s.get("phase"), "priority": s.get("priority", 0),
                     "team": s.get("team", "default"), "owner": s.get("owner", ""),
                     "min_workers": s.get("min_workers"), "max_workers": s.get("max_workers"),
                     "allocated": s.get("world_size", 0), "target": s.get("target", 0),
                     "waiting_s": round(waiting, 1), "waits_for": waits_for(s), "store": s.get("store")})
    return sorted(rows, key=lambda r: (-int(r["priority"] or 0), r["phase"] == Phase.QUEUED, -r["waiting_s"],
                                       str(r["run_id"])))
