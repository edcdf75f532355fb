"""Names a run takes on a shared Ray cluster: its run id and its store together.

    key = cluster_key("tiny", "file:///home/ana/runs")     # "tiny.3f2a9c1d": the allocator's registry,
                                                          # the autoscaler's demand, the controller's actor
    cluster_key("tiny", "file:///home/bo/runs")           # another key: two tenants' "tiny" run side by side

A run id is unique in its store only; the cluster's allocator, the autoscaler's demand board and
the controller actor's name are shared by every store the cluster's runs use, so they are keyed
by both: the run id (readable) and a short digest of the store's URL (without credentials: what listings show).
"""

from __future__ import annotations

import hashlib

from checkpointing.names import redact


def cluster_key(run_id: str, store_url: str) -> str:
    """``run_id`` in ``store_url`` as one name on the cluster."""
    digest = hashlib.sha256(redact(store_url).rstrip("/").encode()).hexdigest()[:8]
    return f"{run_id}.{digest}"


def controller_name(run_id: str, store_url: str) -> str:
    """The controller actor's name on the cluster (namespace ``etrain``): the run id and its store (two stores'
    runs of one id are two runs)."""
    return f"etrain-controller-{cluster_key(run_id, store_url)}"
