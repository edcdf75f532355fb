"""A run's phases: the controller's states as the rest of etrain names them.

    from orchestrator.phase import Phase
    if Phase(status["phase"]).terminal: ...
    Phase.RUNNING == "RUNNING"          # a StrEnum: statuses stay plain JSON strings

The controller (``orchestrator.controller``) owns the state machine; every
other module (the run store, the CLI, the chaos tools, the metrics, the demo)
names a phase through this enum, never by a string of its own.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    PENDING = "PENDING"  # recorded in the store, no controller has written a status yet
    INITIALIZING = "INITIALIZING"
    SCHEDULING = "SCHEDULING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    SUSPENDING = "SUSPENDING"
    FINISHING = "FINISHING"
    SUSPENDED = "SUSPENDED"
    FINISHED = "FINISHED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        """The run's controller has ended (a suspended run can be resumed by a new one)."""
        return self in TERMINAL

    @classmethod
    def of(cls, status: dict | None) -> Phase:
        """The phase of a status document (PENDING when there is none)."""
        return cls((status or {}).get("phase") or cls.PENDING)


TERMINAL = frozenset({Phase.SUSPENDED, Phase.FINISHED, Phase.FAILED})
# Phases in the order a run goes through them (the metrics' one-hot gauge lists them so).
ORDER = tuple(Phase)
