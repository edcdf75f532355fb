"""The controller's timings and bounds (``ControllerOptions``), built by the driver from ``[elastic]``
and ``[recovery]`` or by hand in tests.

    opts = ControllerOptions(poll_s=0.05, hang_timeout_s=10.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .run_policy import FailurePolicy


@dataclass(kw_only=True)
class ControllerOptions:
    poll_s: float = 0.1  # how often RUNNING looks at calls, progress and the spec
    spec_every_s: float = 0.1  # how often the spec is re-read (a resize or suspend waits at most this)
    status_every_s: float = 1.0  # how often the status is written
    start_timeout_s: float = 600.0  # workers that cannot start within this are given back: QUEUED again
    admit_wait_s: float = 2.0  # how long a start waits for its gang before it is QUEUED (and says so)
    queue_timeout_s: float = 0.0  # a run not admitted within this fails (0: it waits for ever)
    replace_wait_s: float = 0.0  # how long to wait for workers that have no resources before forming smaller
    boot_timeout_s: float = 120.0  # how long a start or a grow waits for workers that are still booting
    standby: int = 0  # warm workers kept started beyond the group: a failure or a grow uses one at once
    hang_timeout_s: float = 0.0  # 0: derived, max(hang_min_s, hang_factor x median step time)
    hang_min_s: float = 30.0
    hang_factor: float = 20.0
    call_timeout_s: float = 180.0  # bound on form / restore / save calls
    # After a failure, how long survivors get to leave the collective they were in. Gloo frees a
    # rank blocked on a peer that errored out only when that peer's process exits, so a survivor
    # still blocked after this is replaced rather than waited for until the collective timeout.
    settle_s: float = 5.0
    grow_check_s: float = 5.0  # how often a smaller-than-requested group looks for capacity
    lease_ttl_s: float = 15.0
    store_wait_s: float = 300.0  # how long a write the run needs (epoch, final status) waits for the store
    failure: FailurePolicy = field(default_factory=FailurePolicy)
