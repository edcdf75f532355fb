"""Asking the autoscaler for the workers a run waits for, and withdrawing the request when met or when the run ends.

    board = DemandBoard()                           # the cluster's demand, kept in Ray's GCS key-value store
    board.set("run-a", [{"CPU": 1}] * 2)            # run-a waits for two workers
    board.set("run-a", [])                          # ... they are placed: withdrawn
    requested_bundles()                             # what the autoscaler was last asked for (every run's)

    ctl = Controller(..., observers=[AutoscaleObserver(board)])   # what the controller actor does

Ray's autoscaler already sees pending placement groups; ``request_resources``
adds a standing request that it meets at once, without its upscaling-speed
limit, and that survives the placement group's retries. It is one request
per cluster (each call replaces the last), so every run puts its own bundles
under its run id and store (its cluster key) in the GCS key-value store (namespace ``etrain-demand``)
and the request sent is the union of every run's: a run that withdraws (its
workers placed, or the run ended) leaves the others' standing.
:class:`AutoscaleObserver` does this for a controller: every ``every_s`` it
counts the run's workers that are started but hold no resources (pending
placement groups), and on the run's end it withdraws. A cluster without an
autoscaler ignores the request.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..store.cluster_names import cluster_key
from .observers import ControllerObserver
from .protocols import RunView

if TYPE_CHECKING:
    from .states import State

log = logging.getLogger("etrain")

NAMESPACE = "etrain-demand"


class DemandBoard:
    """Every run's wanted bundles in the GCS key-value store; each change re-sends the union to the autoscaler."""

    def set(self, run_id: str, bundles: list[dict]) -> list[dict]:
        """``run_id`` now waits for ``bundles`` ([]: withdraws); returns the cluster's request as sent."""
        from ray.experimental import internal_kv

        key = run_id.encode()
        if bundles:
            internal_kv._internal_kv_put(key, json.dumps(bundles).encode(), overwrite=True, namespace=NAMESPACE)
        else:
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)
        return self.send()

    def all(self) -> dict[str, list[dict]]:
        from ray.experimental import internal_kv

        out = {}
        for key in internal_kv._internal_kv_list(b"", namespace=NAMESPACE):
            raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
            try:
                bundles = json.loads(raw or b"[]")
                if isinstance(bundles, list) and all(isinstance(b, dict) for b in bundles):
                    out[key.decode()] = [{str(k): float(v) for k, v in b.items()} for b in bundles]
            except (ValueError, TypeError):  # not ours to trust: skipped
                log.warning("autoscale: demand of %r is not a list of bundles; ignored", key)
        return out

    def send(self) -> list[dict]:
        from ray.autoscaler.sdk import request_resources

        bundles = [b for run in sorted(self.all().items()) for b in run[1]]
        request_resources(bundles=bundles)  # [] clears the cluster's request
        return bundles


def requested_bundles() -> list[dict]:
    """What the autoscaler was last asked for through ``request_resources`` (both autoscaler versions)."""
    import ray
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
        out = []
        for c in state.cluster_resource_constraints:
            for r in c.resource_requests:
                out += [dict(r.request.resources_bundle)] * r.count
        return out
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


class AutoscaleObserver(ControllerObserver):
    """Asks the autoscaler for the run's workers that wait for resources; withdraws when placed or at the end.

    ``board``: a :class:`DemandBoard` (anything with ``set(run_id, bundles)``); ``bundle``: one worker's
    resources (the worker group's, ``{"CPU": 1}`` when it does not say)."""

    def __init__(self, board, *, every_s: float = 5.0):
        self.board = board
        self.every_s = every_s
        self.asked = 0  # workers asked for now
        self.next_check = 0.0

    def on_state(self, ctl: RunView) -> None:
        now = ctl.clock()
        if now < self.next_check:
            return
        self.next_check = now + self.every_s
        started = [w for w in ctl.members + ctl.spares if w in ctl.group.workers]
        waiting = len(started) - len(ctl.group.placed(started))
        if waiting != self.asked:
            self.ask(ctl, waiting)

    def on_end(self, ctl: RunView, state: State) -> None:
        if self.asked:
            self.ask(ctl, 0)

    def ask(self, ctl: RunView, n: int) -> None:
        bundle = dict(getattr(ctl.group, "resources", None) or {"CPU": 1})
        try:
            self.board.set(cluster_key(ctl.run_id, ctl.store.url), [bundle] * n)  # the run id and its store
        except Exception as e:  # the request is a hint: a failure to send it changes nothing in the run
            log.warning("autoscale: the request for %d worker(s) was not sent: %s", n, e)
            return
        if n:
            ctl.event("autoscale", action="request", workers=n, bundle=bundle)
        elif self.asked:
            ctl.event("autoscale", action="withdraw", workers=0)
        self.asked = n
