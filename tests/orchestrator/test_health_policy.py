"""What a run does about a silent fault that follows one rank (orchestrator.controller.health.decide), as a
pure function: evict the rank at the largest valid size without it, or suspend at the verified step."""

from __future__ import annotations

from orchestrator.controller.health import Evict, StopRun, decide
from orchestrator.controller.run_policy import ScalingPolicy

FAULT = {"rank": 1, "host": "node-b", "step": 13, "verified_step": 8}
MEMBERS = ["w0", "w1", "w2", "w3"]


def _decide(on_persistent="evict", fault=FAULT, ready_others=3, valid=(1, 2, 3, 4), lo=1, hi=4):
    return decide(on_persistent, fault, members=MEMBERS, ready_others=ready_others,
                  scaling=ScalingPolicy(min_workers=lo, max_workers=hi), valid_sizes=valid)


def test_the_faulty_rank_leaves_and_a_standby_keeps_the_size():
    d = _decide(ready_others=4)  # three other members and a ready standby
    assert d == Evict(4, ("w1",), 1, d.reason)
    assert "rank 1 (node-b)" in d.reason and "4 -> 4 workers" in d.reason


def test_without_a_standby_the_group_shrinks_to_a_valid_size():
    d = _decide(valid=(1, 2, 4))  # 3 others, but 3 is not a valid size
    assert isinstance(d, Evict) and d.size == 2 and d.leaving == ("w1",)


def test_stop_suspends_at_the_verified_step():
    d = _decide("stop")
    assert isinstance(d, StopRun) and "verified step 8" in d.reason and 'on_persistent="stop"' in d.reason


def test_no_valid_size_without_the_rank_suspends_instead():
    d = _decide(ready_others=1, lo=2)
    assert isinstance(d, StopRun) and "no valid size without it" in d.reason


def test_a_rank_outside_the_group_is_not_evicted():
    assert isinstance(_decide(fault={**FAULT, "rank": 7}), StopRun)
    assert isinstance(_decide(fault={**FAULT, "rank": None}), StopRun)
