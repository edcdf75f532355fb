"""Chaos plans and the oracle's pure logic (the live faults: tests/test_chaos.py)."""

import pytest

from checkpointing.errors import ConfigError
from orchestrator.chaos import Injection, assess, load_plan, oracle


def test_example_plan_loads():
    plan = load_plan("examples/chaos.toml")
    assert [f.kind for f in plan.faults] == ["kill_worker", "hang_rank", "kill_worker", "storage"]
    assert plan.faults[2].after_fault == 1 and plan.seed == 1


@pytest.mark.parametrize("flag, message", [
    ("kind=net_partition,at_step=1", "no link between them to cut"),
    ("kind=kill_worker", "needs exactly one schedule"),
    ("kind=kill_worker,at_step=1,every_s=5", "needs exactly one schedule"),
    ("kind=kill_worker,at_step=1,bogus=2", "unknown key(s) bogus"),
    ("kind=explode,at_step=1", "kind='explode' is unknown"),
    ("kind=storage,at_step=1", "set at least one of error_rate, truncate_rate, delay_s"),
    ("kind=kill_worker,after_fault=0", "must name an earlier fault"),
    ("kind=etcd_outage,at_step=1,mode=pause", 'mode=\'pause\'; use "stop"'),
    ("at_step=1", "kind is missing"),
])
def test_bad_plans_name_the_field(flag, message):
    with pytest.raises(ConfigError) as e:
        load_plan(None, [flag])
    assert message in str(e.value)


def rows(steps, gb=4, loss=1.0, t0=100.0):
    return [[s, loss / s, 2, s * gb, t0 + s, 0.1] for s in steps]


def test_oracle_catches_skipped_samples_missing_steps_and_loss_drift():
    ok = {"status": {"phase": "FINISHED", "step": 5}, "history": rows(range(1, 6))}
    kw = dict(total_steps=5, global_batch=4, rtol=1e-3, atol=0.0, verify_problems={5: []}, final_cursor=20)
    assert oracle(ok, ok, **kw) == []
    skipped = {"status": ok["status"], "history": rows(range(1, 6))}
    skipped["history"][2][3] += 4
    assert "a sample skipped or repeated" in oracle(skipped, None, **kw)[0]
    gap = {"status": ok["status"], "history": rows([1, 2, 4, 5])}
    assert "steps never trained: [3]" in oracle(gap, None, **kw)[0]
    assert oracle(gap, None, **kw, restored_up_to=3) == []  # a restore from step 3 proves it was trained
    drift = {"status": ok["status"], "history": rows(range(1, 6), loss=1.01)}
    assert "beyond rtol" in oracle(drift, ok, **kw)[0]
    assert "does not verify" in oracle(ok, None, **{**kw, "verify_problems": {4: ["bad crc"]}})[0]


def test_assess_matches_faults_to_failures_and_recoveries():
    inj = [Injection(0, "kill_worker", 10.0, 5, {"pid": 7}, committed=4)]
    events = [{"kind": "failure", "time": 10.3}, {"kind": "recovered", "time": 12.0, "first_step_unix": 12.5,
                                                   "steps_lost": 1, "restored_step": 4}]
    (r,) = assess(inj, events, rows(range(1, 6)))
    assert r["detected"] and r["recovered"] and r["committed_steps_lost"] == 0
    assert r["time_to_detect_s"] == pytest.approx(0.3) and r["time_to_recover_s"] == pytest.approx(2.5)
    (r,) = assess(inj, [], rows(range(1, 6)))
    assert not r["detected"] and not r["recovered"]


def test_a_storage_window_the_run_trained_through_counts_as_recovered():
    # slow storage from t=101.5 to t=200; the run's steps end at t=105, inside the window
    inj = Injection(0, "storage", 101.5, 1, {"workers": 2}, ended=200.0)
    (r,) = assess([inj], [], rows(range(1, 6)))
    assert r["detected"] and not r["recovered"]  # the run has not finished: no step after the window yet
    (r,) = assess([inj], [{"kind": "finished", "time": 106.0}], rows(range(1, 6)))
    assert r["recovered"] and r["steps_lost"] == 0 and "finished with the fault still on" in r["note"]
