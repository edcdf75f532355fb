"""The controller's state machine, stepped one iteration at a time against a fake worker group.

No Ray and no sleeping: ``tests.fake_group.FakeGroup`` trains one step per
``wait`` and moves the fake clock by the timeout of any wait that times out;
faults are injected by (rank, step). The run store is the real embedded
``StorageRunStore`` on a temporary directory, so the status and events the
CLI would read are asserted too. One test (marked ``ray``, ``make test-ray``)
drives the same controller over a real ``RayWorkerGroup``.
"""

from __future__ import annotations

import uuid

import pytest

from checkpointing.errors import FencedError
from orchestrator.controller.controller import Controller, ControllerOptions
from orchestrator.controller.run_policy import FailurePolicy
from orchestrator.store.run_store import RunSpec, StoreUnavailable, open_store
from tests.fake_group import FakeClock, FakeGroup, FakeStorage, Fault

RUN = "r"
STEPS = 20
INTERVAL = 5


def run_config(tmp_path, steps=STEPS, interval=INTERVAL) -> dict:
    return {"run_id": RUN, "model": {"preset": "tiny"}, "data": {"source": "stdlib", "seq_len": 16},
            "train": {"steps": steps, "global_batch": 12, "micro_batch": 1},
            "checkpoint": {"url": f"file://{tmp_path}/ckpt", "interval_steps": interval}}


def options(**kw) -> ControllerOptions:
    base = dict(poll_s=0.1, spec_every_s=0.0, status_every_s=1.0, start_timeout_s=60.0, replace_wait_s=0.0,
                hang_timeout_s=3.0, call_timeout_s=30.0, grow_check_s=0.5, lease_ttl_s=600.0,
                failure=FailurePolicy(backoff_s=0.0))
    base.update(kw)
    return ControllerOptions(**base)


class Rig:
    """A controller, its fake group, its clock and its store."""

    def __init__(self, tmp_path, *, workers=2, min_workers=1, max_workers=8, steps=STEPS, capacity=None,
                 faults=(), opts=None, storage=None, step_seconds=0.1, create=True, wait_budget=None,
                 store_url=None, group=FakeGroup):
        self.clock = FakeClock()
        self.store = open_store(store_url or f"file://{tmp_path}/runs")
        self.spec = RunSpec(run_id=RUN, config=run_config(tmp_path, steps), workers=workers,
                            min_workers=min_workers, max_workers=max_workers)
        if create:
            self.store.create_run(self.spec)
        else:
            self.spec = self.store.get_spec(RUN)
        self.group = group(self.clock, interval=INTERVAL, capacity=capacity, faults=list(faults),
                           storage=storage, step_seconds=step_seconds, wait_budget=wait_budget)
        self.ctl = Controller(self.spec, self.store, self.group, opts or options(), clock=self.clock,
                              controller_id="ctl-test", sleep=self.clock.advance)
        self.trace = [self.ctl.state.name]

    def step(self) -> str:
        name = self.ctl.step().name
        self.trace.append(name)
        return name

    def drive(self, until=None, limit=3000) -> None:
        """Step until ``until(rig)`` holds (default: a terminal state); fail past ``limit`` iterations."""
        until = until or (lambda r: r.ctl.state.terminal)
        for _ in range(limit):
            if until(self):
                return
            if self.ctl.state.terminal:
                raise AssertionError(f"the run ended ({self.ctl.state.name}: {self.ctl.state.reason}) "
                                     f"before the condition held; phases {self.phases()}")
            self.step()
        raise AssertionError(f"condition not reached within {limit} iterations; phases {self.phases()}, "
                             f"step {self.ctl.last_completed_step()}")

    def drive_to_step(self, step: int) -> None:
        self.drive(lambda r: r.ctl.state.name == "RUNNING" and r.ctl.last_completed_step() >= step)

    def phases(self) -> list[str]:
        """The state names visited, consecutive repeats collapsed."""
        out = []
        for name in self.trace:
            if not out or out[-1] != name:
                out.append(name)
        return out

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in self.store.events(RUN) if kind is None or e["kind"] == kind]

    def status(self) -> dict:
        return self.store.get_status(RUN)

    def close(self) -> None:
        self.ctl._stop_keeper.set()


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(**kw) -> Rig:
        r = Rig(tmp_path, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def assert_finished_cleanly(r: Rig) -> None:
    assert r.ctl.state.name == "FINISHED", (r.ctl.state.name, getattr(r.ctl.state, "reason", ""))
    assert r.ctl.last_completed_step() == STEPS
    assert r.group.storage.latest() == STEPS  # the final checkpoint committed
    assert r.group.workers == {}  # every worker released
    st = r.status()
    assert st["phase"] == "FINISHED" and st["step"] == STEPS and st["latest_checkpoint"] == STEPS


# --- a clean run ------------------------------------------------------------------------


def test_clean_run_goes_through_the_states_and_finishes(rig):
    r = rig(workers=2)
    r.drive()
    assert r.phases() == ["INITIALIZING", "SCHEDULING", "RUNNING", "FINISHING", "FINISHED"]
    assert_finished_cleanly(r)
    assert r.group.steps_trained == STEPS  # no step computed twice
    assert r.ctl.epoch == 1
    assert sorted(r.group.storage.committed) == [5, 10, 15, 20]
    assert [e["kind"] for e in r.events()] == ["started", "formed", "finished"]
    formed = r.events("formed")[0]
    assert formed["world_size"] == 2 and formed["epoch"] == 1 and formed["step"] == 0
    assert r.status()["world_size"] == 0 and r.status()["recoveries"] == 0
    assert all(w.killed for w in r.group.all_workers) and len(r.group.all_workers) == 2


def test_progress_and_checkpoints_are_reported_while_running(rig):
    r = rig(workers=2)
    r.drive_to_step(12)
    assert r.ctl.state.name == "RUNNING"
    assert r.ctl.committed_step == 10
    assert [w.rank for w in r.group.by_rank()] == [0, 1]
    r.ctl.publish()
    st = r.status()
    assert st["phase"] == "RUNNING" and st["step"] == 12 and st["world_size"] == 2 and st["latest_checkpoint"] == 10


def test_run_returns_a_final_snapshot(rig):
    r = rig(workers=3, wait_budget=200)  # bounds run(): a runaway loop fails instead of hanging
    snap = r.ctl.run()
    assert snap["phase"] == "FINISHED" and snap["step"] == STEPS and snap["failures"] == 0
    assert r.group.steps_trained == STEPS


# --- failures -----------------------------------------------------------------------


def test_worker_death_recovers_in_place_from_the_last_checkpoint(rig):
    fault = Fault(rank=1, step=7, kind="die")
    r = rig(workers=2, faults=[fault])
    r.drive_to_step(7)
    members = list(r.ctl.members)
    r.drive(lambda r: r.ctl.state.name == "RECOVERING")
    assert fault.fired, "the fault did not fire"
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert r.ctl.epoch == 2
    # The survivor kept its process and its rank; the dead worker was killed and replaced.
    assert r.ctl.members[0] == members[0]
    assert members[1] not in r.group.workers and members[1] not in r.ctl.members
    assert len(r.ctl.members) == 2
    assert r.ctl.last_completed_step() == 5  # restored from the step-5 checkpoint
    r.drive()
    assert r.phases() == ["INITIALIZING", "SCHEDULING", "RUNNING", "RECOVERING", "RUNNING", "FINISHING",
                          "FINISHED"]
    assert_finished_cleanly(r)
    (failure,) = r.events("failure")
    assert failure["failure_kind"] == "actor_died" and failure["step"] == 7
    (recovered,) = r.events("recovered")
    assert recovered["steps_lost"] == 7 - 5 and recovered["restored_step"] == 5
    assert recovered["world_before"] == 2 and recovered["world_after"] == 2
    assert [e["epoch"] for e in r.events("formed")] == [1, 2]
    assert [e["restored_from"] for e in r.events("formed")] == [None, 5]
    assert r.group.steps_trained == STEPS + 2  # steps 6 and 7 were computed twice
    st = r.status()
    assert st["recoveries"] == 1 and st["failures"] == 1 and st["steps_lost"] == 2 and st["epoch"] == 2


def test_error_in_train_recovers_with_the_same_processes(rig):
    fault = Fault(rank=0, step=8, kind="error", message="RuntimeError: CUDA error: an illegal memory access")
    r = rig(workers=2, faults=[fault])
    r.drive_to_step(8)
    members = list(r.ctl.members)
    r.drive()
    assert_finished_cleanly(r)
    assert "RECOVERING" in r.phases()
    assert r.ctl.members == [] and len(r.group.all_workers) == 2  # nobody was replaced
    (failure,) = r.events("failure")
    assert failure["failure_kind"] == "error" and "illegal memory access" in failure["message"]
    assert r.events("recovered")[0]["steps_lost"] == 3
    assert all(w.wid in members for w in r.group.all_workers)


def test_failure_names_the_culprits_error_not_a_peers_collective_failure(rig):
    # Rank 1 raises; rank 0 only sees its collective fail because of it. Both results arrive in the
    # same poll: the recorded failure (which the crash-loop rule and the user read) must be the cause.
    fault = Fault(rank=1, step=8, kind="error", message="RuntimeError: loss is NaN")
    r = rig(workers=2, faults=[fault])
    r.drive(lambda r: r.ctl.state.name == "RECOVERING")
    assert fault.fired
    r.drive()
    assert_finished_cleanly(r)
    (failure,) = r.events("failure")
    assert failure["failure_kind"] == "error", failure
    assert failure["message"] == "rank 1: RuntimeError: loss is NaN", failure


def test_crash_loop_ends_failed(rig):
    fault = Fault(rank=0, step=7, kind="error", times=None, message="RuntimeError: loss is NaN")
    r = rig(workers=2, faults=[fault])
    r.drive(limit=500)
    assert r.ctl.state.name == "FAILED"
    assert "crash loop" in r.ctl.state.reason and "step 7" in r.ctl.state.reason
    assert len(fault.fired) == 3
    assert r.phases() == ["INITIALIZING", "SCHEDULING", "RUNNING", "RECOVERING", "RUNNING", "RECOVERING", "RUNNING",
                          "RECOVERING", "FAILED"]
    assert r.group.workers == {}  # released on failure
    st = r.status()
    assert st["phase"] == "FAILED" and "crash loop" in st["reason"]
    assert [e["kind"] for e in r.events()][-1] == "failed"


def test_crash_loop_of_a_dying_rank_ends_failed(rig):
    # Rank 1 dies at step 7 every time (say, an OOM on its batch): the replacement dies the same way.
    # The same failure at the same step three times is a crash loop, whichever process plays rank 1.
    fault = Fault(rank=1, step=7, kind="die", times=None)
    r = rig(workers=2, faults=[fault])
    r.drive(limit=2000)
    assert r.ctl.state.name == "FAILED"
    assert "crash loop" in r.ctl.state.reason, r.ctl.state.reason
    assert len(fault.fired) == 3


def test_max_failures_ends_failed(rig):
    faults = [Fault(rank=1, step=s, kind="error", message=f"RuntimeError: flaky {s}") for s in (3, 6, 9)]
    r = rig(workers=2, faults=faults, opts=options(failure=FailurePolicy(max_failures=2)))
    r.drive()
    assert r.ctl.state.name == "FAILED"
    assert "3 failures exceed max_failures=2" in r.ctl.state.reason
    assert r.group.workers == {}


def test_hang_is_detected_after_the_derived_deadline_and_recovered(rig):
    # Deadline: max(hang_min_s=1, hang_factor=20 x median step time 0.25 s) = 5 s.
    fault = Fault(rank=1, step=7, kind="hang")
    r = rig(workers=2, faults=[fault], step_seconds=0.25,
            opts=options(hang_timeout_s=0.0, hang_min_s=1.0, hang_factor=20.0))
    r.drive_to_step(7)
    assert r.ctl.hang_deadline() == 5.0
    r.drive(lambda r: bool(fault.fired))
    hung = r.group.by_rank()[1]
    assert hung.hung
    idle_seen = []
    while r.ctl.state.name == "RUNNING":
        before = r.clock()
        r.step()
        if r.ctl.state.name == "RUNNING":
            idle = r.clock() - r.ctl.progress_at
            assert idle <= 5.0 + 1e-9, f"still RUNNING {idle:.1f} s after the last step"
            idle_seen.append(idle)
        assert len(idle_seen) < 1000
    assert r.ctl.state.name == "RECOVERING"
    assert before - r.ctl.progress_at > 5.0 - 0.1 - 1e-9, "detected before the deadline"
    assert max(idle_seen) > 1.0  # not detected at hang_min_s
    r.drive()
    assert_finished_cleanly(r)
    assert hung.killed
    (failure,) = r.events("failure")
    assert failure["failure_kind"] == "hang" and failure["step"] == 7
    assert "1 worker(s) unresponsive" in failure["message"]
    (recovered,) = r.events("recovered")
    assert recovered["steps_lost"] == 2 and recovered["failure_kind"] == "hang"


def test_hung_member_is_named_at_the_deadline_not_after_pinging_it(rig):
    # The members are pinged ahead of the deadline: at the deadline the one that never answered is
    # known at once, rather than pinged then (2 s of answer time past the deadline).
    fault = Fault(rank=1, step=4, kind="hang")
    r = rig(workers=2, faults=[fault], opts=options(hang_timeout_s=6.0))
    r.drive(lambda r: bool(fault.fired))
    hung = r.group.by_rank()[1]
    last_progress = r.ctl.progress_at
    r.drive(lambda r: r.ctl.state.name == "RECOVERING", limit=500)
    assert r.ctl.state.suspects == (hung.wid,)
    assert 6.0 < r.ctl.state.detected_at - last_progress <= 6.0 + 0.3
    r.drive()
    assert_finished_cleanly(r)


def test_hang_with_fixed_deadline_advancing_the_clock_by_hand(rig):
    fault = Fault(rank=0, step=4, kind="hang")
    r = rig(workers=2, faults=[fault], opts=options(hang_timeout_s=30.0))
    r.drive(lambda r: bool(fault.fired))
    for _ in range(5):
        assert r.step() == "RUNNING"
    assert r.clock() - r.ctl.progress_at < 30.0
    r.clock.advance(30.0)
    assert r.step() == "RECOVERING"
    r.drive()
    assert_finished_cleanly(r)
    assert r.events("recovered")[0]["steps_lost"] == 4  # no checkpoint before step 5: from scratch
    assert r.events("recovered")[0]["restored_step"] == 0


def test_dead_worker_without_replacement_capacity_shrinks_then_grows_back(rig):
    fault = Fault(rank=1, step=7, kind="die", lose_capacity=True)
    r = rig(workers=4, capacity=4, faults=[fault])
    r.drive_to_step(7)
    r.drive(lambda r: r.ctl.state.name == "RECOVERING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 3 and r.ctl.last_completed_step() == 5  # 3 is valid for batch 12
    r.drive_to_step(9)
    assert len(r.ctl.members) == 3
    r.group.add_capacity(1)
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 4
    r.drive()
    assert_finished_cleanly(r)
    assert [e["world_size"] for e in r.events("formed")] == [4, 3, 4]
    assert r.events("recovered")[0]["world_after"] == 3
    assert r.group.steps_trained == STEPS + 2  # only the failure lost steps; the grow lost none


def test_start_waits_for_booting_workers_rather_than_starting_small(rig):
    # Both workers got their resources; one boots slower than replace_wait_s. Starting at 1 and
    # growing to 2 a moment later would cost a second formation: wait for it instead.
    r = rig(workers=2, opts=options(replace_wait_s=1.0, boot_timeout_s=60.0))
    r.group.boot_s = 8.0
    r.drive(lambda r: r.ctl.state.name == "RUNNING", limit=500)
    assert len(r.ctl.members) == 2
    r.drive()
    assert_finished_cleanly(r)
    assert [e["world_size"] for e in r.events("formed")] == [2] and r.events("resized") == []


def test_booting_workers_are_waited_for_only_up_to_the_boot_timeout(rig):
    r = rig(workers=2, opts=options(replace_wait_s=1.0, boot_timeout_s=5.0))
    r.group.boot_s = [0.0, 1000.0]  # the second worker holds its slot but never comes up in time
    t0 = r.clock()
    r.drive(lambda r: r.ctl.state.name == "RUNNING", limit=500)
    assert len(r.ctl.members) == 1
    assert 5.0 <= r.clock() - t0 < 10.0


def test_recovery_goes_on_with_the_survivors_and_grows_back_when_the_replacement_is_up(rig):
    fault = Fault(rank=1, step=7, kind="die")
    r = rig(workers=2, steps=200, faults=[fault], opts=options(replace_wait_s=1.0, boot_timeout_s=60.0))
    r.drive_to_step(7)
    r.group.boot_s = 6.0  # the replacement gets a slot at once and takes 6 s to come up
    r.drive(lambda r: r.ctl.state.name == "RECOVERING")
    t_fail = r.clock()
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 1 and r.clock() - t_fail < 6.0  # it did not wait for the boot
    r.drive(lambda r: len(r.ctl.members) == 2)
    r.drive()
    assert r.ctl.state.name == "FINISHED" and r.ctl.last_completed_step() == 200
    assert [e["world_size"] for e in r.events("formed")] == [2, 1, 2]
    assert [(e["from_workers"], e["to_workers"]) for e in r.events("resized")] == [(1, 2)]


def test_a_warm_standby_replaces_a_dead_worker_at_once(rig):
    fault = Fault(rank=1, step=7, kind="die")
    r = rig(workers=2, faults=[fault], opts=options(replace_wait_s=1.0, standby=1))
    r.group.boot_s = [0.0, 0.0, 0.0, 6.0]  # the standby is up from the start; its own replacement is slow
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.group.workers) == 3  # 2 members + 1 warm standby
    r.drive(lambda r: r.ctl.state.name == "RECOVERING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 2  # the standby took the dead worker's place
    assert len(r.group.all_workers) == 3  # and no new process was started during the recovery
    r.drive(lambda r: len(r.group.workers) == 3)  # a new standby once the group trains again
    assert len(r.group.all_workers) == 4 and r.ctl.state.name == "RUNNING"
    r.drive()
    assert_finished_cleanly(r)
    assert [e["world_size"] for e in r.events("formed")] == [2, 2] and r.events("resized") == []


def test_failure_during_formation_is_recovered(rig):
    # Rank 1 dies while the first group restores: the controller must treat it as a failure
    # (recover, replace the worker), not crash.
    fault = Fault(rank=1, step=None, kind="die", during="restore")
    r = rig(workers=2, faults=[fault])
    r.drive()
    assert fault.fired
    assert_finished_cleanly(r)
    assert len(r.events("failure")) == 1


def test_backoff_uses_the_controller_clock(rig):
    # FailurePolicy's backoff window compares failure times with the ``now`` the controller passes
    # (its clock). Two quick failures back off 1 s then 2 s; a third one 1000 s later is outside the
    # 60 s window and backs off 1 s again.
    slept = []
    faults = [Fault(rank=1, step=s, kind="error", message=f"RuntimeError: at {s}") for s in (6, 8, 13)]
    policy = FailurePolicy(backoff_s=1.0, max_backoff_s=30.0, backoff_window_s=60.0)
    r = rig(workers=2, faults=faults, opts=options(failure=policy, hang_timeout_s=1e6))
    r.ctl.sleep = slept.append
    r.drive(lambda r: len(faults[1].fired) == 1 and r.ctl.state.name == "RUNNING")
    r.clock.advance(1000.0)
    r.drive()
    assert_finished_cleanly(r)
    assert slept == [1.0, 2.0, 1.0]


# --- resizing -----------------------------------------------------------------------


def test_grow_on_request_at_a_step_boundary_loses_no_step(rig):
    r = rig(workers=2)
    r.drive_to_step(6)
    r.store.update_spec(RUN, workers=4)
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    stopped = [a for _, m, a in r.group.log if m == "request_stop"]
    assert len(stopped) == 2  # both old members were asked to stop at the boundary
    boundary = r.ctl.last_completed_step()
    assert boundary >= 6 and r.group.storage.latest() == boundary  # committed at the boundary
    assert len(r.ctl.members) == 4 and r.ctl.epoch == 2
    assert [w.rank for w in r.group.by_rank()] == [0, 1, 2, 3]
    r.drive()
    assert r.phases() == ["INITIALIZING", "SCHEDULING", "RUNNING", "RESIZING", "RUNNING", "FINISHING", "FINISHED"]
    assert_finished_cleanly(r)
    assert r.group.steps_trained == STEPS  # no step lost or recomputed
    (resized,) = r.events("resized")
    assert resized["from_workers"] == 2 and resized["to_workers"] == 4
    phases = resized["phases"]
    assert {"notice_s", "stop_s", "save_s", "form_s", "restore_s"} <= phases.keys()
    assert all(v >= 0 for v in phases.values())
    parts = sum(phases[k] for k in ("notice_s", "stop_s", "save_s", "form_s", "restore_s"))
    assert parts <= resized["resize_s"] + 1e-3  # the parts before the first step at the new size
    assert r.events("formed")[-1]["restored_from"] == boundary
    assert r.events("recovered") == [] and r.status()["steps_lost"] == 0 and r.status()["resizes"] == 1


def test_grow_waits_for_every_booting_spare_and_forms_once(rig):
    r = rig(workers=2, steps=200)
    r.drive_to_step(4)
    r.group.boot_s = [0.0, 0.0, 2.0, 6.0]  # the two new workers come up 2 s and 6 s after they start
    r.store.update_spec(RUN, workers=4)
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    assert all(w.up_at <= r.clock() for w in r.group.live())  # it waited for the slower spare too
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 4
    r.drive()
    assert [e["world_size"] for e in r.events("formed")] == [2, 4]
    assert [(e["from_workers"], e["to_workers"]) for e in r.events("resized")] == [(2, 4)]


def test_shrink_on_request_loses_no_step(rig):
    r = rig(workers=4)
    r.drive_to_step(6)
    r.store.update_spec(RUN, workers=2)
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 2
    r.drive()
    assert_finished_cleanly(r)
    assert r.group.steps_trained == STEPS
    assert [e["world_size"] for e in r.events("formed")] == [4, 2]


def test_shrink_releases_the_surplus_workers(rig):
    # Shrinking is how a user gives capacity back: the two workers no longer in the group must be
    # stopped, not kept as idle spares holding their placement (a GPU each on a GPU cluster).
    r = rig(workers=4)
    r.drive_to_step(6)
    r.store.update_spec(RUN, workers=2)
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    r.drive_to_step(r.ctl.last_completed_step() + 2)
    assert len(r.ctl.members) == 2
    assert sorted(r.group.workers) == sorted(r.ctl.members), "surplus workers still held after the shrink"


@pytest.mark.parametrize("start, requested, expected", [(2, 5, 4), (6, 5, 4)])
def test_resize_to_an_invalid_size_picks_a_valid_one(rig, start, requested, expected):
    r = rig(workers=start)
    r.drive_to_step(6)
    r.store.update_spec(RUN, workers=requested)
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == expected
    r.drive_to_step(r.ctl.last_completed_step() + 4)
    assert len(r.ctl.members) == expected and "RESIZING" not in r.phases()[4:]  # settles, no resize churn
    r.drive()
    assert_finished_cleanly(r)
    assert r.group.steps_trained == STEPS
    assert [e["world_size"] for e in r.events("formed")] == [start, expected]


def test_invalid_size_does_not_hold_a_useless_spare(rig):
    # Asking for 5 with valid sizes 1,2,3,4,6 runs 4; a fifth worker can never join a group,
    # so holding one started (and its placement) is waste.
    r = rig(workers=2)
    r.drive_to_step(6)
    r.store.update_spec(RUN, workers=5)
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    r.drive_to_step(r.ctl.last_completed_step() + 4)
    assert len(r.ctl.members) == 4
    assert len(r.group.workers) == 4, f"{len(r.group.workers) - 4} idle worker(s) held beyond the group"


def test_start_at_an_invalid_size_forms_promptly_with_a_replace_wait(rig):
    # replace_wait_s bounds how long the controller waits for *missing* workers; when every worker
    # it started is up, the best valid size (4 for a request of 5) forms at once.
    r = rig(workers=5, opts=options(replace_wait_s=30.0))
    r.drive(lambda r: r.ctl.state.name == "RUNNING", limit=200)
    assert len(r.ctl.members) == 4
    assert r.clock() - 1000.0 < 30.0


def test_resize_postponed_when_the_boundary_checkpoint_fails(rig):
    fault = Fault(rank=0, step=None, kind="error", during="save", message="StorageError: throttled")
    r = rig(workers=2, faults=[fault])
    r.drive_to_step(6)
    r.store.update_spec(RUN, workers=4)
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    assert r.step() == "RUNNING"  # postponed: the boundary save failed
    assert fault.fired and len(r.ctl.members) == 2 and r.ctl.epoch == 1
    assert r.events("checkpoint_failed")[0]["error"] == "StorageError: throttled"
    r.drive(lambda r: r.ctl.state.name == "RESIZING")  # tried again after grow_check_s
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 4
    r.drive()
    assert_finished_cleanly(r)
    assert r.group.steps_trained == STEPS


def test_member_dying_during_the_final_save_is_recovered_and_the_final_checkpoint_commits(rig):
    # 22 steps with a checkpoint every 5: the last periodic one is step 20, so step 22 needs the final save.
    fault = Fault(rank=1, step=22, kind="die", during="save")
    r = rig(workers=2, steps=22, faults=[fault])
    r.drive()
    assert fault.fired
    assert r.ctl.state.name == "FINISHED", r.ctl.state.reason
    assert "RECOVERING" in r.phases()[r.phases().index("FINISHING"):]
    assert r.group.storage.latest() == 22 and r.status()["latest_checkpoint"] == 22
    assert r.ctl.last_completed_step() == 22


# --- suspend and resume ---------------------------------------------------------------


def test_suspend_commits_a_checkpoint_and_releases_every_worker(rig):
    r = rig(workers=3)
    r.drive_to_step(6)
    r.store.update_spec(RUN, suspended=True)
    r.drive(lambda r: r.ctl.state.name == "SUSPENDING")
    seen = r.ctl.last_completed_step()  # the step when the request was read; one more is in flight
    r.drive()
    assert r.phases() == ["INITIALIZING", "SCHEDULING", "RUNNING", "SUSPENDING", "SUSPENDED"]
    step = r.ctl.last_completed_step()
    assert step == seen + 1  # stopped at the next step boundary, not later
    assert r.group.steps_trained == step
    assert r.group.storage.latest() == step  # a committed checkpoint at the suspend step
    assert r.group.workers == {} and all(w.killed for w in r.group.all_workers)
    (ev,) = r.events("suspended")
    assert ev["step"] == step and ev["checkpoint_committed"] is True
    st = r.status()
    assert st["phase"] == "SUSPENDED" and st["step"] == step and st["latest_checkpoint"] == step
    assert f"at step {step}" in r.ctl.state.reason


def test_resume_after_suspend_continues_from_the_checkpoint_on_another_size(rig):
    storage = FakeStorage()
    r = rig(workers=3, storage=storage)
    r.drive_to_step(8)
    r.store.update_spec(RUN, suspended=True)
    r.drive()
    step = r.ctl.last_completed_step()
    r.store.update_spec(RUN, suspended=False, workers=2)
    r2 = rig(workers=2, storage=storage, create=False)
    r2.drive()
    assert_finished_cleanly(r2)
    assert r2.events("formed")[-1]["restored_from"] == step and r2.events("formed")[-1]["world_size"] == 2
    assert r.group.steps_trained + r2.group.steps_trained == STEPS  # nothing lost across the suspension
    assert r2.ctl.epoch == 2  # the fencing epoch carries on


def test_suspend_while_queued(rig):
    r = rig(workers=2, min_workers=2, capacity=1)
    r.drive(lambda r: r.ctl.state.name == "QUEUED")
    r.step()
    r.store.update_spec(RUN, suspended=True)
    r.drive(limit=100)
    assert r.ctl.state.name == "SUSPENDED"
    assert r.group.workers == {}
    assert r.events("suspended")[0]["checkpoint_committed"] is False


# --- capacity -----------------------------------------------------------------------


class StartDeathGroup(FakeGroup):
    """The fake group, with workers that die while they start (SIGKILLed while importing torch):
    ``ready`` finds each one dead and forgets it, as ``RayWorkerGroup.ready`` does when the actor's
    first call fails. ``die_at_start``: the start order (0, 1, ...) of the workers that die so."""

    die_at_start: set[int] = set()

    def ready(self, wids, timeout):
        up = super().ready(wids, timeout)
        for wid in [w for w in up if self.workers[w].seq in self.die_at_start]:  # its boot ends in death
            self.die_at_start = self.die_at_start - {self.workers[wid].seq}
            self.kill(wid)
            up.remove(wid)
        return up


def test_a_worker_lost_while_scheduling_is_a_failure_replaced_and_the_group_grows_back(rig):
    # 3 requested; the third worker dies while it starts, the other two are up: the group may go on
    # at 2 (as after any failure), but the loss is reported and a replacement grows it back to 3.
    r = rig(workers=3, steps=60, group=StartDeathGroup)
    r.group.die_at_start = {2}
    r.group.boot_s = [0.0, 0.0, 1.0, 3.0]  # the replacement (the fourth worker started) boots in 3 s
    r.drive()
    assert r.ctl.state.name == "FINISHED" and r.ctl.last_completed_step() == 60
    assert r.group.all_workers[2].killed and len(r.group.all_workers) == 4
    (failure,) = r.events("failure")
    assert failure["failure_kind"] == "actor_died" and failure["step"] == 0 and failure["world_size"] == 0
    assert "died while starting" in failure["message"]
    (rec,) = r.events("recovered")
    assert rec["steps_lost"] == 0 and rec["world_before"] == 0
    assert r.events("formed")[-1]["world_size"] == 3
    st = r.status()
    assert st["failures"] == 1 and st["recoveries"] == 1 and st["workers_requested"] == 3


def test_a_worker_lost_while_scheduling_is_waited_for_within_replace_wait(rig):
    # As after any failure, elastic.replace_wait_s is how long the replacement is waited for before
    # the group goes on smaller: within it, the group forms once, at the size requested.
    r = rig(workers=3, steps=30, group=StartDeathGroup, opts=options(replace_wait_s=5.0))
    r.group.die_at_start = {1}
    r.group.boot_s = 2.0  # all three hold resources and boot; the second dies, its replacement boots in 2 s
    r.drive()
    assert r.ctl.state.name == "FINISHED"
    assert [e["world_size"] for e in r.events("formed")] == [3] and r.events("resized") == []
    assert len(r.events("failure")) == 1 and r.events("recovered")[0]["world_after"] == 3


def test_workers_that_keep_dying_while_starting_end_the_run_as_a_crash_loop(rig):
    class AlwaysDies(StartDeathGroup):
        def ready(self, wids, timeout):
            self.die_at_start = {self.workers[w].seq for w in wids if w in self.workers and self.workers[w].epoch < 0}
            return super().ready(wids, timeout)

    r = rig(workers=2, group=AlwaysDies)
    r.drive(limit=500)
    assert r.ctl.state.name == "FAILED" and "crash loop" in r.ctl.state.reason, r.ctl.state.reason
    assert "died while starting" in r.ctl.state.reason
    assert len(r.events("failure")) == 3 and r.group.workers == {}


def test_a_standby_lost_while_it_starts_is_replaced(rig):
    r = rig(workers=2, steps=200, opts=options(standby=1), group=StartDeathGroup)
    r.group.die_at_start = {2}  # the standby, once the group trains
    r.group.boot_s = [0.0, 0.0, 1.0, 1.0]
    r.drive(lambda r: r.ctl.state.name == "RUNNING" and r.ctl.standby_ready == 1)
    assert r.group.all_workers[2].killed and len(r.group.all_workers) == 4
    assert r.events("failure") == []  # the group trains on: a spare is no member
    r.drive()
    assert r.ctl.state.name == "FINISHED"


def test_short_capacity_runs_at_the_largest_valid_size_then_grows(rig):
    r = rig(workers=6, min_workers=2, capacity=5)
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 4  # 5 are up, but 5 does not divide the batch
    r.drive_to_step(6)
    assert len(r.ctl.members) == 4 and "RESIZING" not in r.phases()
    r.group.add_capacity(1)
    r.drive(lambda r: r.ctl.state.name == "RESIZING")
    r.drive(lambda r: r.ctl.state.name == "RUNNING")
    assert len(r.ctl.members) == 6
    r.drive()
    assert_finished_cleanly(r)
    assert [e["world_size"] for e in r.events("formed")] == [4, 6]
    assert r.group.steps_trained == STEPS


def test_below_min_workers_waits_queued_until_its_gang_is_admitted(rig):
    r = rig(workers=4, min_workers=2, capacity=1)
    for _ in range(20):
        r.step()
    assert r.ctl.state.name == "QUEUED" and r.ctl.members == [] and r.group.workers == {}
    r.ctl.publish()
    st = r.status()
    assert st["phase"] == "QUEUED" and st["queue_wait_s"] > 0 and "starting" in st["queue_reason"]
    r.group.add_capacity(2)
    r.drive(lambda r: r.ctl.state.name == "RUNNING", limit=50)
    assert len(r.ctl.members) == 3  # the gang of 2, and one more in a slot of its own
    assert [e["kind"] for e in r.events()][:3] == ["started", "queued", "admitted"]
    assert r.events("queued")[0]["workers"] == 2 and r.events("admitted")[0]["wait_s"] > 0
    r.drive()
    assert_finished_cleanly(r)
    assert r.phases()[:4] == ["INITIALIZING", "QUEUED", "SCHEDULING", "RUNNING"]


def test_no_capacity_waits_queued_for_ever_not_failed(rig):
    r = rig(workers=2, min_workers=2, capacity=1, opts=options(start_timeout_s=5.0))
    for _ in range(300):  # far past start_timeout_s: never FAILED for want of capacity
        r.step()
    assert r.ctl.state.name == "QUEUED" and r.ctl.failures.records == []
    assert r.group.workers == {} and not r.group.gang_placed  # nothing half-held


def test_the_queue_timeout_fails_a_run_not_admitted_naming_the_key(rig):
    r = rig(workers=2, min_workers=2, capacity=1, opts=options(queue_timeout_s=5.0))
    r.drive(limit=500)
    assert r.ctl.state.name == "FAILED"
    assert "elastic.queue_timeout_s=5" in r.ctl.state.reason and "2 min_workers" in r.ctl.state.reason
    assert r.group.workers == {} and r.group.gang is None


def test_a_gang_members_replacement_takes_its_freed_bundle(rig):
    r = rig(workers=3, min_workers=2, capacity=3, steps=200, faults=[Fault(rank=0, step=7, kind="die")])
    r.drive(lambda r: r.events("recovered") and r.ctl.state.name == "RUNNING")
    assert sorted(r.group.workers[w].bundle for w in r.ctl.members if r.group.workers[w].bundle is not None) == [0, 1]
    assert len(r.ctl.members) == 3 and r.ctl.failures.records[0].kind == "actor_died"


def test_the_allocators_target_is_the_desired_size_snapped_and_a_resize_clears_it(rig):
    from orchestrator.controller.membership import desired_size

    assert desired_size(2, 0, 1, 4, [1, 2, 4]) == 2  # no decision: the requested workers
    assert desired_size(2, 3, 1, 4, [1, 2, 4]) == 2  # snapped down to a valid size
    assert desired_size(2, 9, 1, 4, [1, 2, 4]) == 4  # at most max_workers
    assert desired_size(2, 1, 2, 4, [1, 2, 4]) == 2  # at least min_workers
    assert desired_size(3, 0, 3, 4, [2, 4]) == 4  # no valid size below: the smallest valid one
    r = rig(workers=1, min_workers=1, max_workers=3, steps=200)
    r.drive_to_step(3)
    r.store.update_spec(RUN, expected=r.ctl.spec.generation, target=3)  # the allocator grows it past workers
    r.drive(lambda r: len(r.ctl.members) == 3 and r.events("resized"))
    assert r.events("resized")[0]["to_workers"] == 3 and r.group.steps_trained == r.ctl.last_completed_step()


# --- fencing -------------------------------------------------------------------------


def test_a_controller_whose_run_another_controller_took_over_is_fenced(rig, etcd_server):
    r = rig(workers=2, steps=200, store_url=f"{etcd_server.url}-{uuid.uuid4().hex[:6]}")
    r.drive_to_step(6)
    r.ctl.publish()
    assert r.status()["phase"] == "RUNNING"
    # The first controller's lease ends (as when it is cut off from etcd for longer than its TTL)
    # and a second controller takes the run over and moves the epoch.
    r.store.release(r.ctl.lease)
    second = r.store.acquire(RUN, "ctl-second")
    r.store.bump_epoch(RUN, second, r.ctl.epoch)
    r.store.put_status(RUN, {"phase": "RUNNING", "controller_id": "ctl-second"}, second)
    r.ctl.next_status = 0.0
    r.drive()
    assert r.ctl.state.name == "FAILED" and r.ctl.state.reason.startswith("fenced"), r.ctl.state.reason
    assert r.status()["controller_id"] == "ctl-second"  # the fenced controller changed nothing
    assert r.group.workers == {}  # and stopped its workers
    with pytest.raises(FencedError):
        r.store.bump_epoch(RUN, r.ctl.lease, r.ctl.epoch + 1)


def test_recovery_that_waits_for_capacity_is_still_reported_as_a_recovery(rig):
    fault = Fault(rank=1, step=7, kind="die", lose_capacity=True)
    r = rig(workers=2, min_workers=2, capacity=2, steps=200, faults=[fault])
    r.drive(lambda r: r.ctl.state.name == "SCHEDULING" and fault.fired)
    r.group.add_capacity(1)
    r.drive(lambda r: r.ctl.state.name == "RUNNING" and r.ctl.last_completed_step() > 5)
    (rec,) = r.events("recovered")
    assert rec["world_before"] == 2 and rec["world_after"] == 2 and rec["restored_step"] == 5
    r.ctl.publish()
    assert rec["steps_lost"] == 2 and r.status()["recoveries"] == 1


# --- the run store away --------------------------------------------------------------


def flaky(monkeypatch, store, method: str, failures: int) -> list:
    """Make ``store.method`` raise StoreUnavailable ``failures`` times, then work; returns the call log."""
    real, calls = getattr(store, method), []

    def wrapper(*a, **kw):
        calls.append(a)
        if len(calls) <= failures:
            raise StoreUnavailable("etcd at etcd://127.0.0.1:1/x is unreachable (ConnectionError)")
        return real(*a, **kw)

    monkeypatch.setattr(store, method, wrapper)
    return calls


def test_recovery_waits_for_the_store_to_move_the_epoch(rig, monkeypatch):
    fault = Fault(rank=1, step=7, kind="die")
    r = rig(workers=2, faults=[fault])
    r.drive_to_step(7)
    calls = flaky(monkeypatch, r.store, "bump_epoch", failures=3)
    r.drive()
    assert_finished_cleanly(r)
    assert len(calls) == 4 and r.ctl.epoch == 2  # retried through the outage, then fenced as usual


def test_a_store_away_for_longer_than_the_bound_fails_the_run_with_the_reason(rig, monkeypatch):
    fault = Fault(rank=1, step=7, kind="die")
    r = rig(workers=2, faults=[fault], opts=options(store_wait_s=5.0))
    r.drive_to_step(7)
    flaky(monkeypatch, r.store, "bump_epoch", failures=10_000)
    r.drive()
    assert r.ctl.state.name == "FAILED"
    assert "run store was unreachable for 5 s" in r.ctl.state.reason
    assert r.group.workers == {}


def test_the_final_status_is_written_once_the_store_is_back(rig, monkeypatch):
    r = rig(workers=2)
    r.drive(lambda r: r.ctl.state.name == "FINISHING")
    calls = flaky(monkeypatch, r.store, "put_status", failures=3)
    r.drive()
    assert r.status()["phase"] == "FINISHED" and len(calls) >= 4
    assert r.events()[-1]["kind"] == "finished"


# --- on a real Ray cluster ------------------------------------------------------------------


@pytest.mark.ray
def test_a_train_worker_sigkilled_while_scheduling_is_replaced_on_ray(ray_cluster, tmp_path):
    # The Ray group's part: a TrainWorker killed (SIGKILL) while it starts fails its first call; the group
    # forgets it and the controller replaces it. The run trains at the 3 workers requested in the end.
    import os
    import signal
    import threading
    import time

    from orchestrator.chaos import procfs
    from orchestrator.driver.run import controller_options, parse_spec, prepare_run
    from orchestrator.workers.group import RayWorkerGroup
    from tests.cluster import RUN_BASE

    root = f"file://{tmp_path}/runs"
    token = uuid.uuid4().hex  # marks this test's worker processes, and only them
    spec, store = prepare_run("examples/tiny.toml", [*RUN_BASE, f'checkpoint.url="{root}"', "train.steps=12"],
                              workers=3, min_workers=1, max_workers=3, run_id=f"t-{token[:6]}", store=root)
    cfg, ecfg = parse_spec(spec)
    group = RayWorkerGroup(cfg, spec.run_id, root, env={"ETRAIN_TEST_TOKEN": token})
    ctl = Controller(spec, store, group, controller_options(ecfg), config=cfg)
    killed: list[int] = []

    def kill_one_while_it_starts() -> None:
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            for pid in procfs.pids():
                try:
                    mine = procfs.environ(pid).get("ETRAIN_TEST_TOKEN") == token
                    starting = "TrainWorker.__init__" in " ".join(procfs.cmdline(pid))
                except OSError:
                    continue
                if mine and starting:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one_while_it_starts, daemon=True)
    killer.start()
    try:
        final = ctl.run()
    finally:
        group.shutdown()
    killer.join(5)
    assert killed, "no TrainWorker was seen starting"
    assert final["phase"] == "FINISHED" and final["step"] == 12, final
    assert final["failures"] == 1 and final["recoveries"] == 1, final
    events = store.events(spec.run_id)
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["failure_kind"] == "actor_died" and failure["step"] == 0
    assert "died while starting" in failure["message"]
    formed = [e for e in events if e["kind"] == "formed"]
    assert formed[-1]["world_size"] == 3 and killed[0] not in formed[-1]["pids"]


def test_requeue_commits_gives_everything_back_and_continues_when_cleared(rig):
    r = rig(workers=2, steps=STEPS)
    r.drive_to_step(7)
    r.store.update_spec(RUN, expected=r.ctl.spec.generation, requeue=True)  # as the allocator writes it
    r.drive(lambda r: r.ctl.state.name == "QUEUED")
    at = r.ctl.last_completed_step()
    assert r.group.storage.latest() == at and r.group.workers == {} and r.group.gang is None
    (pre,) = r.events("preempted")
    assert pre["action"] == "suspend" and pre["checkpoint_committed"] and pre["step"] == at
    t0 = r.clock()
    for _ in range(20):  # held while requeue is set
        r.step()
    assert r.ctl.state.name == "QUEUED" and r.group.workers == {}
    assert r.clock() - t0 >= 20 * 0.1  # each look waits a poll: a held run does not spin
    r.store.update_spec(RUN, requeue=False)
    r.drive()
    assert_finished_cleanly(r)
    assert r.group.steps_trained == STEPS  # committed at the boundary: no step trained twice
    assert r.ctl.failures.records == [] and r.events("admitted")


def test_a_requeued_run_past_its_queue_timeout_ends_suspended_and_resumable(rig):
    """A run the allocator requeued waited in QUEUED for ever: queue_timeout_s bounds that wait too."""
    r = rig(workers=2, steps=STEPS, opts=options(queue_timeout_s=5.0))
    r.drive_to_step(7)
    r.store.update_spec(RUN, expected=r.ctl.spec.generation, requeue=True)  # as the allocator writes it
    r.drive(lambda r: r.ctl.state.name == "QUEUED")
    at = r.ctl.last_completed_step()
    r.drive(limit=500)
    assert r.ctl.state.name == "SUSPENDED", (r.ctl.state.name, r.ctl.state.reason)
    assert "elastic.queue_timeout_s=5" in r.ctl.state.reason and "etrain resume" in r.ctl.state.reason
    (ev,) = r.events("suspended")
    assert ev["cause"] == "queue_timeout" and ev["checkpoint_committed"] and ev["step"] == at
    assert r.group.storage.latest() == at and r.group.workers == {} and r.ctl.failures.records == []


def test_a_group_that_cannot_form_in_scheduling_gives_back_and_waits_queued_not_failed(rig):
    fault = Fault(rank=1, step=7, kind="die", lose_capacity=True)  # its gang bundle's slot goes with it
    r = rig(workers=2, min_workers=2, capacity=2, steps=200, faults=[fault], opts=options(start_timeout_s=5.0))
    r.drive(lambda r: r.ctl.state.name == "QUEUED" and fault.fired)
    r.step()
    assert r.group.workers == {} and r.ctl.state.name == "QUEUED"  # nothing held while it waits
    r.ctl.publish()
    assert "did not start within 5 s" in r.events("queued")[0]["reason"]
    r.group.add_capacity(1)
    r.drive(lambda r: r.ctl.state.name == "RUNNING" and r.ctl.last_completed_step() > 5)
    assert r.events("admitted") and len(r.ctl.members) == 2 and r.ctl.state.name == "RUNNING"


def test_a_shrink_keeps_the_gangs_members_so_that_it_frees_what_it_gives_back(rig):
    r = rig(workers=3, min_workers=1, max_workers=3, steps=200, faults=[Fault(rank=0, step=7, kind="die")])
    r.drive(lambda r: len(r.ctl.members) == 3 and r.events("recovered"))  # the replacement took the gang's bundle
    assert [r.group.in_gang(w) for w in r.ctl.members] == [False, False, True]
    r.store.update_spec(RUN, expected=r.ctl.spec.generation, target=1)
    r.drive(lambda r: len(r.ctl.members) == 1 and r.ctl.state.name == "RUNNING")
    assert r.group.in_gang(r.ctl.members[0]) and list(r.group.workers) == r.ctl.members  # nothing else held
