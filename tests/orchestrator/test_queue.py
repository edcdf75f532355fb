"""The queue: gang admission (QUEUED, queued/admitted events, queue_timeout_s), requeue, `etrain queue`.

The listing and the ordering are pure logic (a fake group, no Ray); the
admission and the requeue run on the session's real Ray cluster (three
1-CPU nodes, tests/conftest.py) with the tiny model, under the Ray lock.
"""

from __future__ import annotations

import json
import time

import pytest

from orchestrator.cli.main import main as etrain
from orchestrator.service.queueing import queue_rows
from tests.cluster import start_run
from tests.orchestrator.test_controller import RUN, Rig


def test_etrain_queue_json_lists_a_queued_run_and_why_it_waits(tmp_path, capsys):
    r = Rig(tmp_path, workers=3, min_workers=2, max_workers=3, capacity=1)
    try:
        r.store.update_spec(RUN, config={**r.spec.config, "elastic": {"priority": 7, "team": "nlp"}})
        r.ctl.spec = r.store.get_spec(RUN)
        for _ in range(20):
            r.step()
        r.ctl.publish()
        capsys.readouterr()
        assert etrain(["queue", "--json", "--store", f"file://{tmp_path}/runs"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert row["run_id"] == RUN and row["phase"] == "QUEUED"
        assert (row["priority"], row["team"], row["min_workers"], row["max_workers"]) == (7, "nlp", 2, 3)
        assert row["allocated"] == 0 and row["target"] == 0 and row["waiting_s"] >= 0
        assert "2 workers (min_workers) reserved together" in row["waits_for"]
        r.group.add_capacity(2)
        r.drive(lambda r: r.ctl.state.name == "RUNNING")
        r.ctl.publish()
        assert etrain(["queue", "--store", f"file://{tmp_path}/runs"]) == 0
        out = capsys.readouterr().out
        assert "RUNNING" in out and "nlp" in out and "2..3" in out and "waits for" not in out
    finally:
        r.close()


def test_queue_rows_keep_queued_and_admitted_runs_highest_priority_first():
    now = time.time()
    statuses = [
        {"run_id": "done", "phase": "FINISHED", "priority": 99},
        {"run_id": "low", "phase": "RUNNING", "priority": 0, "world_size": 2, "queue_wait_s": 3.0},
        {"run_id": "wait", "phase": "QUEUED", "priority": 5, "queued_unix": now - 30, "min_workers": 2,
         "queue_reason": "starting"},
        {"run_id": "held", "phase": "QUEUED", "priority": 5, "queued_unix": now - 60, "requeue": True},
        {"run_id": "top", "phase": "RESIZING", "priority": 5, "world_size": 3, "target": 3},
    ]
    rows = queue_rows(statuses, now)
    assert [r["run_id"] for r in rows] == ["top", "held", "wait", "low"]
    assert rows[1]["waiting_s"] == pytest.approx(60, abs=1) and "allocator" in rows[1]["waits_for"]
    assert rows[3]["waiting_s"] == 3.0 and rows[3]["waits_for"] is None and rows[3]["allocated"] == 2
    assert rows[0]["target"] == 3


# --- on Ray ------------------------------------------------------------------------------------


def kinds(store, run_id) -> list[str]:
    return [e["kind"] for e in store.events(run_id)]


@pytest.mark.ray
def test_a_run_that_cannot_get_its_gang_is_queued_until_the_first_finishes(ray_cluster, tmp_path):
    root = f"file://{tmp_path}/runs"
    first, store = start_run(root, "train.steps=25", workers=2)
    first.wait(lambda s: s["phase"] == "RUNNING", what="the first run RUNNING")
    second, _ = start_run(root, "train.steps=10", workers=2, min_workers=2)
    second.wait(lambda s: s["phase"] == "QUEUED", what="the second run QUEUED")
    assert first.snapshot()["world_size"] == 2  # one CPU left: the second's gang of 2 does not fit
    assert first.join()["phase"] == "FINISHED"
    final = second.join()
    assert final["phase"] == "FINISHED" and final["step"] == 10
    ks = kinds(store, second.spec.run_id)
    assert ks.index("queued") < ks.index("admitted") < ks.index("formed")
    admitted = next(e for e in store.events(second.spec.run_id) if e["kind"] == "admitted")
    assert admitted["wait_s"] > 0 and final["queue_wait_s"] >= admitted["wait_s"] - 0.01
    assert "queued" not in kinds(store, first.spec.run_id)  # admitted at once: never QUEUED


@pytest.mark.ray
def test_the_queue_timeout_fails_a_run_that_cannot_be_admitted(ray_cluster, tmp_path):
    from ray.util.state import list_placement_groups

    root = f"file://{tmp_path}/runs"
    run, _ = start_run(root, "elastic.queue_timeout_s=5", workers=4, min_workers=4)  # 3 CPUs in the cluster
    final = run.join()
    assert final["phase"] == "FAILED" and "elastic.queue_timeout_s=5" in final["reason"], final
    pgs = [p for p in list_placement_groups() if p.name.startswith(f"etrain-{run.spec.run_id}")
           and p.state != "REMOVED"]
    assert pgs == []  # the gang given back


@pytest.mark.ray
def test_requeue_commits_gives_back_and_continues_to_the_reference_losses(ray_cluster, tmp_path, reference):
    root = f"file://{tmp_path}/runs"
    run, store = start_run(root, workers=2)
    rid = run.spec.run_id
    run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 6, what="step 6")
    spec = store.get_spec(rid)
    asked = time.time()
    store.update_spec(rid, expected=spec.generation, requeue=True)  # as the allocator writes it (CAS)
    run.wait(lambda s: s["phase"] == "QUEUED", what="QUEUED after the requeue")
    pre = run.wait_event("preempted")
    assert pre["action"] == "suspend" and pre["checkpoint_committed"] is True
    assert run.snapshot()["world_size"] == 0
    spec = store.get_spec(rid)
    cleared = time.time()
    store.update_spec(rid, expected=spec.generation, requeue=False)
    final = run.join()
    events = store.events(rid)
    back = next(e for e in events if e["kind"] == "formed" and e["time"] > cleared)
    print(f"requeue: given back {pre['time'] - asked:.2f} s after the request; formed again "
          f"{back['time'] - cleared:.2f} s after it was cleared")
    assert final["phase"] == "FINISHED" and final["failures"] == 0 and final["steps_lost"] == 0, final
    # The group formed on re-admission restores the committed step (a growth after it, where the first form
    # found fewer workers free, re-forms from that group's own state).
    assert back["restored_from"] == pre["step"] and "admitted" in kinds(store, rid)
    losses = {row.step: row.loss for row in store.get_history(rid)}  # a step trained again: the later one
    ref = {row.step: row.loss for row in reference["history"]}
    assert sorted(losses) == sorted(ref)
    assert [losses[s] for s in sorted(ref)] == pytest.approx([ref[s] for s in sorted(ref)], rel=1e-5)


def test_a_users_resize_clears_the_allocators_target_in_one_write(tmp_path, capsys):
    r = Rig(tmp_path, workers=1, min_workers=1, max_workers=3, steps=400)
    try:
        r.drive_to_step(3)
        r.ctl.publish()
        r.store.update_spec(RUN, expected=r.ctl.spec.generation, target=3)
        generation = r.store.get_spec(RUN).generation
        assert etrain(["resize", RUN, "--workers", "2", "--store", f"file://{tmp_path}/runs"]) == 0
        spec = r.store.get_spec(RUN)
        assert (spec.workers, spec.target, spec.generation) == (2, 0, generation + 1)
        r.drive(lambda r: len(r.ctl.members) == 2 and r.ctl.state.name == "RUNNING")
    finally:
        r.close()


def test_the_metrics_show_the_queued_phase_and_the_queue_wait():
    from trainer.observe.metrics import RunMetrics

    m = RunMetrics("q")
    m.observe_run(world_size=0, epoch=0, phase="QUEUED", goodput=0.0, queue_wait_s=12.5)
    families = {f.name: f for f in m.collect()}
    phase = {s.labels["phase"]: s.value for s in families["etrain_phase"].samples}
    assert phase["QUEUED"] == 1 and phase["RUNNING"] == 0
    assert families["etrain_queue_wait_seconds"].samples[0].value == 12.5
