"""The cluster's capacity in workers, as the allocator counts it: usable nodes only.

    total, free = ray_capacity(cpus_per_worker=1.0, gpus_per_worker=0.0)   # the live cluster, now
    usable_workers(ray.nodes(), "CPU", 1.0, left_out={"3f2a..."})       # the same count, without Ray

A node counts when it is alive and neither draining (Ray places nothing new there, and it goes; read from
Ray's GCS, :mod:`orchestrator.service.drains`) nor quarantined (nothing of any run is placed there until an
admin releases it; :mod:`orchestrator.service.quarantine`): runs are sized to what they can use.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

log = logging.getLogger("etrain")


def usable_workers(nodes: Iterable[Mapping], key: str, per: float, left_out: frozenset[str] = frozenset()) -> int:
    """Workers of ``per`` units of resource ``key`` that the alive nodes of ``nodes`` (``ray.nodes()`` rows)
    hold, the nodes of ``left_out`` not counted."""
    return sum(int(n.get("Resources", {}).get(key, 0) // per) for n in nodes
               if n.get("Alive") and n.get("NodeID") not in left_out)


def free_workers(available: float, available_left_out: Iterable[float], per: float) -> int:
    """Workers that fit in ``available`` units free on the cluster, less what is free on nodes left out."""
    return max(0, int((available - sum(available_left_out)) // per))


def ray_capacity(cpus_per_worker: float, gpus_per_worker: float, draining: frozenset[str] | None = None,
                 quarantined: frozenset[str] | None = None) -> tuple[int, int]:
    """(workers the live Ray cluster holds, workers that fit in what is free now): each alive node's CPUs
    (GPUs, when workers take GPUs) over what one worker takes, the draining nodes (``draining``, node ids;
    by default Ray's) and the quarantined ones (``quarantined``; by default the set the allocator published,
    :func:`orchestrator.service.quarantine.placement_exclusions`) left out, in both. The allocator counts as
    capacity what its runs were granted plus what is free, never more than the cluster holds: what others
    hold (standby spares, other jobs) is not the runs' to share."""
    import ray

    from .quarantine import placement_exclusions

    if draining is None:
        from .drains import ray_draining_nodes

        try:
            draining = frozenset(ray_draining_nodes())
        except Exception:  # the drain state unreadable this round: count every alive node
            draining = frozenset()
    quarantined = placement_exclusions() if quarantined is None else quarantined
    key, per = ("GPU", gpus_per_worker) if gpus_per_worker > 0 else ("CPU", max(cpus_per_worker, 1e-6))
    left_out = frozenset(draining) | frozenset(quarantined)
    total = usable_workers(ray.nodes(), key, per, left_out)
    available, there = ray.available_resources().get(key, 0), []
    if left_out:
        try:
            from ray._private.state import available_resources_per_node

            there = [r.get(key, 0) for n, r in available_resources_per_node().items() if n in left_out]
        except Exception as e:  # counted as free this round; the total bounds it all the same
            log.info("allocator: the free resources per node could not be read: %s", e)
    return total, min(free_workers(available, there, per), total)
