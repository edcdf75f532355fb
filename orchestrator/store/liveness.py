"""A run whose controller is gone without ending it: noticed, and marked INTERRUPTED, by whoever sees it first.

    status = notice(store, "tiny", store.get_status("tiny"), by="etrain status")   # INTERRUPTED if it is
    mark(store, "tiny", "its controller died", by="etrain run", controller="ctl-1a2b")   # known dead

A run lives as long as its controller, which lives as long as the driver that started it (``etrain run``,
the entrypoint of a Ray job). A driver killed with SIGKILL, a head node lost or a controller that dies
leaves a status that says RUNNING (or another phase of a live run) and is never written again. Whoever
notices first writes phase INTERRUPTED over it, with an ``interrupted`` event (``noticed_by``):

* the driver, when its controller died or it killed it (Ctrl-C): :func:`mark` with the controller's id,
  which it knows to be gone; its leadership is released, so that a resume need not wait out the lease;
* any ``etrain`` command that reads the status (status, resume, suspend, ...) and finds it stale
  (written more than :data:`STALE_S` ago) while no controller holds the run's lease (:func:`notice`).

The write is a compare-and-swap on the status read, so a controller that took the run over meanwhile is
never overwritten. A command of a user who may read the store but not write it shows the run INTERRUPTED
without marking it (the write refused is logged at debug level, never raised). A run marked INTERRUPTED is
resumable from its last committed checkpoint.
"""

from __future__ import annotations

import json
import logging
import time

from ..phase import Phase
from .documents import Lease, StoreNotWritable, StoreUnavailable, load_doc, status_problem, writing

log = logging.getLogger("etrain")

# A live controller writes its status every second and renews its lease (TTL 15 s) every 5 s; a status older
# than the lease, with no lease held, has no controller behind it.
STALE_S = 15.0


def stale(status: dict | None, now: float | None = None) -> bool:
    """Whether ``status`` is a live run's whose controller has not written for :data:`STALE_S`."""
    phase = Phase.of(status)
    if phase.terminal or phase == Phase.PENDING:
        return False
    return (now if now is not None else time.time()) - float((status or {}).get("updated_unix") or 0) > STALE_S


def notice(store, run_id: str, status: dict | None, by: str) -> dict | None:
    """``status``, or the run marked INTERRUPTED when it is stale and no controller holds its lease (the
    mark written if the store takes it, else only shown)."""
    if not stale(status) or store.leader_alive(run_id):
        return status
    age = time.time() - float(status.get("updated_unix") or 0)
    reason = (f"interrupted: its controller {status.get('controller_id', '?')} is gone (no lease; the status was "
              f"last written {age:.0f} s ago, at step {status.get('step', '?')}); `etrain resume {run_id}` continues "
              f"it from its last checkpoint (step {status.get('latest_checkpoint')})")
    try:
        marked = mark(store, run_id, reason, by=by)
    except (StoreUnavailable, StoreNotWritable) as e:  # read-only, or the store went away: shown, not written
        log.debug("interrupted run %s not marked: %s", run_id, e)
        marked = None
    return marked or {**status, "phase": Phase.INTERRUPTED.value, "reason": reason}


def mark(store, run_id: str, reason: str, *, by: str, controller: str | None = None) -> dict | None:
    """Write phase INTERRUPTED over the run's status, as a compare-and-swap on the status read now; None
    when it is not a live run's any more, or another writer got there first. ``controller``: the id of a
    controller the caller knows to be gone (its driver): only its status is marked, and its lease freed."""
    raw, version = store.read_versioned(run_id, "status")
    if raw is None:
        return None
    status = load_doc(raw, f"the status of run {run_id!r}", status_problem)
    phase = Phase.of(status)
    if phase.terminal or phase == Phase.PENDING:
        return None
    if controller is not None and status.get("controller_id") != controller:
        return None
    new = {**status, "phase": Phase.INTERRUPTED.value, "reason": reason, "updated_unix": time.time()}
    with writing(store):  # a store this user may only read: StoreNotWritable, naming it
        if not store.write_if(run_id, "status", json.dumps(new, sort_keys=True), version):
            return None
        if controller is not None:
            store.release(Lease(run_id, controller, 0.0))  # a resume need not wait for the dead lease to lapse
        store.add_event(run_id, {"kind": "interrupted", "step": status.get("step"), "phase_before": phase.value,
                                 "latest_checkpoint": status.get("latest_checkpoint"),
                                 "controller_id": status.get("controller_id"), "noticed_by": by, "reason": reason})
    return new
