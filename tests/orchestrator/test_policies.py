"""FailurePolicy and ScalingPolicy: pure decisions from an observed status and a clock value. No Ray."""

import dataclasses

import pytest

from orchestrator.controller.run_policy import (
    Continue,
    Fail,
    FailureLog,
    FailurePolicy,
    FailureRecord,
    FailureStatus,
    Resize,
    Restart,
    ScalingPolicy,
    ScalingStatus,
    Wait,
)

VALID = (1, 2, 3, 4, 6)  # global_batch 12, micro_batch 1, no tp/pp


def rec(step, message="worker died", t=0.0, kind="actor_died"):
    return FailureRecord(kind=kind, step=step, message=message, time=t)


def status(*records):
    return FailureStatus(tuple(records))


# --- FailurePolicy ------------------------------------------------------------------------


def test_restart_reason_names_kind_step_message_and_count():
    d = FailurePolicy(max_failures=5).decide(status(rec(7, "peer vanished", kind="collective_failed")), now=0.0)
    assert isinstance(d, Restart)
    assert d.delay_s == 0.0
    assert "collective_failed at step 7" in d.reason
    assert "peer vanished" in d.reason
    assert "failure 1 of at most 5" in d.reason
    assert "restarting in 0.0 s" in d.reason


def test_empty_history_restarts_without_delay():
    d = FailurePolicy(backoff_s=3.0).decide(status(), now=100.0)
    assert d == Restart(0.0, "no failure recorded")


def test_backoff_doubles_with_recent_failures():
    p = FailurePolicy(backoff_s=1.0, max_backoff_s=30.0, backoff_window_s=60.0)
    history = []
    delays = []
    for i in range(4):
        history.append(rec(10 * i, f"failure {i}", t=float(i)))
        delays.append(p.decide(status(*history), now=float(i)).delay_s)
    assert delays == [1.0, 2.0, 4.0, 8.0]
    assert "restarting in 8.0 s" in p.decide(status(*history), now=3.0).reason


def test_backoff_is_capped():
    p = FailurePolicy(backoff_s=1.0, max_backoff_s=5.0, backoff_window_s=60.0, max_failures=100)
    history = [rec(i, f"failure {i}", t=float(i)) for i in range(10)]
    d = p.decide(status(*history), now=10.0)
    assert isinstance(d, Restart)
    assert d.delay_s == 5.0


def test_backoff_only_counts_failures_within_the_window():
    p = FailurePolicy(backoff_s=1.0, max_backoff_s=30.0, backoff_window_s=60.0)
    history = [rec(1, "a", t=0.0), rec(2, "b", t=10.0), rec(3, "c", t=200.0)]
    # At 200 s the first two are older than the 60 s window: only the new one counts.
    assert p.decide(status(*history), now=200.0).delay_s == 1.0
    # The same history seen at 20 s (all three recent by the clock argument) backs off 4x.
    assert p.decide(status(*history), now=20.0).delay_s == 4.0


def test_no_backoff_configured_means_no_delay():
    p = FailurePolicy(backoff_s=0.0)
    history = [rec(i, f"m{i}", t=0.0) for i in range(5)]
    assert p.decide(status(*history), now=0.0).delay_s == 0.0


def test_max_failures_gives_fail_with_the_last_message():
    p = FailurePolicy(max_failures=2)
    two = [rec(1, "first"), rec(2, "second")]
    assert isinstance(p.decide(status(*two), now=0.0), Restart)
    d = p.decide(status(*two, rec(3, "third")), now=0.0)
    assert isinstance(d, Fail)
    assert "3 failures exceed max_failures=2" in d.reason
    assert "last: third" in d.reason


def test_max_failures_zero_fails_on_the_first_failure():
    d = FailurePolicy(max_failures=0).decide(status(rec(4, "boom")), now=0.0)
    assert isinstance(d, Fail)
    assert "max_failures=0" in d.reason


def test_crash_loop_same_step_same_message_fails():
    p = FailurePolicy(crash_loop_repeats=3)
    same = rec(7, "RuntimeError: loss is NaN")
    assert isinstance(p.decide(status(same, same), now=0.0), Restart)
    d = p.decide(status(same, same, same), now=0.0)
    assert isinstance(d, Fail)
    assert d.reason.startswith("crash loop: 3 failures in a row at step 7")
    assert "RuntimeError: loss is NaN" in d.reason


def test_failures_at_different_steps_are_not_a_crash_loop():
    p = FailurePolicy(crash_loop_repeats=3)
    d = p.decide(status(rec(7, "same"), rec(9, "same"), rec(11, "same")), now=0.0)
    assert isinstance(d, Restart)


def test_different_messages_at_the_same_step_are_not_a_crash_loop():
    p = FailurePolicy(crash_loop_repeats=3)
    d = p.decide(status(rec(7, "a"), rec(7, "b"), rec(7, "a")), now=0.0)
    assert isinstance(d, Restart)


def test_crash_loop_needs_the_repeats_in_a_row():
    p = FailurePolicy(crash_loop_repeats=3)
    a, b = rec(7, "a"), rec(9, "b")
    assert isinstance(p.decide(status(a, a, b, a, a), now=0.0), Restart)
    assert isinstance(p.decide(status(a, a, b, a, a, a), now=0.0), Fail)


def test_crash_loop_repeats_two():
    p = FailurePolicy(crash_loop_repeats=2)
    d = p.decide(status(rec(3, "x"), rec(3, "x")), now=0.0)
    assert isinstance(d, Fail) and "2 failures in a row at step 3" in d.reason


@pytest.mark.parametrize("kwargs, field", [
    ({"max_failures": -1}, "max_failures"),
    ({"crash_loop_repeats": 1}, "crash_loop_repeats"),
    ({"crash_loop_repeats": 0}, "crash_loop_repeats"),
])
def test_invalid_failure_policy_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FailurePolicy(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"backoff_s": -1.0}, "backoff_s"),
    ({"max_backoff_s": -1.0}, "max_backoff_s"),
    ({"backoff_window_s": -5.0}, "backoff_window_s"),
])
def test_negative_durations_are_refused(kwargs, field):
    # A negative backoff would reach time.sleep() in the controller and crash it (ValueError there);
    # CONVENTIONS 3: refuse it at construction, naming the field.
    with pytest.raises(ValueError, match=field):
        FailurePolicy(**kwargs)


def test_failure_policy_is_a_frozen_keyword_only_value():
    p = FailurePolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_failures = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        FailurePolicy(3)  # type: ignore[misc]


def test_failure_log_accumulates_history():
    log = FailureLog()
    s1 = log.add(rec(1, "a"))
    s2 = log.add(rec(2, "b"))
    assert s1.history == (rec(1, "a"),)
    assert [r.message for r in s2.history] == ["a", "b"]


# --- ScalingPolicy ------------------------------------------------------------------------


def scal(current=0, requested=4, available=8, valid=VALID):
    return ScalingStatus(current=current, requested=requested, available=available, valid_sizes=valid)


@pytest.mark.parametrize("requested, available, expected", [
    (4, 8, 4),
    (5, 8, 4),  # 5 is not a valid size: the largest valid one below it
    (6, 8, 6),
    (8, 8, 6),  # above every valid size
    (6, 5, 4),  # capacity limits, 5 invalid
    (6, 3, 3),
    (2, 1, 1),
])
def test_target_is_the_largest_valid_size_within_request_and_capacity(requested, available, expected):
    p = ScalingPolicy(min_workers=1, max_workers=8)
    assert p.target(scal(requested=requested, available=available)) == expected


def test_target_respects_min_and_max():
    assert ScalingPolicy(min_workers=1, max_workers=3).target(scal(requested=6, available=8)) == 3
    assert ScalingPolicy(min_workers=2, max_workers=8).target(scal(requested=4, available=1)) is None
    assert ScalingPolicy(min_workers=5, max_workers=5).target(scal(requested=5, available=8)) is None
    assert ScalingPolicy(min_workers=2, max_workers=8).allowed(VALID) == [2, 3, 4, 6]


def test_wait_when_nothing_fits_lists_valid_sizes():
    d = ScalingPolicy(min_workers=2, max_workers=8).decide(scal(current=0, requested=4, available=1), now=5.0)
    assert isinstance(d, Wait)
    assert "1 workers available" in d.reason
    assert "smallest allowed size is 2" in d.reason
    assert "valid sizes: [1, 2, 3, 4, 6]" in d.reason
    assert "min 2, max 8" in d.reason


def test_wait_when_no_valid_size_is_allowed_at_all():
    d = ScalingPolicy(min_workers=5, max_workers=5).decide(scal(requested=5, available=8), now=0.0)
    assert isinstance(d, Wait)
    assert "smallest allowed size is none" in d.reason


def test_resize_grow():
    d = ScalingPolicy(min_workers=1, max_workers=8).decide(scal(current=2, requested=4, available=4), now=0.0)
    assert d == Resize(4, "growing 2 -> 4 workers (requested 4, 4 available)")


def test_resize_grow_as_far_as_capacity_allows():
    d = ScalingPolicy(min_workers=1, max_workers=8).decide(scal(current=2, requested=6, available=5), now=0.0)
    assert isinstance(d, Resize) and d.workers == 4
    assert d.reason.startswith("growing 2 -> 4")


def test_resize_shrink():
    d = ScalingPolicy(min_workers=1, max_workers=8).decide(scal(current=6, requested=2, available=6), now=0.0)
    assert d == Resize(2, "shrinking 6 -> 2 workers (requested 2, 6 available)")


def test_shrink_to_a_valid_size_when_capacity_is_lost():
    d = ScalingPolicy(min_workers=1, max_workers=8).decide(scal(current=6, requested=6, available=5), now=0.0)
    assert isinstance(d, Resize) and d.workers == 4
    assert d.reason.startswith("shrinking 6 -> 4")


def test_continue_when_at_target():
    p = ScalingPolicy(min_workers=1, max_workers=8)
    assert p.decide(scal(current=4, requested=4, available=4), now=0.0) == Continue("running at 4 workers")
    # Requesting an invalid 5 with room for it: 4 is already the best valid size.
    assert isinstance(p.decide(scal(current=4, requested=5, available=8), now=0.0), Continue)


@pytest.mark.parametrize("lo, hi", [(0, 4), (3, 2), (-1, 1)])
def test_invalid_min_max_raises(lo, hi):
    with pytest.raises(ValueError, match="min_workers"):
        ScalingPolicy(min_workers=lo, max_workers=hi)
