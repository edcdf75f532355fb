"""A silent fault that follows one rank (``[health]``, :mod:`trainer.health`): the run's ladder above it.

    watch = FaultWatch(quarantine=partial(quarantine_on_cluster, store_url=url))   # the controller actor's
    decision = decide(on_persistent, fault, members=..., ready_others=..., scaling=..., valid_sizes=...)
    state = watch.respond(ctl, fault)                         # RUNNING: a Resizing or a Suspending

Inside the trainer every rank finds, rolls back and replays a silent fault by itself (transient faults
and the data's end there, as events). A fault that comes back on one rank after a rollback ends each
rank's ``train`` call with a ``faulty`` result (``TrainResult.evidence``: the rank, its host, the step,
the verified step), every rank back at its verified step and the group intact. What the run does
(:func:`decide`, pure):

* ``health.on_persistent = "evict"`` (the default): the rank leaves through the resize path at this step
  boundary (:class:`Evict`: a standby takes its place, or the group shrinks to the largest valid size
  without it; from memory or a boundary checkpoint, no step lost), and its node is quarantined in the
  cluster's allocator (:mod:`orchestrator.service.quarantine`: nothing of any run is placed there until
  an admin releases it: ``etrain nodes release NODE``). A refused quarantine (its bounds) is told in the
  ``quarantine`` event and the eviction goes on.
* ``"stop"``, or no valid size without the rank: suspend at the verified step (:class:`StopRun`); the
  suspend commits that step's checkpoint, which the rank's fault never touched.

Not a failure: ``max_failures`` does not count it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .run_policy import ScalingPolicy, ScalingStatus

log = logging.getLogger("etrain")


@dataclass(frozen=True)
class Evict:
    """Re-form at ``size`` without ``leaving`` (the faulty rank's worker) and quarantine its node."""

    size: int
    leaving: tuple[str, ...]
    rank: int
    reason: str


@dataclass(frozen=True)
class StopRun:
    """Suspend the run at its verified step."""

    reason: str


def decide(on_persistent: str, fault: dict, *, members: Sequence[str], ready_others: int, scaling: ScalingPolicy,
           valid_sizes: tuple[int, ...]) -> Evict | StopRun:
    """What the run does about a persistent fault (``fault``: a ``faulty`` result's evidence).
    ``ready_others``: workers ready to form without the faulty rank (the other members and ready spares)."""
    rank, host, step = fault.get("rank"), fault.get("host") or "?", fault.get("step")
    what = f"a silent fault on rank {rank} ({host}) came back at step {step} after a rollback"
    if on_persistent == "stop":
        return StopRun(f"{what}: suspended at verified step {fault.get('verified_step')} (health.on_persistent="
                       '"stop"); resume once the host is checked or without it')
    if not isinstance(rank, int) or not 0 <= rank < len(members):
        return StopRun(f"{what}, but the rank is not one of the group's: suspended at the verified step")
    size = scaling.target(ScalingStatus(current=len(members), requested=len(members), available=ready_others,
                                        valid_sizes=valid_sizes))
    if size is None:
        return StopRun(f"{what}; no valid size without it ({ready_others} other workers ready, valid sizes "
                       f"{list(valid_sizes)}): suspended at verified step {fault.get('verified_step')}")
    return Evict(size, (members[rank],), rank, f"{what}: rank {rank} evicted, its node quarantined; "
                                               f"{len(members)} -> {size} workers")


# quarantine(node_id, reason=, run_id=, rank=, step=, evidence=) -> bool (new); may raise (a refusal)
Quarantine = Callable[..., bool]


class FaultWatch:
    """The controller's side: the decision, the quarantine and the event, then the state to go to."""

    def __init__(self, quarantine: Quarantine | None = None):
        self.quarantine = quarantine

    def respond(self, c, rest: list, results: dict):
        """The state after a ``faulty`` train result (``results``, by worker; ``rest``: the calls not yet
        returned, waited for): every member is back at the fault's verified step, none trains."""
        from .states import Resizing, Suspending

        if rest:
            c.group.wait(rest, timeout=max(60.0, c.opts.poll_s))
        r = next(r for r in results.values() if r.status == "faulty")
        fault = {**(r.evidence or {}), "message": r.error}
        c.train_calls = {}
        c.reached(int(fault.get("verified_step") or 0))  # the rollback took the group back to it
        rank = fault.get("rank")
        bad = c.members[rank] if isinstance(rank, int) and 0 <= rank < len(c.members) else None
        ready = [w for w in c.group.ready(c.members + c.spares, timeout=0) if w != bad]
        decision = decide(c.cfg.health.on_persistent, fault, members=c.members, ready_others=len(ready),
                          scaling=c.scaling, valid_sizes=c.valid_sizes)
        log.warning("health: %s", decision.reason)
        if isinstance(decision, StopRun):
            c.event("health", action="stop", rank=fault.get("rank"), node=fault.get("host"),
                    step=fault.get("verified_step"), reason=decision.reason)
            return Suspending(decision.reason, cause="health")
        node = c.group.info(decision.leaving[0]).get("node_id", "")
        refused = None
        if self.quarantine is not None and node:
            try:
                self.quarantine(node, reason=f"silent data corruption on rank {decision.rank}", run_id=c.run_id,
                                rank=decision.rank, step=fault.get("step"),
                                evidence={k: fault.get(k) for k in ("host", "verified_step")})
            except Exception as e:  # noqa: BLE001 - a refused or failed quarantine is told; the eviction goes on
                refused = f"{type(e).__name__}: {e}"[:300]
        c.event("quarantine", node=node, host=fault.get("host"), rank=decision.rank, step=fault.get("step"),
                reason="silent data corruption", **({"refused": refused} if refused else {}))
        c.event("health", action="evict", rank=decision.rank, node=node, step=fault.get("verified_step"),
                reason=decision.reason)
        return Resizing(decision.size, decision.reason, c.clock(), leaving=decision.leaving)
