"""Failure and scaling policies: small pure objects that turn what was observed into a decision.

    decision = failure_policy.decide(FailureStatus(...), now=time.monotonic())
    match decision:
        case Restart(delay_s=d): ...
        case Fail(reason=r): ...

Decisions are frozen values with a readable ``reason`` the controller logs
verbatim. The clock is an argument, so every rule is tested with plain pytest
and no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# --- decisions ------------------------------------------------------------------


@dataclass(frozen=True)
class Continue:
    reason: str = "nothing to do"


@dataclass(frozen=True)
class Restart:
    """Recover in place after ``delay_s`` (backoff)."""

    delay_s: float
    reason: str


@dataclass(frozen=True)
class Fail:
    reason: str


@dataclass(frozen=True)
class Resize:
    """Re-form the group with ``workers`` members at the next step boundary."""

    workers: int
    reason: str


@dataclass(frozen=True)
class Wait:
    """Not enough capacity for any valid size yet; ask again later."""

    reason: str


# --- failures -------------------------------------------------------------------


# Failure kinds a recovery cannot fix (it trains the same steps from the same state to the same values).
NOT_RETRIED = {"nonfinite": "a recovery would meet the same nan/inf values again",
               "health": "[health] stopped it: a recovery would meet the same data again"}


@dataclass(frozen=True)
class FailureRecord:
    kind: str  # "actor_died", "collective_failed", "hang", "error", "nonfinite", "health"
    step: int
    message: str
    time: float


@dataclass(frozen=True)
class FailureStatus:
    """What the controller knows when a failure is detected."""

    history: tuple[FailureRecord, ...]  # every failure of this run, oldest first, the new one last


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    """Recover from failures with backoff; give up after ``max_failures``, on a crash loop, or at once on
    a kind in :data:`NOT_RETRIED`.

    A crash loop is ``crash_loop_repeats`` failures in a row at the same step
    with the same message: restarting again would only repeat it.
    """

    max_failures: int = 20
    backoff_s: float = 0.0
    max_backoff_s: float = 30.0
    backoff_window_s: float = 60.0
    crash_loop_repeats: int = 3

    def __post_init__(self) -> None:
        if self.max_failures < 0:
            raise ValueError(f"FailurePolicy.max_failures={self.max_failures} must be >= 0")
        if self.crash_loop_repeats < 2:
            raise ValueError(f"FailurePolicy.crash_loop_repeats={self.crash_loop_repeats} must be >= 2")
        for name in ("backoff_s", "max_backoff_s", "backoff_window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"FailurePolicy.{name}={getattr(self, name)} must be >= 0 seconds")

    def decide(self, status: FailureStatus, now: float) -> Restart | Fail:
        history = status.history
        if not history:
            return Restart(0.0, "no failure recorded")
        last = history[-1]
        if last.kind in NOT_RETRIED:
            return Fail(f"{last.message}; not retried: {NOT_RETRIED[last.kind]}")
        if len(history) > self.max_failures:
            return Fail(f"{len(history)} failures exceed max_failures={self.max_failures}; last: {last.message}")
        tail = history[-self.crash_loop_repeats :]
        if len(tail) == self.crash_loop_repeats and all(
                f.step == last.step and f.message == last.message for f in tail):
            return Fail(f"crash loop: {self.crash_loop_repeats} failures in a row at step {last.step}: "
                        f"{last.message}")
        recent = [f for f in history if now - f.time <= self.backoff_window_s]
        delay = min(self.max_backoff_s, self.backoff_s * (2 ** (len(recent) - 1))) if self.backoff_s else 0.0
        return Restart(delay, f"{last.kind} at step {last.step} ({last.message}); "
                              f"failure {len(history)} of at most {self.max_failures}, restarting in {delay:.1f} s")


# --- scaling --------------------------------------------------------------------


@dataclass(frozen=True)
class ScalingStatus:
    current: int  # workers in the group now (0 when none)
    requested: int  # what the spec asks for
    available: int  # workers that could be in the group now (members + ready spares)
    valid_sizes: tuple[int, ...]  # sizes the batch math and tp x pp allow, ascending


@dataclass(frozen=True, kw_only=True)
class ScalingPolicy:
    """Pick the group size: as close to the request as capacity allows, within [min, max]."""

    min_workers: int
    max_workers: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers ({self.min_workers}) <= max_workers ({self.max_workers})")

    def allowed(self, valid_sizes) -> list[int]:
        return [n for n in valid_sizes if self.min_workers <= n <= self.max_workers]

    def target(self, status: ScalingStatus) -> int | None:
        """The size to run at, or None if no allowed size fits the capacity."""
        want = min(status.requested, status.available)
        fits = [n for n in self.allowed(status.valid_sizes) if n <= want]
        return fits[-1] if fits else None

    def decide(self, status: ScalingStatus, now: float) -> Continue | Resize | Wait:
        target = self.target(status)
        if target is None:
            allowed = self.allowed(status.valid_sizes)
            return Wait(f"{status.available} workers available, but the smallest allowed size is "
                        f"{allowed[0] if allowed else 'none'} (valid sizes: {list(status.valid_sizes)}, "
                        f"min {self.min_workers}, max {self.max_workers})")
        if target == status.current:
            return Continue(f"running at {target} workers")
        if target > status.current:
            return Resize(target, f"growing {status.current} -> {target} workers "
                                  f"(requested {status.requested}, {status.available} available)")
        return Resize(target, f"shrinking {status.current} -> {target} workers "
                              f"(requested {status.requested}, {status.available} available)")


@dataclass
class FailureLog:
    """The failure history the policy reads (kept by the controller)."""

    records: list[FailureRecord] = field(default_factory=list)

    def add(self, record: FailureRecord) -> FailureStatus:
        self.records.append(record)
        return FailureStatus(tuple(self.records))
