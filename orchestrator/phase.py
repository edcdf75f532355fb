"""A run's phases: the controller's states as the rest of etrain names them.

    from orchestrator.phase import Phase
    if Phase(status["phase"]).terminal: ...
    Phase.RUNNING == "RUNNING"          # a StrEnum: statuses stay plain JSON strings

The controller (``orchestrator.controller.controller``) owns the state machine; every
other module (the run store, the CLI, the chaos tools, the metrics, the demo)
names a phase through this enum, never by a string of its own.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    PENDING = "PENDING"  # recorded in the store, no controller has written a status yet
    INITIALIZING = "INITIALIZING"
    # Waiting for its gang (min_workers reserved together) to be admitted by the cluster, or held there by
    # the allocator (spec.requeue): no worker held, nothing trained (docs/service.md#the-queue).
    QUEUED = "QUEUED"
    SCHEDULING = "SCHEDULING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    SUSPENDING = "SUSPENDING"
    FINISHING = "FINISHING"
    SUSPENDED = "SUSPENDED"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    # The run's controller vanished without ending it (its driver was killed, its node lost): marked so by
    # whoever noticed first (the driver, or an `etrain` command that found the controller's lease expired
    # and its status stale). Resumable from its last committed checkpoint.
    INTERRUPTED = "INTERRUPTED"

    @property
    def terminal(self) -> bool:
        """The run's controller has ended (a suspended or interrupted run can be resumed by a new one)."""
        return self in TERMINAL

    @classmethod
    def of(cls, status: dict | None) -> Phase:
        """The phase of a status document (PENDING when there is none)."""
        return cls((status or {}).get("phase") or cls.PENDING)


TERMINAL = frozenset({Phase.SUSPENDED, Phase.FINISHED, Phase.FAILED, Phase.INTERRUPTED})
# Phases in the order a run goes through them (the metrics' one-hot gauge lists them so). INTERRUPTED is
# left out: no controller is ever in it (it is written over the status of one that is gone).
ORDER = tuple(p for p in Phase if p is not Phase.INTERRUPTED)
