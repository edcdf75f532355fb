"""Chaos plans and the oracle's pure logic (the live faults: tests/orchestrator/test_chaos.py)."""

import os

import pytest

from checkpointing.errors import ConfigError
from orchestrator.chaos import netns
from orchestrator.chaos.injector import Injection
from orchestrator.chaos.oracle import oracle, stale_commits
from orchestrator.chaos.plan import load_plan
from orchestrator.chaos.report import assess, format_report, report


def test_example_plan_loads():
    plan = load_plan("examples/chaos.toml")
    assert [f.kind for f in plan.faults] == ["kill_worker", "hang_rank", "kill_worker", "storage"]
    assert plan.faults[2].after_fault == 1 and plan.seed == 1


def test_partition_node_plans_load_with_their_own_default_window():
    plan = load_plan(None, ["kind=partition_node,at_step=5,rank=1", "kind=partition_node,every_s=60,duration_s=8",
                            "kind=storage,at_step=1,delay_s=0.1"])
    assert [f.duration_s for f in plan.faults] == [20.0, 8.0, 10.0]
    assert plan.faults[0].rank == 1


@pytest.mark.parametrize("flag, message", [
    ("kind=net_partition,at_step=1", 'a network partition is kind="partition_node"'),
    ("kind=partition,at_step=1", 'a network partition is kind="partition_node"'),
    ("kind=partition_node,at_step=1,duration_s=0", "duration_s=0 must be > 0"),
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


def test_a_partition_row_reports_detection_recovery_the_cut_and_when_ray_gave_the_node_up():
    target = {"rank": 0, "pid": 7, "node": "n1", "netns": "etr-n1", "link": "etr-n1-h", "node_dead_after_s": 4.1}
    inj = Injection(0, "partition_node", 10.0, 5, target, ended=30.0, committed=4)
    events = [{"kind": "failure", "time": 15.0}, {"kind": "formed", "time": 20.0, "pids": [8, 9]},
              {"kind": "recovered", "time": 21.0, "first_step_unix": 21.5, "steps_lost": 1, "restored_step": 4}]
    (r,) = assess([inj], events, rows(range(1, 6)))
    assert r["detected"] and r["recovered"] and r["time_to_detect_s"] == pytest.approx(5.0)
    assert r["partition_s"] == pytest.approx(20.0) and r["node_dead_after_s"] == 4.1
    text = format_report(report("run", load_plan(None, ["kind=partition_node,at_step=5"]), [r],
                                {"phase": "FINISHED", "step": 5}, [], None, None))
    assert "link etr-n1-h (etr-n1) cut for 20.00 s, node declared dead after 4.10 s" in text and "PASS" in text
    assert "p50 5.00 s" in text  # a partition counts in time to detect, as the faults that take a member do


def test_partition_of_a_node_without_a_namespace_says_why_and_what_to_do():
    """This process's node shares this machine's network: nothing to cut, and the error says how to set one up."""
    with pytest.raises(netns.NetnsError) as e:
        netns.node_link(os.getpid(), "127.0.0.1")
    assert "has no link of its own to cut" in str(e.value) and "python -m orchestrator.chaos.netns node" in str(e.value)
    with pytest.raises(netns.NetnsError, match="no process .* on this machine"):
        netns.node_link(2**22 + 12345, "10.213.0.11")


def test_stale_commits_name_a_checkpoint_an_old_epoch_committed_after_a_newer_one_formed(tmp_path):
    from checkpointing.manifest import FileEntry, Manifest
    from checkpointing.storage.base import Storage

    url = f"file://{tmp_path}"
    storage = Storage(url)
    for step, epoch, created in [(4, 1, 100.0), (8, 1, 130.0), (12, 2, 140.0)]:
        m = Manifest(run_id="r", step=step, epoch=epoch, world_size=2, layout={}, config_hash="h", trainer_state={},
                     files=[FileEntry("__0_0.distcp", 1, "00000000"), FileEntry(".metadata", 1, "00000000")],
                     created_unix=created)
        storage.put(f"r/checkpoints/step_{step:09d}/MANIFEST.json", m.to_json())
    formed = [{"kind": "formed", "epoch": 1, "time": 50.0}, {"kind": "formed", "epoch": 2, "time": 120.0}]
    (reason,) = stale_commits(url, "r", formed)
    assert reason.startswith("checkpoint step 8 was committed by epoch 1 10.00 s after a newer epoch formed")
    assert stale_commits(url, "r", formed[:1]) == []
