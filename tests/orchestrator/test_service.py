"""Runs sharing a cluster through the allocator, on a real Ray cluster on 127.0.0.1 (the session's: three
1-CPU worker nodes): docs/service.md.

Run A (priority 0, min 1, max 3) grows into the idle cluster; run B (priority 10, 2 workers) arrives and
waits QUEUED: the allocator shrinks A to its minimum (from memory, no step lost) and B is admitted; the
allocator is killed meanwhile and Ray restarts it; when B finishes, the restarted allocator (its state
read back from the store) grows A back when A's own measurements say that three workers save more than
the resize costs.
Both pass the chaos oracle against their failure-free references
(every step once, every sample once, the same loss at every step).
"""

from __future__ import annotations

import time

import pytest

from orchestrator.chaos.oracle import oracle
from orchestrator.service.demand import resize_cost, throughput
from tests.cluster import GLOBAL_BATCH, STEPS, start_run

A_STEPS = 160  # A outlives B (40 steps at 2 workers) at 1 worker with steps to spare for the growth back


def resizes(store, run_id: str) -> list[tuple[int, int]]:
    return [(e["from_workers"], e["to_workers"]) for e in store.events(run_id) if e["kind"] == "resized"]


def store_event(store, run_id: str, kind: str, timeout: float = 120.0, **match) -> dict:
    """The first event ``kind`` of the run in its store with the fields ``match`` (the allocator's events are
    written there, not through the controller)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in store.events(run_id) if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no {kind} event {match} of {run_id} within {timeout:.0f} s"
        time.sleep(0.5)


def passes(final: dict, history: list, ref: dict, steps: int) -> None:
    reasons = oracle({"status": final, "history": history}, ref, total_steps=steps, global_batch=GLOBAL_BATCH,
                     rtol=1e-4, atol=0.0, verify_problems={}, final_cursor=None)
    assert not reasons, reasons


@pytest.mark.ray
def test_a_higher_priority_run_takes_what_idle_capacity_lent_and_gives_it_back(ray_cluster, reference, tmp_path):
    import ray

    from orchestrator.service.allocator import ALLOCATOR_NAME, NAMESPACE

    root = f"file://{tmp_path}/runs"
    a, store = start_run(root, f"train.steps={A_STEPS}", workers=1, min_workers=1, max_workers=3, run_id="svc-a")
    a.wait(lambda s: s["phase"] == "RUNNING" and s["world_size"] == 3, what="A grown into the idle cluster",
           timeout=120)
    up = a.wait_event("resized", 1)  # written at the first step at the new size
    assert (up["from_workers"], up["to_workers"]) == (1, 3)
    assert store_event(store, "svc-a", "allocated", action="grow")["cause"] == "idle"

    b, _ = start_run(root, "elastic.priority=10", workers=2, min_workers=2, max_workers=2, run_id="svc-b")
    pre = store_event(store, "svc-a", "preempted", action="shrink")
    assert (pre["cause"], pre["workers"]) == ("preempted", 1) and "svc-b" in pre["reason"], pre
    b.wait_event("admitted", timeout=120)
    a.wait(lambda s: s["world_size"] == 1, what="A at its minimum")

    before = ray.get_actor(ALLOCATOR_NAME, namespace=NAMESPACE)
    ray.kill(before, no_restart=False)  # Ray restarts it; it reads its registry back from the store

    final_b = b.join(300)
    # After B: A grows back when its own measurements say 3 workers save more than the resize costs (on a
    # 2-core machine three processes may train the tiny model no faster than one: then no resize is the
    # right decision, and none is made). The restarted allocator decides from its registry, read back.
    measured = throughput(store.get_history("svc-a"), GLOBAL_BATCH)
    r1, r3 = measured.get(1, 0.0), measured.get(3, 0.0)
    left = (A_STEPS - store.get_status("svc-a")["step"]) * GLOBAL_BATCH  # samples
    saved = left / r1 - left / r3 if r1 and r3 else 0.0  # seconds a grow saves, by A's own figures
    cost = resize_cost(store.events("svc-a"))
    # The policy grows when the saving exceeds twice the resize cost; away from that edge the outcome is sure.
    must_grow, may_grow = saved > 3 * cost, saved > 1.5 * cost
    deadline = time.monotonic() + 60
    while must_grow and resizes(store, "svc-a")[-1] != (1, 3) and a.thread.is_alive():
        assert time.monotonic() < deadline, f"A did not grow back after B ended: {resizes(store, 'svc-a')}, {measured}"
        time.sleep(0.5)
    final_a = a.join(600)
    grew = resizes(store, "svc-a")[2:]
    assert resizes(store, "svc-a")[:2] == [(1, 3), (3, 1)] and grew in ([], [(1, 3)]), resizes(store, "svc-a")
    assert (must_grow and grew) or (not must_grow and (may_grow or not grew)), (grew, measured, saved, cost)
    assert final_a["steps_lost"] == 0 and final_a["recoveries"] == 0, final_a
    assert not [e for e in store.events("svc-a") if e["kind"] == "allocated" and e["action"] == "suspend"]

    # B is the session's reference run (RUN_BASE at 2 workers): the same losses step for step.
    passes(final_b, store.get_history("svc-b"), {"status": reference["final"], "history": reference["history"]}, STEPS)
    # A against a failure-free run of its own config at 2 workers (other sizes reduce in another order).
    ref_run, ref_store = start_run(f"file://{tmp_path}/ref", f"train.steps={A_STEPS}", workers=2, run_id="svc-a-ref")
    ref_final = ref_run.join(600)
    passes(final_a, store.get_history("svc-a"), {"status": ref_final, "history": ref_store.get_history("svc-a-ref")},
           A_STEPS)


@pytest.mark.ray
def test_a_runs_minimum_waits_for_nodes_with_its_labels(ray_cluster, tmp_path):
    """`[elastic] min_node_labels`: the gang is placed only on nodes with those Ray labels (a run's minimum
    on on-demand nodes, its elastic part on spot ones); none of the session's nodes has them."""
    root = f"file://{tmp_path}/runs"
    run, _ = start_run(root, 'elastic.min_node_labels="ray.io/market-type=on-demand"', "train.steps=400", workers=1,
                       min_workers=1, max_workers=1)
    queued = run.wait_event("queued", timeout=60)
    assert queued["workers"] == 1
    node = ray_cluster.add_node(1, labels={"ray.io/market-type": "on-demand"})
    try:
        run.wait_event("admitted", timeout=120)
        formed = run.wait_event("formed", timeout=120)
        assert formed["nodes"] == [node.node_id], "the gang was placed on a node without the label"
        run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 2, what="two steps")
    finally:
        run.close()
        ray_cluster.remove_node(node)


@pytest.mark.parametrize("text", ["market", "a=b,=c", "ray.io/market-type=on demand", "k=v;x=y"])
def test_a_bad_node_label_selector_names_the_field(text):
    from checkpointing.errors import ConfigError
    from orchestrator.config import elastic_from_raw, node_labels

    assert node_labels("ray.io/market-type=on-demand, zone=a") == {"ray.io/market-type": "on-demand", "zone": "a"}
    with pytest.raises(ConfigError, match="elastic.elastic_node_labels"):
        elastic_from_raw({"elastic": {"elastic_node_labels": text}})
