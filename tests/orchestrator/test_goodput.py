"""Goodput: effective training time (the steps the final model holds) against the time of every step
trained, on step histories whose right answer is worked out by hand; the two figures in the run's
status (a controller stepped over a fake group whose rank 0 reports its history, as TrainWorker does),
across a second controller, in the Prometheus exposition and in the chaos report.

No Ray: the controller tests drive ``orchestrator.controller.controller.Controller`` over ``tests.fake_group``.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.chaos.injector import Injection
from orchestrator.chaos.plan import load_plan
from orchestrator.chaos.report import assess, format_report, report
from orchestrator.controller.controller import Controller
from orchestrator.controller.observers import Goodput, MetricsObserver
from tests.fake_group import FakeClock, FakeGroup, Fault
from tests.orchestrator.test_controller import INTERVAL, RUN, Rig, options
from trainer.observe.metrics import RunMetrics, StepLedger


class Timeline:
    """A run told as it happens: wall time passes, steps are trained (rank 0's history rows), groups
    restore a step; a :class:`Goodput` observer hears it through the hooks the controller calls."""

    def __init__(self, start: float = 10_000.0):
        self.clock = FakeClock(start)
        self.goodput = Goodput(clock=self.clock)
        self.step = 0
        self.row = 0

    def train(self, *seconds: float) -> None:
        """One step per value, each taking that long; the history reaches the controller at once."""
        rows = []
        for s in seconds:
            self.clock.advance(s)
            self.step += 1
            rows.append([self.step, 1.0, 2, 12 * self.step, self.clock(), s])
        self.goodput.on_history(None, rows)

    def idle(self, seconds: float) -> None:
        """Time outside any step: a checkpoint's blocking copy, detection, forming, restoring, waiting."""
        self.clock.advance(seconds)

    def restore(self, step: int) -> None:
        self.step = step
        self.goodput.on_formed(_Ctl(step))


class _Ctl:
    """What ``Goodput.on_formed`` reads of the controller: the step the new group restored."""

    def __init__(self, step: int):
        self.step = step

    def last_completed_step(self) -> int:
        return self.step


# --- the figures, by hand ---------------------------------------------------------------------


def test_without_failures_effective_equals_step_time_and_both_leave_checkpoint_blocking_out():
    t = Timeline()
    t.idle(2.0)  # scheduling and forming
    for _ in range(2):
        t.train(1.0, 1.0, 1.0, 1.0, 1.0)
        t.idle(0.5)  # the checkpoint's blocking copy, outside the step's own time
    wall = 2.0 + 10 * 1.0 + 2 * 0.5
    g = t.goodput
    assert g.wall_s() == pytest.approx(wall)
    assert g.ledger.effective_s == pytest.approx(10.0) and g.ledger.step_time_s == pytest.approx(10.0)
    assert g.ratio() == pytest.approx(g.step_time_ratio())
    assert g.ratio() == pytest.approx((wall - 2.0 - 2 * 0.5) / wall)  # 10 / 13


@pytest.mark.parametrize("told", [True, False], ids=["restore-told", "history-only"])
def test_a_failure_after_k_uncommitted_steps_leaves_their_time_out(told):
    # Steps 1-5 committed at 5; steps 6-8 (k = 3) trained, then a worker dies. The group restores 5 and
    # trains 6-10 again, slower at first (a smaller group). Effective: 1-5 once, 6-10 as trained the
    # second time; the step time ratio counts 6-8 twice.
    t = Timeline()
    t.train(1.0, 1.0, 1.0, 1.0, 1.0)
    t.idle(0.5)  # the checkpoint of step 5
    t.train(1.5, 1.5, 1.5)  # steps 6, 7, 8: lost
    t.idle(4.0)  # detection, settle, forming and restoring
    if told:
        t.restore(5)
    else:
        t.step = 5  # the controller polled no restore: the next row (step 6 again) tells it
    t.train(2.0, 2.0, 1.0, 1.0, 1.0)
    wall = 5 + 0.5 + 4.5 + 4.0 + 7.0
    g = t.goodput
    assert g.ledger.effective_s == pytest.approx(5.0 + 7.0)
    assert g.ledger.step_time_s == pytest.approx(5.0 + 4.5 + 7.0)
    assert g.ratio() == pytest.approx(12.0 / wall)
    assert g.step_time_ratio() == pytest.approx(16.5 / wall)
    assert list(g.ledger.steps) == list(range(1, 11))


def test_rolled_back_steps_leave_at_the_restore_before_any_step_is_trained_again():
    t = Timeline()
    t.train(*[1.0] * 8)
    t.restore(5)
    assert t.goodput.ledger.effective_s == pytest.approx(5.0)
    assert t.goodput.ledger.step_time_s == pytest.approx(8.0)


def test_a_resize_loses_no_step():
    t = Timeline()
    t.train(*[1.0] * 6)
    t.idle(3.0)  # stop at the boundary, save, form at the new size, restore the boundary step
    t.restore(6)
    t.train(*[0.5] * 4)  # faster at the new size
    g = t.goodput
    assert g.ledger.effective_s == pytest.approx(8.0) == g.ledger.step_time_s
    assert g.ratio() == pytest.approx(8.0 / 11.0)


def test_two_failures_and_a_restore_to_an_older_checkpoint():
    # 1-10 trained, committed at 4 and 8; a failure at 10 restores 8 (the newest commit); 9-12 again;
    # a second failure restores 4 (the commit of 8 found corrupt): 5-12 again, then 13.
    ledger = StepLedger()
    for s in range(1, 11):
        ledger.trained(s, 1.0)
    assert ledger.restored(8) == 2
    for s in range(9, 13):
        ledger.trained(s, 2.0)
    assert ledger.restored(4) == 8
    for s in range(5, 14):
        ledger.trained(s, 3.0)
    assert ledger.effective_s == pytest.approx(4 * 1.0 + 9 * 3.0)
    assert ledger.step_time_s == pytest.approx(10 * 1.0 + 4 * 2.0 + 9 * 3.0)
    assert ledger.held == 13


# --- across controllers ------------------------------------------------------------------------


def _first_controller() -> tuple[Timeline, dict, list]:
    """A run's first controller: 8 steps of 1 s (committed at 5), 2 s outside steps; its last status
    and history as the run store holds them."""
    t = Timeline()
    t.idle(2.0)
    t.train(*[1.0] * 8)
    g = t.goodput
    rows = []
    for s in range(1, 9):
        rows.append([s, 1.0, 2, 12 * s, 0.0, 1.0])
    status = {"phase": "RUNNING", "updated_unix": t.clock(), **g.status_fields(None)}
    return t, status, rows


def test_a_controller_taking_over_an_interrupted_run_counts_the_gap_and_rolls_back_uncommitted_steps():
    first, status, history = _first_controller()
    assert status["wall_s"] == pytest.approx(10.0) and status["goodput"] == pytest.approx(0.8)
    clock = FakeClock(first.clock() + 20.0)  # the run was down for 20 s
    g = Goodput(clock=clock)
    g.resume(status, history)
    assert g.started_unix == status["started_unix"]
    assert g.wall_s() == pytest.approx(30.0) and g.ledger.effective_s == pytest.approx(8.0)
    g.on_formed(_Ctl(5))  # the new group restores the commit of step 5
    clock.advance(3.0)
    g.on_history(None, [[s, 1.0, 2, 12 * s, clock(), 1.0] for s in (6, 7, 8)])
    assert g.ledger.effective_s == pytest.approx(8.0) and g.ledger.step_time_s == pytest.approx(11.0)
    assert g.ratio() == pytest.approx(8.0 / 33.0)


def test_a_resumed_suspended_run_does_not_count_the_time_it_was_suspended():
    first, status, history = _first_controller()
    status["phase"] = "SUSPENDED"
    g = Goodput(clock=FakeClock(first.clock() + 86_400.0))  # resumed a day later
    g.resume(status, history)
    assert g.wall_s() == pytest.approx(10.0) and g.ratio() == pytest.approx(0.8)


def test_a_status_written_before_wall_s_existed_counts_its_controller_from_start_to_last_write():
    old = {"phase": "SUSPENDED", "started_unix": 100.0, "updated_unix": 130.0, "goodput": 0.9}
    g = Goodput(clock=FakeClock(500.0))
    g.resume(old, [[s, 1.0, 2, 12 * s, 100.0 + s, 2.0] for s in range(1, 11)])
    assert g.wall_s() == pytest.approx(30.0) and g.ledger.effective_s == pytest.approx(20.0)
    assert g.started_unix == 100.0


def test_a_new_run_starts_from_nothing():
    g = Goodput(clock=FakeClock())
    g.resume(None, [])
    assert g.wall_s() == 0.0 and g.ledger.held == 0 and g.ratio() == 0.0


# --- the controller's status ---------------------------------------------------------------------


STEP_S = 0.05  # each step's own time in the fake group's history


class HistoryGroup(FakeGroup):
    """The fake group whose rank 0 reports each step it trains (``progress()["history"]``), as
    ``TrainWorker`` does; a dead rank 0's unreported rows die with it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rows: dict[str, list] = {}

    def _advance_epoch(self, ranks):
        before = {w.wid: w.step for w in ranks}
        super()._advance_epoch(ranks)
        for w in ranks:
            if w.rank == 0 and not w.dead and w.step > before[w.wid]:
                self.rows.setdefault(w.wid, []).append([w.step, 10.0 / w.step, w.world, 12 * w.step,
                                                        self.clock(), self.step_seconds])

    def _execute(self, w, call, method, args):
        if method == "telemetry":  # the metrics observer's question: no collectives in the fake
            call.ref.set({})
            return
        super()._execute(w, call, method, args)
        if method == "progress":
            call.ref.value["history"] = self.rows.pop(w.wid, [])


def history_rig(tmp_path, faults=(), steps=20, metrics=None, create=True, storage=None) -> Rig:
    r = Rig(tmp_path, workers=2, steps=steps, faults=faults, create=create)
    r.group = HistoryGroup(r.clock, interval=INTERVAL, faults=list(faults), step_seconds=STEP_S, storage=storage)
    r.ctl = Controller(r.spec, r.store, r.group, options(), clock=r.clock, controller_id=f"ctl-{'new' if create else 'next'}",
                       sleep=r.clock.advance, observers=[MetricsObserver(metrics)] if metrics else [])
    # Wall time on the fake clock too (the controller's goodput reads Unix time; the fake clock starts at
    # 1000 s): a training poll advances it by poll_s (0.1 s), so a step of STEP_S leaves wall time over.
    r.ctl.goodput.clock = r.clock
    r.ctl.goodput.started_unix = r.ctl.goodput.since = r.clock()
    return r


def samples(m: RunMetrics) -> dict[tuple, float]:
    reg = CollectorRegistry()
    reg.register(m)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run_id")))] = s.value
    return out


def test_the_status_reports_both_figures_and_the_metrics_a_steps_lost_histogram(tmp_path):
    # A worker dies before step 8 (committed at 5): steps 6 and 7 are trained twice.
    m = RunMetrics(RUN)
    r = history_rig(tmp_path, faults=[Fault(rank=1, step=7, kind="die")], metrics=m)
    try:
        r.drive()
        st = r.status()
        assert st["phase"] == "FINISHED" and st["recoveries"] == 1 and st["steps_lost"] == 2
        assert st["effective_s"] == pytest.approx(20 * STEP_S) and st["step_time_s"] == pytest.approx(22 * STEP_S)
        assert st["wall_s"] > st["step_time_s"]
        assert st["goodput"] == pytest.approx(st["effective_s"] / st["wall_s"])
        assert st["step_time_ratio"] == pytest.approx(st["step_time_s"] / st["wall_s"])
        (rec,) = r.events("recovered")
        assert rec["steps_lost"] == 2
        s = samples(m)
        assert s[("etrain_steps_lost_per_failure_bucket", (("le", "1.0"),))] == 0
        assert s[("etrain_steps_lost_per_failure_bucket", (("le", "2.0"),))] == 1
        assert s[("etrain_steps_lost_per_failure_count", ())] == 1
        assert s[("etrain_steps_lost_per_failure_sum", ())] == 2
        assert s[("etrain_goodput_ratio", ())] == pytest.approx(r.ctl.goodput.ratio(), rel=0.05)
        assert s[("etrain_step_time_ratio", ())] == pytest.approx(r.ctl.goodput.step_time_ratio(), rel=0.05)
    finally:
        r.close()


def test_a_second_controller_goes_on_from_the_stored_status_and_history(tmp_path):
    # The first controller trains to step 8 (committed at 5) and vanishes; the second one restores 5.
    first = history_rig(tmp_path, steps=20)
    try:
        first.drive_to_step(8)
        first.ctl.poll_progress()
        first.ctl.publish()
        first.store.put_history(RUN, first.ctl.status.history)
        before = first.status()
        assert before["step_time_s"] == pytest.approx(STEP_S * first.ctl.last_completed_step())
        first.store.release(first.ctl.lease)
    finally:
        first.close()
    second = history_rig(tmp_path, steps=20, create=False, storage=first.group.storage)  # the same checkpoints
    try:
        second.drive()
        st = second.status()
        trained_first = round(before["step_time_s"] / STEP_S)
        assert st["phase"] == "FINISHED"
        assert st["started_unix"] == before["started_unix"] and st["wall_s"] >= before["wall_s"]
        assert st["effective_s"] == pytest.approx(20 * STEP_S)  # steps after 5 of the first count no more
        assert st["step_time_s"] == pytest.approx((trained_first + 20 - 5) * STEP_S)
    finally:
        second.close()


def test_under_torchrun_the_two_figures_are_one():
    # Rank 0's endpoint under torchrun reports only goodput: a restart is a new process, nothing rolls back.
    m = RunMetrics("run-t")
    m.observe_run(world_size=2, epoch=0, phase="RUNNING", goodput=0.93)
    s = samples(m)
    assert s[("etrain_goodput_ratio", ())] == 0.93 and s[("etrain_step_time_ratio", ())] == 0.93
    assert s[("etrain_steps_lost_per_failure_count", ())] == 0


# --- the chaos report ---------------------------------------------------------------------------


def test_the_chaos_report_shows_both_figures_and_the_steps_each_kill_lost():
    plan = load_plan(None, ["kind=kill_worker,at_step=7"])
    kill = Injection(fault=0, kind="kill_worker", time=100.0, step=7, target={"pid": 4242}, committed=5)
    events = [{"kind": "failure", "time": 100.4}, {"kind": "formed", "time": 102.0, "pids": [4241, 4243]},
              {"kind": "recovered", "time": 103.0, "first_step_unix": 103.0, "steps_lost": 2, "restored_step": 5}]
    rows = assess([kill], events, [])
    status = {"goodput": 0.812, "step_time_ratio": 0.934, "step": 40, "phase": "FINISHED"}
    r = report("run-x", plan, rows, status, [], None, None)
    assert r["goodput"] == 0.812 and r["step_time_ratio"] == 0.934
    assert r["steps_lost"] == 2 and r["faults"][0]["steps_lost"] == 2 and r["passed"]
    text = format_report(r)
    assert "goodput 0.812 effective, step time ratio 0.934" in text and "steps lost 2" in text
