"""Runs sharing a cluster through the allocator, on a real Ray cluster on 127.0.0.1 (the session's: three
1-CPU worker nodes): docs/service.md.

Run A (priority 0, min 1, max 3) grows into the idle cluster; run B (priority 10, 2 workers) arrives and
waits QUEUED: the allocator shrinks A to its minimum (from memory, no step lost) and B is admitted; the
allocator is killed meanwhile and Ray restarts it; when B finishes, the restarted allocator (its state
read back from the store) grows A back. Both pass the chaos oracle against their failure-free references
(every step once, every sample once, the same loss at every step).
"""

from __future__ import annotations

import time

import pytest

from orchestrator.chaos.oracle import oracle
from tests.cluster import GLOBAL_BATCH, STEPS, start_run

pytestmark = pytest.mark.ray

A_STEPS = 150


def resizes(run) -> list[tuple[int, int]]:
    return [(e["from_workers"], e["to_workers"]) for e in run.events("resized")]


def passes(final: dict, history: list, ref: dict, steps: int) -> None:
    reasons = oracle({"status": final, "history": history}, ref, total_steps=steps, global_batch=GLOBAL_BATCH,
                     rtol=1e-4, atol=0.0, verify_problems={}, final_cursor=None)
    assert not reasons, reasons


def test_a_higher_priority_run_takes_what_idle_capacity_lent_and_gives_it_back(ray_cluster, reference, tmp_path):
    import ray

    from orchestrator.scheduling.allocator import ALLOCATOR_NAME, NAMESPACE

    root = f"file://{tmp_path}/runs"
    a, store = start_run(root, f"train.steps={A_STEPS}", workers=1, min_workers=1, max_workers=3, run_id="svc-a")
    a.wait(lambda s: s["phase"] == "RUNNING" and s["world_size"] == 3, what="A grown into the idle cluster",
           timeout=120)
    assert (1, 3) in resizes(a) or (1, 2) in resizes(a)
    grown = [e for e in a.events("allocated") if e["action"] == "grow"]
    assert grown and grown[0]["cause"] == "idle"

    b, _ = start_run(root, "elastic.priority=10", workers=2, min_workers=2, max_workers=2, run_id="svc-b")
    pre = a.wait_event("preempted", timeout=120)
    assert (pre["action"], pre["cause"], pre["workers"]) == ("shrink", "preempted", 1) and "svc-b" in pre["reason"]
    b.wait_event("admitted", timeout=120)
    a.wait(lambda s: s["world_size"] == 1, what="A at its minimum")

    before = ray.get_actor(ALLOCATOR_NAME, namespace=NAMESPACE)
    ray.kill(before, no_restart=False)  # Ray restarts it; it reads its registry back from the store

    final_b = b.join(300)
    deadline = time.monotonic() + 120
    while resizes(a)[-1] != (1, 3) and a.thread.is_alive():  # the restarted allocator gives A the room back
        assert time.monotonic() < deadline, f"A did not grow back after B ended: {resizes(a)}"
        time.sleep(0.5)
    final_a = a.join(600)
    assert resizes(a)[-1] == (1, 3), resizes(a)
    assert final_a["steps_lost"] == 0 and final_a["recoveries"] == 0, final_a
    assert not [e for e in a.events("allocated") if e["action"] == "suspend"], "A was suspended, not shrunk"

    # B is the session's reference run (RUN_BASE at 2 workers): the same losses step for step.
    passes(final_b, store.get_history("svc-b"), reference, STEPS)
    # A against a failure-free run of its own config at 2 workers (other sizes reduce in another order).
    ref_run, ref_store = start_run(f"file://{tmp_path}/ref", f"train.steps={A_STEPS}", workers=2, run_id="svc-a-ref")
    ref_final = ref_run.join(600)
    passes(final_a, store.get_history("svc-a"), {"status": ref_final, "history": ref_store.get_history("svc-a-ref")},
           A_STEPS)
