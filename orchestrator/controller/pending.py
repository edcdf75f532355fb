"""What the controller remembers of a recovery or a resize between its start and the first step after it.

    c.pending_recovery = PendingRecovery(detected_at=t0, last_step=12, world_before=3, failure_kind="actor_died",
                                         failure_time_unix=..., settled_at=t1, phases={"settle_s": 0.2})
    c.pending_recovery.formed(step=12, world=2, tier="memory", tier_reason="", phases=c.form_phases, waited_s=0.4)
    c.event("recovered", **c.pending_recovery.event(now=c.clock(), first_step_unix=p["time"]))

A recovery starts in ``Recovering`` (the failure detected, the survivors settled), is
completed by the group that forms (``Controller.form``: which step it restored, from
which tier, at what size) and reported when that group's first step completes
(``Controller._finish_pending``): the ``recovered`` event. A resize is made in
``Resizing`` and reported the same way (``resized``). No step is lost by a resize.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


def rounded(phases: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in phases.items()}


@dataclass
class PendingRecovery:
    detected_at: float  # controller clock
    last_step: int  # the newest step trained before the failure: what a restore to an older one loses
    world_before: int
    failure_kind: str
    failure_time_unix: float
    settled_at: float  # controller clock: the survivors settled, replacements asked for
    phases: dict[str, float] = field(default_factory=dict)
    restored_step: int | None = None  # set by the group that formed
    world_after: int | None = None
    tier: str | None = None
    tier_reason: str | None = None

    @property
    def formed_yet(self) -> bool:
        return self.restored_step is not None

    def formed(self, *, step: int, world: int, tier: str, tier_reason: str, phases: dict[str, float],
               waited_s: float) -> None:
        """The group that completes this recovery formed, restoring ``step`` from ``tier``."""
        self.restored_step, self.world_after, self.tier, self.tier_reason = step, world, tier, tier_reason
        self.phases.update(wait_replacement_s=waited_s, **phases)

    def steps_lost(self) -> int:
        return max(0, self.last_step - (self.restored_step or 0))

    def event(self, *, now: float, first_step_unix: float | None) -> dict:
        """The ``recovered`` event's fields, at the first step after the recovery (``now``: controller clock)."""
        seconds = now - self.detected_at
        return {"time_to_recover_s": round(seconds, 3), "steps_lost": self.steps_lost(),
                "restored_step": self.restored_step, "tier": self.tier, "tier_reason": self.tier_reason,
                "world_before": self.world_before, "world_after": self.world_after,
                "failure_kind": self.failure_kind, "detected_unix": time.time() - seconds,
                "failure_unix": self.failure_time_unix, "first_step_unix": first_step_unix,
                "phases": rounded(self.phases)}


@dataclass
class PendingResize:
    requested_at: float  # controller clock
    from_workers: int
    to_workers: int
    reason: str
    tier: str | None
    phases: dict[str, float] = field(default_factory=dict)

    def event(self, *, now: float, step: int | None, first_step_unix: float | None) -> dict:
        """The ``resized`` event's fields, at the first step at the new size."""
        return {"from_workers": self.from_workers, "to_workers": self.to_workers,
                "resize_s": round(now - self.requested_at, 3), "reason": self.reason, "step": step, "tier": self.tier,
                "first_step_unix": first_step_unix, "phases": rounded(self.phases)}
