"""The cluster drives a resize, on a real Ray cluster on 127.0.0.1 (the session's: a head and three 1-CPU nodes).

A node hosting a worker is drained through Ray's own drain call (what ``ray drain-node`` and a node's
SIGTERM handler make): the run shrinks off it at a step boundary before the deadline, with a
``preempted`` event (reason ``drain``) and no failure; a node added just before (so that the
replacement starts while the 40-step run still trains) lets it grow back to its size; it finishes and
passes the chaos oracle against the session's failure-free reference (every step once, the same loss
at every step). The chaos kinds ``drain_node`` and ``add_node`` inject both.

The drained node's raylet exits once the run has left it (Ray ends an idle draining node); the test
leaves the cluster as it found it: three live 1-CPU worker nodes, none draining.
"""

from __future__ import annotations

import json
import uuid

import pytest

from orchestrator.chaos.cli import judge
from orchestrator.chaos.injector import Chaos
from orchestrator.chaos.plan import load_plan
from orchestrator.service.drains import ray_draining_nodes
from tests.cluster import STEPS, start_run
from tests.orchestrator.test_chaos import use_reference

pytestmark = pytest.mark.ray

PLAN = """
[chaos]
loss_rtol = 1e-4

[[fault]]
kind = "drain_node"
at_step = 4
rank = 1
deadline_s = 60

[[fault]]
kind = "add_node"
at_step = 2
"""


def restore(cluster, nodes: int = 3) -> None:
    """Three live, undrained 1-CPU worker nodes again: dead or draining nodes dropped, nodes added for them."""
    draining = ray_draining_nodes()
    for node in list(cluster.cluster.worker_nodes):
        dead = any(p.process.poll() is not None for p in node.all_processes.get("raylet", []))
        if dead or node.node_id in draining:
            cluster.remove_node(node)
    while len(cluster.cluster.worker_nodes) < nodes:
        cluster.add_node(1)


def add_node(cluster, cpus: int) -> str:
    """A node joins; waited for by its id (the cluster's own wait counts the drained node, which may be
    dying meanwhile)."""
    import time

    import ray

    node = cluster.add_node(cpus, wait=False)
    deadline = time.monotonic() + 60
    while not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the added node did not join within 60 s"
        time.sleep(0.2)
    return node.node_id


def test_a_drained_node_is_left_at_a_step_boundary_and_an_added_node_grows_the_run_back(ray_cluster, reference,
                                                                                           tmp_path):
    cluster = ray_cluster
    root = f"file://{tmp_path}/runs"
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text(PLAN)
    plan = load_plan(str(plan_file))
    try:
        run, st = start_run(root, workers=3, min_workers=1, max_workers=3, run_id=f"d-{uuid.uuid4().hex[:6]}")
        run_id = run.spec.run_id
        chaos = Chaos(run_id, st, plan, add_node=lambda cpus: add_node(cluster, cpus))
        final = chaos.run(timeout_s=400)
        run.join()
        result = judge(run_id, st, plan, chaos, final, use_reference(st, reference, f"{run_id}-ref"))
        assert result["passed"], json.dumps(result, indent=1, default=str)
        # by kind: the report lists the faults in the order they were injected, which the two steps' timing decides
        (drained,), (added,) = ([f for f in result["faults"] if f["kind"] == k] for k in ("drain_node", "add_node"))
        events = st.events(run_id)
        notice = next(e for e in events if e["kind"] == "preempted")
        assert notice["reason"] == "drain" and notice["action"] == "shrink" and notice["to_workers"] == 2
        assert notice["node"] == drained["target"]["node"] and 0 < notice["deadline_in_s"] <= 60
        assert drained["recovered"] and drained["before_deadline"] and drained["steps_lost"] == 0
        resized = [(e["from_workers"], e["to_workers"]) for e in events if e["kind"] == "resized"]
        assert resized[:2] == [(3, 2), (2, 3)], resized
        assert added["recovered"] and added["grew"] == [2, 3]
        formed = [e for e in events if e["kind"] == "formed"]
        assert all(drained["target"]["node"] not in e["nodes"] for e in formed[1:])  # never on the node again
        assert [e for e in events if e["kind"] == "failure"] == []  # a drain is not a failure
        assert final["step"] == STEPS and final["steps_lost"] == 0 and final["recoveries"] == 0
    finally:  # capacity back for the next tests, pass or fail
        restore(cluster)


def test_a_sigterm_to_a_ray_start_node_drains_it_and_the_run_leaves_it(ray_cluster, reference, tmp_path):
    """What a KubeRay pod's deletion does: the node's process (`ray start --block` there; tests/node_proc.py
    here, the same Ray node code) gets SIGTERM, drains its own node for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
    and exits once the node is idle. The run shrinks off it at a
    step boundary (no failure, no step lost) and the node is gone well before the drain's timeout."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import ray

    from tests.harness import free_port

    before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    log = open(tmp_path / "node.log", "w")
    env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "60"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.node_proc", ray.get_runtime_context().gcs_address,
                             str(free_port())], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (new := [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in before]):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "node.log").read_text()
            time.sleep(0.2)
        node = new[0]
        run, st = start_run(f"file://{tmp_path}/runs", workers=4, min_workers=1, max_workers=4,
                            run_id=f"s-{uuid.uuid4().hex[:6]}")
        formed = run.wait_event("formed")
        assert node in formed["nodes"]  # four workers on four 1-CPU nodes: one is on it
        run.wait(lambda s: s["step"] >= 4, what="step 4")
        sigterm_at = time.time()
        os.kill(proc.pid, signal.SIGTERM)
        resized = run.wait_event("resized")
        assert (resized["from_workers"], resized["to_workers"]) == (4, 3) and "draining" in resized["reason"]
        final = run.join()
        proc.wait(timeout=60)  # the node's process exits once its node is idle, before the 60 s drain timeout
        print(f"SIGTERM -> first step without the node {resized['first_step_unix'] - sigterm_at:.2f} s "
              f"(resize_s {resized['resize_s']})")
        events = st.events(run.spec.run_id)
        notice = next(e for e in events if e["kind"] == "preempted")
        assert notice["node"] == node and notice["reason"] == "drain" and notice["action"] == "shrink"
        assert resized["first_step_unix"] - sigterm_at < 30
        assert [e for e in events if e["kind"] == "failure"] == []
        assert final["phase"] == "FINISHED" and final["steps_lost"] == 0 and final["recoveries"] == 0
        assert final["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        restore(ray_cluster)
