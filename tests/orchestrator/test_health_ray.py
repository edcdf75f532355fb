"""[health] on a real Ray cluster on 127.0.0.1 (the session's: a head without CPUs and three 1-CPU nodes).

A bit flipped in a worker's state (``set_health_faults`` on the run's controller, as ``etrain chaos`` injects
it) is caught and rolled back in place inside the workers: the run finishes as the failure-free reference
did, with ``sdc`` and ``rollback`` events. A flip that comes back on the same worker after the rollback
evicts that worker through the resize path and quarantines its node in the cluster's allocator; the run
finishes on the others. The decision alone: tests/orchestrator/test_health_policy.py."""

from __future__ import annotations

import pytest

from tests.cluster import STEPS, start_run
from tests.harness import wait_for
from tests.orchestrator.test_quarantine_ray import service  # noqa: F401 - the fixture: a service store, released after

pytestmark = pytest.mark.ray


def _inject(run, st, fault: dict, rank: int) -> int:
    """Once the run trains, the fault in the worker of ``rank``, two steps ahead; the step it fires at."""
    import ray

    from orchestrator.driver.run import controller_actor

    step = wait_for(lambda: (s := st.get_status(run.spec.run_id) or {}).get("phase") == "RUNNING"
                    and (s.get("step") or 0) >= 4 and s["step"], "the run training", timeout=180)
    at = step + 3
    actor = controller_actor(run.spec.run_id, st.url)
    assert ray.get(actor.set_health_faults.remote([{**fault, "step": at}], rank), timeout=30)
    return at


def _events(st, run_id: str, *kinds: str) -> list[dict]:
    return [e for e in st.events(run_id) if e["kind"] in kinds]


def test_a_transient_flip_is_rolled_back_in_place_and_the_run_ends_as_the_reference(ray_cluster, tmp_path,
                                                                                      reference):
    run, st = start_run(f"file://{tmp_path}/runs", "health.check_every_steps=4", workers=2)
    try:
        at = _inject(run, st, {"kind": "bitflip", "target": "optimizer"}, rank=1)
        final = run.join()
    finally:
        run.close()
    assert final["phase"] == "FINISHED" and final["step"] == STEPS, final
    sdc = _events(st, run.spec.run_id, "sdc")
    assert [(e["verdict"], e["rank"], e["step"]) for e in sdc] == [("transient", 1, at)], sdc
    rollbacks = _events(st, run.spec.run_id, "rollback")
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] < at <= rollbacks[0]["from_step"] + 1, rollbacks
    failures = _events(st, run.spec.run_id, "failure", "recovered")
    assert failures == [], failures  # in place: no failure, no re-formed group
    pids = [e["pids"] for e in _events(st, run.spec.run_id, "formed")]
    assert len(pids) == 1, pids
    assert final["loss"] == reference["loss"], (final["loss"], reference["loss"])


def test_a_persistent_flip_evicts_the_worker_and_quarantines_its_node(service, ray_cluster, tmp_path):  # noqa: F811
    from orchestrator.service.nodes import cluster_store
    from orchestrator.service.quarantine import quarantined_nodes

    run, st = start_run(f"file://{tmp_path}/runs", "health.check_every_steps=4", workers=2, min_workers=1)
    try:
        at = _inject(run, st, {"kind": "bitflip", "target": "param", "persistent": True}, rank=1)
        final = run.join()
    finally:
        run.close()
    assert final["phase"] == "FINISHED" and final["step"] == STEPS, final
    rid = run.spec.run_id
    sdc = _events(st, rid, "sdc")
    assert ("persistent", 1, at) in [(e["verdict"], e["rank"], e["step"]) for e in sdc], sdc
    node = _events(st, rid, "formed")[0]["nodes"][1]
    q = _events(st, rid, "quarantine")
    assert [(e["node"], e.get("refused")) for e in q] == [(node, None)], q
    assert [e["action"] for e in _events(st, rid, "health")] == ["evict"]
    assert node in quarantined_nodes(cluster_store())
    later = _events(st, rid, "formed")[1:]
    assert later and all(node not in e["nodes"] for e in later), later  # never placed there again
    assert not _events(st, rid, "failure")  # an eviction, not a failure
