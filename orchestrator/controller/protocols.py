"""What the controller's parts see of it: a narrow interface each, never the class.

    def on_formed(self, ctl: RunView) -> None: ...        # an observer reads the run
    def step(self, c: StateContext) -> State: ...          # a state drives it
    def check(self, c: DrainContext): ...                   # the drain reaction asks of the membership

The states, the observers, the status, the autoscaler's observer and the drain
reaction are given the :class:`~orchestrator.controller.controller.Controller`
itself at run time; these protocols say which of its members each may use, so
that none of them imports the controller (the import graph stays a tree) and a
fake controller in a test knows what it must offer.
"""

from __future__ import annotations

from typing import Any, Protocol

from trainer.config import RunConfig

from ..config import RecoveryConfig
from ..store.run_store import RunSpec, RunStore
from ..workers.group import WorkerGroup
from .options import ControllerOptions
from .pending import PendingRecovery, PendingResize
from .run_policy import FailureLog, FailureRecord, ScalingPolicy


class Named(Protocol):
    """A controller state as the observers read it: its phase."""

    @property
    def name(self) -> Any: ...


class GoodputView(Protocol):
    def ratio(self) -> float: ...

    def step_time_ratio(self) -> float: ...


class HistoryView(Protocol):
    history: list


class RunView(Protocol):
    """What the observers, the status and the autoscaler's observer read of a run's controller; what they
    change is ``fenced`` (this controller may no longer write) and the event log (``event``)."""

    run_id: str
    spec: RunSpec
    cfg: RunConfig
    opts: ControllerOptions
    recovery: RecoveryConfig
    store: RunStore
    group: WorkerGroup
    members: list[str]
    spares: list[str]
    epoch: int
    lease: Any
    fenced: str | None
    committed_step: int | None
    state: Named
    status: HistoryView
    goodput: GoodputView

    def clock(self) -> float: ...

    def event(self, kind: str, **fields) -> None: ...

    def last_completed_step(self) -> int: ...

    def queue_wait(self) -> float: ...

    def snapshot(self) -> dict: ...

    def until_store(self, fn, what: str): ...


class DrainContext(Protocol):
    """What the drain reaction asks of the controller's membership."""

    group: WorkerGroup
    members: list[str]
    spares: list[str]
    scaling: ScalingPolicy
    valid_sizes: tuple[int, ...]

    def clock(self) -> float: ...

    def desired(self) -> int: ...

    def ensure_workers(self, target: int, standby: bool = True) -> None: ...

    def event(self, kind: str, **fields) -> None: ...

    def last_completed_step(self) -> int: ...


class Drains(Protocol):
    def check(self, ctl: DrainContext) -> Any: ...


class Faults(Protocol):
    """The run's answer to a silent fault that follows one rank (``orchestrator.controller.health.FaultWatch``)."""

    def respond(self, ctl: Any, rest: list, results: dict) -> Any: ...


class StateHooks(Protocol):
    """The observers as the states tell them."""

    def on_start(self, ctl: Any) -> None: ...

    def on_poll(self, ctl: Any) -> None: ...

    def on_failure(self, ctl: Any, failure: FailureRecord, detect_s: float) -> None: ...


class StateContext(DrainContext, Protocol):
    """What the states drive: the run's spec, membership, group calls, progress and durability, the
    recovery or resize under way. The controller is the one implementation; a state changes the run
    only through these members."""

    run_id: str
    spec: RunSpec
    cfg: RunConfig
    opts: ControllerOptions
    controller_id: str
    observers: StateHooks
    drains: Drains
    faults: Faults
    failures: FailureLog
    train_calls: dict[str, Any]
    form_phases: dict[str, float]
    restored_tier: str
    next_grow_check: float
    progress_at: float
    resize_requested_at: float | None
    suspend_cause: str | None
    saves_failed_in_a_row: int
    last_save_error: str
    pending_recovery: PendingRecovery | None
    pending_resize: PendingResize | None

    def sleep(self, seconds: float) -> None: ...

    # the queue and the lease
    def queued(self, reason: str, since: float) -> None: ...

    def admitted(self, since: float | None) -> Any: ...

    def take_lease(self) -> None: ...

    def refresh_spec_throttled(self) -> None: ...

    # membership
    def release_workers(self) -> None: ...

    def formable(self, ready: list[str], candidates: list[str], target: int, waited: float,
                 wait_booting: bool = True) -> int | None: ...

    def form(self, size: int, ready: list[str]) -> int: ...

    def memory_flush(self) -> bool: ...

    def settle_after_failure(self, suspects: tuple[str, ...]) -> list[str]: ...

    def count_standbys(self) -> None: ...

    def grow_check_in(self, seconds: float) -> None: ...

    def boot_wait(self, now: float) -> float: ...

    def boot_done(self) -> None: ...

    # training, progress and durability
    def launch_training(self) -> None: ...

    def poll_progress(self, timeout: float = 2.0) -> None: ...

    def reached(self, step: int) -> None: ...

    def hang_deadline(self) -> float: ...

    def stop_at_boundary(self) -> None: ...

    def save_now(self) -> bool: ...

    # a recovery or a resize under way
    def begin_recovery(self, record: PendingRecovery) -> None: ...

    def begin_resize(self, record: PendingResize, leaving: tuple[str, ...] = ()) -> None: ...
