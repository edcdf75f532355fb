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
    ("kind=bitflip,every_s=5", "every_s is no schedule for a fault inside the trainer"),
    ("kind=poison_batch,random=true", "random is no schedule for a fault inside the trainer"),
    ("kind=poison_batch,at_step=30,rank=1", "a poisoned batch is the data's, every rank trains on it"),
    ('kind=bitflip,at_step=3,target="weights"', "target='weights'; use one of param, grad, optimizer, activation"),
    ("kind=bitflip,at_step=3,bit=64", "bit=64 must be a bit of the element"),
    ("kind=bitflip,at_step=3,rank=-1", "rank=-1 must be >= 0"),
    ("kind=kill_worker,at_step=3,persistent=true", "target, bit and persistent are bitflip's fields"),
])
def test_bad_plans_name_the_field(flag, message):
    with pytest.raises(ConfigError) as e:
        load_plan(None, [flag])
    assert message in str(e.value)


def test_silent_fault_plans_load_with_their_defaults_and_give_the_trainer_valid_entries():
    from trainer.config.health import check_fault

    plan = load_plan(None, ["kind=bitflip,at_step=20", 'kind=bitflip,after_fault=0,target="optimizer",bit=3,'
                            "persistent=true,rank=1", "kind=poison_batch,at_step=30"])
    flip, stuck, poison = plan.faults
    assert (flip.target, flip.bit, flip.persistent, flip.rank) == ("param", None, False, None)
    assert (stuck.target, stuck.bit, stuck.persistent, stuck.rank) == ("optimizer", 3, True, 1)
    entries = [f.health_fault(25, seed=7) for f in plan.faults]
    assert entries == [{"kind": "bitflip", "step": 25, "target": "param", "persistent": False, "seed": 7},
                       {"kind": "bitflip", "step": 25, "target": "optimizer", "persistent": True, "seed": 7, "bit": 3},
                       {"kind": "poison_batch", "step": 25}]
    for i, e in enumerate(entries):
        check_fault(e, f"entry {i}")  # what the worker's trainer checks them with


class FakeController:
    """The run's controller actor as the injector calls it (``ray.get`` patched to return what it is given)."""

    def __init__(self, world: int, step: int):
        self.world, self.step, self.calls = world, step, []
        me = self

        class Method:
            def __init__(self, fn):
                self.remote = fn

        self.snapshot = Method(lambda: {"world_size": me.world, "step": me.step})
        self.set_health_faults = Method(lambda faults, rank: me.calls.append((rank, faults)) or f"w{rank}")


def test_silent_faults_are_handed_to_the_ranks_workers_ahead_of_the_runs_step(monkeypatch):
    import ray

    from orchestrator.chaos.injector import Chaos

    monkeypatch.setattr(ray, "get", lambda x, timeout=None: x)
    plan = load_plan(None, ["kind=bitflip,at_step=5,rank=1,bit=30", "kind=poison_batch,at_step=9",
                            "kind=bitflip,at_step=9"])
    chaos = Chaos("r", None, plan)
    ctl = FakeController(world=2, step=10)
    monkeypatch.setattr(chaos, "_controller", lambda: ctl)
    chaos.step_marks = [(100.0, 2), (102.0, 10)]  # 4 steps a second: 2 more steps of lead
    assert chaos.lead() == 4
    flip = chaos.inject(0, plan.faults[0])
    assert flip.error is None and flip.target == {"rank": 1, "worker": "w1", "fires_at_step": 14, "target": "param",
                                                  "persistent": False, "seed": 0, "bit": 30}
    assert ctl.calls == [(1, [{"kind": "bitflip", "step": 14, "target": "param", "persistent": False, "seed": 0,
                               "bit": 30}])]
    ctl.calls.clear()
    poison = chaos.inject(1, plan.faults[1])
    assert poison.target == {"fires_at_step": 14, "ranks": 2, "workers": ["w0", "w1"]}
    # every rank gets it; rank 1's worker keeps its bitflip (a worker's faults are replaced whole)
    assert [r for r, _ in ctl.calls] == [0, 1, 1]
    assert [f["kind"] for f in ctl.calls[-1][1]] == ["bitflip", "poison_batch"]
    ctl.world = 1
    assert chaos.inject(2, plan.faults[2]).target["rank"] == 0  # a random rank of the group now
    bad = chaos.inject(0, load_plan(None, ["kind=bitflip,at_step=1,rank=3"]).faults[0])
    assert bad.error == "RuntimeError: rank 3 is not in the group (world size 1)"


def test_a_silent_fault_is_detected_by_its_sdc_event_and_recovered_by_its_rollback():
    flip = Injection(0, "bitflip", 100.0, 10, {"rank": 1, "fires_at_step": 14, "target": "param",
                                               "persistent": False})
    poison = Injection(1, "poison_batch", 110.0, 30, {"fires_at_step": 34, "ranks": 2})
    events = [{"kind": "chaos_health", "time": 100.1},
              {"kind": "rollback", "time": 105.0, "step": 14, "from_step": 13, "to_step": 12, "seconds": 0.8,
               "steps_reworked": 2},
              {"kind": "sdc", "time": 105.0, "step": 14, "verdict": "transient", "rank": 1, "node": "h1",
               "target": "param"},
              {"kind": "rollback", "time": 120.0, "step": 34, "from_step": 33, "to_step": 32, "seconds": 1.5,
               "steps_reworked": 2},
              {"kind": "sdc", "time": 120.0, "step": 34, "verdict": "data", "rank": None, "samples": [132, 136]}]
    history = rows(range(1, 41), t0=90.0)  # step 13 ends at 103.0, step 33 at 123.0
    a, b = assess([flip, poison], events, history)
    assert a["detected"] and a["recovered"] and a["verdict"] == a["expected_verdict"] == "transient"
    assert a["time_to_detect_s"] == pytest.approx(1.2) and a["time_to_recover_s"] == 0.8 and a["steps_lost"] == 2
    assert a["steps_to_detect"] == 0 and a["sdc_rank"] == 1 and a["committed_steps_lost"] == 0
    assert b["verdict"] == "data" and b["samples"] == [132, 136] and b["recovered"]
    r = report("run", load_plan(None, ["kind=bitflip,at_step=10"]), [a, b], {"phase": "FINISHED", "step": 40}, [],
               None, None)
    assert r["passed"], r["reasons"]
    assert "fired at step 14, transient on rank 1 at step 14, rolled back to step 12" in format_report(r)
    events[2]["verdict"] = "data"  # a transient flip taken for the data's: the trainer misjudged it
    (a,) = assess([flip], events[:3], history)
    r = report("run", load_plan(None, ["kind=bitflip,at_step=10"]), [a], {"phase": "FINISHED", "step": 40}, [],
               None, None)
    assert r["reasons"] == ["fault 0 (bitflip) at step 14 was judged 'data', not 'transient'"]
    (a,) = assess([flip], [], history)
    assert not a["detected"] and "no sdc event after it" in format_report(report(
        "run", load_plan(None, ["kind=bitflip,at_step=10"]), [a], {"phase": "FINISHED", "step": 40}, [], None, None))


def test_the_oracle_accepts_a_listed_skip_and_compares_the_loss_before_it_unless_the_reference_skipped_it():
    from orchestrator.chaos.oracle import replayed_steps, skipped_ranges

    hist = rows(range(1, 6))
    hist[2][1] = 50.0  # step 3's batch was poisoned: its loss spiked, and it was skipped
    ref = {"status": {"phase": "FINISHED", "step": 5}, "history": rows(range(1, 6))}
    for row in ref["history"][2:]:
        row[1] *= 1.5  # the reference trained on step 3's batch: from there on its model is another one
    run = {"status": ref["status"], "history": hist}
    events = [{"kind": "sdc", "verdict": "data", "step": 3, "samples": [8, 12]}]
    skipped = skipped_ranges(events)
    kw = dict(total_steps=5, global_batch=4, rtol=1e-3, atol=0.0, verify_problems={5: []}, final_cursor=20,
              skipped=skipped, checkpoint_skipped=[[8, 12]])
    assert skipped == [[8, 12]]
    assert oracle(run, ref, **kw) == []  # the reference did not skip: only steps 1-2 compared ...
    early = {**ref, "history": [list(r) for r in ref["history"]]}
    early["history"][0][1] = 7.0
    assert "loss at step 1" in oracle(run, early, **kw)[0]  # ... and they are
    same = {**ref, "history": rows(range(1, 6))}
    same["history"][2][1] = float("nan")  # the reference skipped step 3 too (data.skip_ranges): its loss is nan
    assert oracle(run, same, **kw, ref_skipped=[[8, 12]]) == []
    same["history"][4][1] = 9.0
    assert "loss at step 5" in oracle(run, same, **kw, ref_skipped=[[8, 12]])[0]  # every other step compared
    assert "a resume from it would not train" in oracle(run, None, **{**kw, "checkpoint_skipped": []})[0]
    assert "are not whole steps" in oracle(run, None, **{**kw, "skipped": [[8, 10]], "checkpoint_skipped": None})[0]
    # a rollback from step 4 to 1 reported step 4 again, not steps 2-3: their rows are the first pass's
    rb = [{"kind": "rollback", "time": 200.0, "seconds": 1.0, "step": 4, "to_step": 1}]
    assert replayed_steps(rb, rows(range(1, 6))) == {2, 3}
    assert replayed_steps(rb, rows(range(1, 6)) + [[2, 0.5, 2, 8, 300.0, 0.1]]) == {3}  # step 2 trained again later


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
