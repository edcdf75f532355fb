"""The memory tier under the orchestrator, on the real Ray cluster of tests/conftest.py: recoveries and
resizes restore from peers' host memory, lose at most the step in flight, and end bitwise where a
run that never failed (or resized through storage) ends.

Final states are read with stock DCP (``dcp_to_torch_save``), an independent reader, and compared
tensor by tensor with ``torch.equal``.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from checkpointing.manager import CheckpointManager
from orchestrator.driver.progress import describe_event
from tests.cluster import GLOBAL_BATCH, RUN_BASE, STEPS, start_run
from tests.harness import wait_for

pytestmark = pytest.mark.ray


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster


def state_at(root: str, run_id: str, step: int, tmp_path) -> dict:
    """Every tensor of the committed checkpoint ``step`` of ``run_id``, read by stock DCP."""
    out = tmp_path / f"{run_id}-{step}.pt"
    dcp_to_torch_save(f"{root[len('file://'):]}/{run_id}/checkpoints/step_{step:09d}", str(out))
    return flat(torch.load(out, weights_only=True))


def flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert len(tensors) > 20  # the model and its optimizer state
    differ = [k for k in tensors if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"
    assert {k: a[k] for k in a if k not in tensors} == {k: b[k] for k in b if k not in tensors}


def test_killed_worker_restores_from_memory_and_ends_bitwise_as_the_failure_free_run(cluster, tmp_path,
                                                                                     reference):
    root = f"file://{tmp_path}/runs"
    run, store = start_run(root, "elastic.standby=1", "checkpoint.interval_steps=8")
    # Between two commits (8 and 16), so that the durable checkpoint alone would lose steps.
    before = run.wait(lambda s: s["phase"] == "RUNNING" and 11 <= s["step"], what="step 11")
    assert before["step"] < 16, "the run passed the next commit before the kill; the test cannot tell tiers apart"
    # Rank 0: it reports the steps; the step it trained last may die with it, unreported, and must
    # still be in the run's history (the snapshot carries it).
    victim, survivor = run.events("formed")[0]["pids"]
    os.kill(victim, signal.SIGKILL)
    rec = run.wait_event("recovered")
    final = run.join()
    assert final["phase"] == "FINISHED" and final["step"] == STEPS
    assert rec["tier"] == "memory", rec
    assert rec["steps_lost"] <= 1
    # The default budget, derived from the host's available memory, holds the tiny model's snapshots.
    budget = next(e for e in store.events(run.spec.run_id) if e["kind"] == "formed")["memory_tier"]
    assert budget["budget"] == "derived" and budget["min_budget_bytes"] > 0, budget
    assert not [e for e in store.events(run.spec.run_id) if e["kind"] == "memory_tier"]
    assert rec["restored_step"] > 8  # newer than the newest commit: the memory tier's step, not storage's
    assert [e for e in store.events(run.spec.run_id) if e["kind"] == "formed"][1]["pids"][0] == survivor
    # No sample skipped or repeated: the data cursor, and every step's loss, as in the failure-free run.
    losses = {row[0]: row[1] for row in store.get_history(run.spec.run_id)}
    ref_losses = {row[0]: row[1] for row in reference["history"]}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses == ref_losses, "the loss trajectory differs from the failure-free run's"
    assert_bitwise_equal(state_at(root, run.spec.run_id, STEPS, tmp_path),
                         state_at(reference["root"], "reference", STEPS, tmp_path))
    mgr = CheckpointManager(root, run.spec.run_id)
    assert mgr.read_manifest(STEPS).trainer_state["samples_consumed"] == STEPS * GLOBAL_BATCH


def test_a_rank_lost_with_its_replica_holder_falls_back_to_the_durable_checkpoint(cluster, tmp_path, reference):
    # At 2 workers with one replica each holds the other's copy: losing both loses every copy.
    root = f"file://{tmp_path}/runs"
    run, _ = start_run(root, "elastic.standby=1")
    run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 10 and s["latest_checkpoint"], what="step 10")
    for pid in run.events("formed")[0]["pids"]:
        os.kill(pid, signal.SIGKILL)
    rec = run.wait_event("recovered")
    final = run.join()
    assert final["phase"] == "FINISHED" and final["step"] == STEPS
    assert rec["tier"] == "durable" and "memory" in rec["tier_reason"], rec
    assert rec["restored_step"] % 4 == 0  # a commit (checkpoint.interval_steps=4)
    # The one standby re-forms the group alone, which grows back later: other world sizes reduce in
    # another order, equal up to float rounding.
    assert final["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    mgr = CheckpointManager(root, run.spec.run_id)
    assert mgr.read_manifest(STEPS).trainer_state["samples_consumed"] == STEPS * GLOBAL_BATCH


def test_a_tier_over_its_budget_turns_itself_off_and_recovery_uses_storage(cluster, tmp_path):
    root = f"file://{tmp_path}/runs"
    run, store = start_run(root, "elastic.standby=1", "recovery.memory_budget_bytes=100000")  # under one snapshot
    run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 6 and s["latest_checkpoint"], what="step 6")
    # The turn-off is in the run's events, its status and etrain run's lines, not only in the workers' logs.
    off = run.wait_event("memory_tier")
    assert off["action"] == "off" and off["budget_bytes"] == 100000 and off["bytes"] > 100000, off
    assert off["rank"] in (0, 1) and "memory_budget_bytes=100000" in off["reason"]
    assert describe_event(off).startswith(f"[memory tier] off at step {off['step']}: rank {off['rank']} would hold ")
    status = run.wait(lambda s: (s.get("memory_tier") or {}).get("state") == "off", what="the status says off")
    assert status["memory_tier"]["since_step"] == off["step"]
    os.kill(run.events("formed")[0]["pids"][1], signal.SIGKILL)
    rec = run.wait_event("recovered")
    final = run.join()
    assert final["phase"] == "FINISHED" and final["step"] == STEPS
    assert rec["tier"] == "durable" and rec["tier_reason"] == "no worker holds a snapshot in memory", rec
    events = [e for e in store.events(run.spec.run_id) if e["kind"] == "memory_tier"]
    fallback = next(e for e in events if e["action"] == "fallback")
    assert fallback["step"] == rec["restored_step"] and fallback["reason"] == rec["tier_reason"]
    assert final["memory_tier"]["fallbacks"] >= 1
    formed = [e for e in store.events(run.spec.run_id) if e["kind"] == "formed"]
    assert formed[0]["memory_tier"]["budget"] == "explicit" and formed[0]["memory_tier"]["min_budget_bytes"] == 100000


def _resize_2_3_2(root: str, run_id: str, through_memory: bool) -> list[dict]:
    """Drive three workers by hand: 6 steps at 2, 6 at 3, 6 at 2, each resize through the memory tier or
    a durable save; the restores' results. The final step is saved (to compare)."""
    from dataclasses import asdict

    import ray

    from orchestrator.workers.tier_plan import group_restore_plan
    from orchestrator.workers.group import RayWorkerGroup
    from trainer.config.load import load_config

    cfg = load_config("examples/tiny.toml", [*RUN_BASE, f'checkpoint.url="{root}"', f'run_id="{run_id}"'])
    group = RayWorkerGroup(cfg, run_id, "")
    wids = group.start(3)
    from orchestrator.config import GroupTier, RecoveryConfig

    recovery = GroupTier(RecoveryConfig(memory_every_steps=1, replicas=1, memory_budget_bytes=0))
    restores, epoch = [], 0

    def call(members, method, *args):
        return ray.get([group.submit(w, method, *args).ref for w in members], timeout=300)

    try:
        wait_for(lambda: len(group.ready(wids, timeout=1.0)) == 3, "three workers", timeout=180)
        for size, until in ((2, 6), (3, 12), (2, 18)):
            members = wids[:size]
            plan = None
            if epoch and through_memory:
                plan, why = group_restore_plan(group, wids)
                assert plan is not None, why
            epoch += 1
            port = call(members[:1], "rendezvous_port")[0]
            # As the controller forms a group: the plan with the form (a member new to the step asks for it),
            # each member restoring as soon as it formed.
            formed = ray.get([group.submit(w, "form", epoch, r, size, "127.0.0.1", port,
                                           recovery if through_memory else None, "", plan, True).ref
                              for r, w in enumerate(members)], timeout=300)
            restores.append(asdict(formed[0].restored))  # a worker_results.Restored
            assert {r.status for r in call(members, "train", until)} == {"done"}
            if until == 18:
                assert call(members, "save")[0]["status"] == "committed"
            elif through_memory:
                assert all(r["step"] == until for r in call(members, "memory_flush"))
            else:
                assert call(members, "save")[0]["status"] == "committed"
        return restores
    finally:
        group.shutdown()


def test_resize_2_3_2_from_memory_is_bitwise_the_resize_through_storage(cluster, tmp_path):
    root = f"file://{tmp_path}/runs"
    stored = _resize_2_3_2(root, "through-storage", through_memory=False)
    memory = _resize_2_3_2(root, "through-memory", through_memory=True)
    assert [r["tier"] for r in stored] == ["none", "durable", "durable"]
    assert [r["tier"] for r in memory] == ["none", "memory", "memory"]
    assert [r["step"] for r in memory] == [0, 6, 12] == [r["step"] for r in stored]
    assert_bitwise_equal(state_at(root, "through-memory", 18, tmp_path),
                         state_at(root, "through-storage", 18, tmp_path))


def _two_workers(root: str, run_id: str, flush_first: bool) -> list[dict]:
    """Two workers driven by hand train 6 steps and save the last. With ``flush_first``, their first group
    flushes step 0 to memory before any step (a resize right after the start) and a second group restores
    it and trains. The restores' results."""
    from dataclasses import asdict

    import ray

    from orchestrator.config import GroupTier, RecoveryConfig
    from orchestrator.workers.tier_plan import group_restore_plan
    from orchestrator.workers.group import RayWorkerGroup
    from trainer.config.load import load_config

    cfg = load_config("examples/tiny.toml", [*RUN_BASE, f'checkpoint.url="{root}"', f'run_id="{run_id}"'])
    group = RayWorkerGroup(cfg, run_id, "")
    wids = group.start(2)
    recovery = GroupTier(RecoveryConfig(memory_every_steps=1, replicas=1, memory_budget_bytes=0))

    def call(method, *args):
        return ray.get([group.submit(w, method, *args).ref for w in wids], timeout=300)

    def form(epoch):
        port = call("rendezvous_port")[0]
        ray.get([group.submit(w, "form", epoch, r, 2, "127.0.0.1", port, recovery).ref
                 for r, w in enumerate(wids)], timeout=300)

    try:
        wait_for(lambda: len(group.ready(wids, timeout=1.0)) == 2, "two workers", timeout=180)
        form(1)
        restores = [asdict(call("restore", None)[0])]
        if flush_first:
            assert [r["step"] for r in call("memory_flush")] == [0, 0]
            plan, why = group_restore_plan(group, wids)
            assert plan is not None and plan.step == 0, why
            form(2)
            restores.append(asdict(call("restore", plan)[0]))
        assert {r.status for r in call("train", 6)} == {"done"}
        assert call("save")[0]["status"] == "committed"
        return restores
    finally:
        group.shutdown()


def test_a_flush_before_the_first_step_holds_the_drawn_weights(cluster, tmp_path):
    """A group builds its model without drawing the initial weights (a restore follows, which loads over
    them); a flush to memory before the first step must hold the drawn weights, not the undrawn zeros,
    and the run restored from it ends bitwise where one that never re-formed ends."""
    root = f"file://{tmp_path}/runs"
    plain = _two_workers(root, "plain", flush_first=False)
    flushed = _two_workers(root, "flushed", flush_first=True)
    assert [r["tier"] for r in plain] == ["none"] and [r["tier"] for r in flushed] == ["none", "memory"]
    assert_bitwise_equal(state_at(root, "flushed", 6, tmp_path), state_at(root, "plain", 6, tmp_path))
