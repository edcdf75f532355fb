"""The cluster's nodes as etrain sees them, and the quarantine acted on the live cluster (Ray connected).

    store = cluster_store()                  # where the cluster's allocator keeps its state (and the quarantine)
    new = quarantine_on_cluster(node_id, reason="sdc", run_id="tiny", store_url=run_store_url, rank=1, step=120,
                                evidence={...})      # a run's controller, about a node its group formed on
    rows = node_rows(store)                  # `etrain nodes`: every node, alive / draining / quarantined
    node_id, entry = release_on_cluster("3f2a9c", token, store)     # `etrain nodes release`

A run's controller quarantines a node through :func:`quarantine_on_cluster`: the run must be live in its
store and its group must have formed on the node (one of its ``formed`` events names it), the entry
records the run (its cluster key, :func:`orchestrator.store.cluster_names.cluster_key`), and the bounds of
:mod:`orchestrator.service.quarantine` apply. The set is published to Ray's GCS at once, so the next
placement group of any run keeps off the node; the allocator publishes it again at every decision.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from checkpointing.errors import EtrainError
from checkpointing.names import redact

from ..phase import Phase
from ..store.cluster_names import cluster_key
from ..store.run_store import RunStore, open_store
from .quarantine import QuarantineRefused, publish, quarantine_node, quarantined_nodes, release_node

log = logging.getLogger("etrain")


def cluster_store(fallback_url: str | None = None) -> RunStore | None:
    """The store the connected cluster's allocator keeps its state and the quarantine in: the service store
    (``etrain service init``), else the state store of the running allocator, else ``fallback_url``'s (None
    when there is none of these)."""
    import ray

    from .allocator import find_allocator
    from .grants import service_url

    url = service_url()
    if url is None and (handle := find_allocator()) is not None:
        try:
            url = ray.get(handle.state.remote(), timeout=30).get("state_url")
        except Exception as e:  # the allocator restarting: its state store is asked again next time
            log.warning("the cluster's allocator did not say where its state is: %s", e)
    url = url or fallback_url
    return open_store(url) if url else None


def worker_nodes() -> list[dict]:
    """The alive nodes of the connected cluster that offer CPUs or GPUs (a head started with none is not one)."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive") and any(n.get("Resources", {}).get(k, 0) > 0
                                                             for k in ("CPU", "GPU"))]


def formed_on(store: RunStore, run_id: str, node_id: str) -> bool:
    """Whether one of the run's groups formed on ``node_id`` (its ``formed`` events name their nodes)."""
    return any(e.get("kind") == "formed" and node_id in (e.get("nodes") or []) for e in store.events(run_id))


def quarantine_on_cluster(node_id: str, *, reason: str, run_id: str, store_url: str, rank: int | None = None,
                          step: int | None = None, evidence: Mapping | None = None, store: RunStore | None = None,
                          nodes: int | None = None, now: float | None = None) -> bool:
    """Quarantine ``node_id``, as the run ``run_id`` of ``store_url`` found it bad; whether it is new.
    ``store``: where the quarantine is kept (default :func:`cluster_store`); ``nodes``: how many nodes the
    cluster has (default: its alive nodes with CPUs or GPUs). QuarantineRefused when the run is not live, its
    group never formed on the node, a bound is reached, or the cluster keeps no quarantine."""
    run_store = open_store(store_url)
    phase = Phase.of(run_store.get_status(run_id))
    if phase.terminal or phase is Phase.PENDING:
        raise QuarantineRefused(f"node {node_id[:12]} not quarantined: run {run_id!r} is {phase.value}; only a live "
                                "run quarantines a node")
    if not formed_on(run_store, run_id, node_id):
        raise QuarantineRefused(f"node {node_id[:12]} not quarantined: run {run_id!r} never formed a group on it "
                                "(a run quarantines only nodes it runs on)")
    address = None
    if store is None or nodes is None:
        alive = worker_nodes()
        nodes = len(alive) if nodes is None else nodes
        address = next((n.get("NodeManagerAddress") for n in alive if n.get("NodeID") == node_id), None)
        store = store or cluster_store()
    if store is None:
        raise QuarantineRefused(f"node {node_id[:12]} not quarantined: the cluster has neither a service store nor "
                                "an allocator to keep the quarantine in")
    new = quarantine_node(store, node_id, reason=reason, run=cluster_key(run_id, store_url), rank=rank, step=step,
                          evidence=evidence, address=address, nodes=nodes, now=now)
    try:
        publish(quarantined_nodes(store))
    except Exception as e:  # the allocator publishes it at its next decision
        log.warning("the quarantined nodes were not published to Ray's GCS (%s); the allocator does", e)
    log.warning("run %r: node %s quarantined in %s (%s)%s", run_id, node_id, redact(store.url), reason,
                "" if new else ", as it was already")
    return new


def release_on_cluster(node_id: str, token: str | None, store: RunStore) -> tuple[str, dict]:
    """Release ``node_id`` (its id or a unique prefix) in ``store`` (admin token) and publish the set left."""
    released = release_node(store, node_id, token)
    try:
        publish(quarantined_nodes(store))
    except Exception as e:
        log.warning("the release was not published to Ray's GCS (%s); the allocator does at its next decision", e)
    return released


def node_rows(store: RunStore | None) -> list[dict]:
    """Every node of the connected cluster that is alive or quarantined: ``node_id``, ``address``, ``state``
    (``alive``, ``draining``, ``quarantined``; ``dead`` for a quarantined node that is gone), ``cpus``,
    ``gpus``, and for a quarantined one its entry's ``reason``, ``run``, ``rank``, ``step``, ``since``,
    ``evidence``. A quarantine document that is not etrain's raises (CorruptQuarantine)."""
    import ray

    from .drains import ray_draining_nodes

    held = quarantined_nodes(store) if store is not None else {}
    try:
        draining = ray_draining_nodes()
    except Exception as e:  # the drain state unreadable: listed as alive
        log.warning("the draining nodes could not be read: %s", e)
        draining = {}
    rows = []
    for n in ray.nodes():
        node_id = n.get("NodeID", "")
        if not n.get("Alive") and node_id not in held:
            continue
        res = n.get("Resources", {})
        state = "dead" if not n.get("Alive") else "quarantined" if node_id in held else \
            "draining" if node_id in draining else "alive"
        rows.append({**held.get(node_id, {}), "node_id": node_id, "address": n.get("NodeManagerAddress") or "",
                     "state": state, "cpus": res.get("CPU", 0), "gpus": res.get("GPU", 0)})
    known = {r["node_id"] for r in rows}
    for node_id, entry in held.items():  # quarantined, and no longer a node Ray knows of
        if node_id not in known:
            rows.append({**entry, "node_id": node_id, "state": "dead", "cpus": 0, "gpus": 0,
                         "address": entry.get("address") or ""})
    return sorted(rows, key=lambda r: (r["state"] == "dead", r["address"], r["node_id"]))


def require_store(store: RunStore | None) -> RunStore:
    if store is None:
        raise EtrainError("the cluster has no service store and no allocator running, so no quarantine: name the "
                          "store with --store URL (or make one with `etrain service init`)")
    return store
