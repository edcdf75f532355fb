"""Ray's draining nodes, read and made: the cluster's side of a drain (what a run does about one is
``orchestrator.controller.drain``).

    ray_draining_nodes()                                  # {node id: deadline (unix s) or None}
    drain_node(node_id, deadline_s=60, message="spot")   # what `ray drain-node` does (tests, chaos)
"""

from __future__ import annotations

import time

REASONS = ("PREEMPTION", "IDLE_TERMINATION")  # Ray's DrainNodeReason, without its prefix


def ray_draining_nodes(timeout_s: float = 5.0) -> dict[str, float | None]:
    """The draining nodes of the connected Ray cluster and their deadlines (unix seconds, None: no deadline).

    One GCS call (``GetDrainingNodes``), the read Ray Train's preemption watcher and Serve's node cache
    make; cheap enough to poll every second."""
    import ray

    gcs = ray._private.worker.global_worker.gcs_client
    return {_hex(n): (ms / 1000.0 if ms else None) for n, ms in gcs.get_draining_nodes(timeout=timeout_s).items()}


def _hex(node_id) -> str:
    return node_id.hex() if isinstance(node_id, bytes | bytearray) else str(node_id)


def drain_node(node_id: str, *, deadline_s: float | None = None, reason: str = "PREEMPTION",
               message: str = "etrain drain") -> tuple[bool, str]:
    """Ask the GCS to drain ``node_id``, as ``ray drain-node --reason PREEMPTION --deadline-remaining-seconds N``
    (and a node's own SIGTERM handler) do; (accepted, why not). A PREEMPTION drain cannot be refused.
    Ray does not end the node itself: its raylet exits once the node is idle (or whoever drained it does)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    if reason not in REASONS:
        raise ValueError(f"drain reason {reason!r}: use one of {', '.join(REASONS)}")
    deadline_ms = int(time.time() * 1000 + deadline_s * 1000) if deadline_s else 0
    gcs = ray._private.worker.global_worker.gcs_client
    return gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(f"DRAIN_NODE_REASON_{reason}"), message,
                          deadline_ms)
