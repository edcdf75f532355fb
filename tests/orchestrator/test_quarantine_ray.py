"""Node quarantine on a real Ray cluster on 127.0.0.1 (the session's: a head without CPUs and three 1-CPU
nodes): a quarantined node leaves the allocator's capacity and gets no worker of a run's group (Ray's
``ray.io/node-id`` label selector; a worker asked for before the quarantine is placed again, so it does not
take the node's room when the node's own worker leaves), `etrain nodes` lists it with its reason, and
`etrain nodes release` (the admin token) brings it back: capacity returns, and the worker that waited for
room is placed there (docs/operations.md#node-quarantine). The logic alone: tests/orchestrator/test_quarantine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from orchestrator.cli.main import main as etrain
from orchestrator.store.run_store import open_store
from tests.cluster import RUN_BASE
from tests.harness import wait_for

pytestmark = pytest.mark.ray
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def service(ray_cluster, tmp_path, monkeypatch):
    """The session's cluster with a service store of this test's (its admin token in this test's ETRAIN_HOME),
    forgotten after it with nothing quarantined, so that later tests place on every node."""
    from ray.experimental import internal_kv

    from orchestrator.service.grants import KV_KEY, KV_NAMESPACE
    from orchestrator.service.quarantine import publish, release_all

    monkeypatch.setenv("ETRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ETRAIN_ADMIN_TOKEN", raising=False)
    url = f"file://{tmp_path}/service"
    assert etrain(["service", "init", "--store", url, "--address", ray_cluster.cluster.address]) == 0
    try:
        yield url, ray_cluster.cluster.address
    finally:
        release_all(open_store(url))
        publish([])
        internal_kv._internal_kv_del(KV_KEY, namespace=KV_NAMESPACE)
        svc = open_store(url)
        _, version = svc.read_versioned(None, "service")
        svc.write_if(None, "service", "{}", version)


def test_a_quarantined_node_gets_no_worker_and_no_capacity_until_etrain_nodes_release(service, tmp_path, capsys):
    import ray

    from orchestrator.service.allocator import ensure_allocator
    from orchestrator.service.capacity import ray_capacity
    from orchestrator.service.nodes import cluster_store
    from orchestrator.service.quarantine import quarantine_node
    from orchestrator.workers.group import RayWorkerGroup
    from trainer.config.load import load_config

    url, address = service
    allocator = ensure_allocator(url)  # the session's allocator (it follows the service store), or one started here
    ray.get(allocator.tick.remote(), timeout=120)
    assert cluster_store().url == url
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1)
    assert len(nodes) == 3 and ray_capacity(1.0, 0.0)[0] == 3

    run_id = f"q-{uuid.uuid4().hex[:6]}"
    cfg = load_config("examples/tiny.toml", [*RUN_BASE, f'checkpoint.url="file://{tmp_path}/runs"',
                                             f'run_id="{run_id}"'])
    group = RayWorkerGroup(cfg, run_id, "")
    try:
        wids = group.start(4)  # four 1-CPU workers on three 1-CPU nodes: one waits for room
        wait_for(lambda: len(group.ready(wids, timeout=1.0)) == 3, "three workers up", timeout=240)
        up = group.ready(wids, timeout=0)
        (waiting,) = [w for w in wids if w not in up]
        victim = up[1]
        bad = group.info(victim)["node_id"]

        # A detector found the node bad: quarantined, and the allocator reads it and publishes it to Ray's GCS.
        assert quarantine_node(open_store(url), bad, reason="sdc: digest mismatch", run="q.0", rank=1, step=4,
                               nodes=len(nodes))
        ray.get(allocator.tick.remote(), timeout=120)
        state = ray.get(allocator.state.remote(), timeout=60)
        assert state["quarantined"] == [bad] and state["capacity"] <= 2
        assert ray_capacity(1.0, 0.0)[0] == 2, "the quarantined node's CPU is no capacity"
        assert etrain(["nodes", "--json"]) == 0
        rows = {r["node_id"]: r for r in json.loads(capsys.readouterr().out)["nodes"]}
        assert rows[bad]["state"] == "quarantined" and rows[bad]["reason"] == "sdc: digest mismatch"
        assert rows[bad]["run"] == "q.0" and rows[bad]["step"] == 4
        assert {rows[n]["state"] for n in nodes if n != bad} == {"alive"}

        # The worker that waited was asked for before the quarantine: placed again to keep off the node, which
        # its run leaves (as an evicted rank's does); the room there is taken by nothing.
        assert group.placed([waiting]) == []
        group.kill(victim)
        time.sleep(5)
        assert group.placed([waiting]) == [] and group.ready([waiting], timeout=0) == [], \
            "the waiting worker did not take the quarantined node's room"

        assert etrain(["nodes", "release", bad[:8]]) == 0  # the admin token `etrain service init` kept
        assert f"node {bad} released" in capsys.readouterr().out
        assert ray_capacity(1.0, 0.0)[0] == 3
        released = time.monotonic()
        wait_for(lambda: group.ready([waiting], timeout=1.0) == [waiting], "the waiting worker up", timeout=240)
        assert group.info(waiting)["node_id"] == bad, "the worker that waited is placed on the released node"
        with capsys.disabled():
            print(f"\nrelease -> the waiting worker up on the node: {time.monotonic() - released:.1f} s")
        ray.get(allocator.tick.remote(), timeout=120)
        assert ray.get(allocator.state.remote(), timeout=60)["quarantined"] == []
    finally:
        group.shutdown()

    # `etrain nodes` from a shell: it joins the cluster at --address, and loads Ray but never torch.
    probe = ("import json, sys; from orchestrator.cli.main import main; code = main(sys.argv[1:]); "
             "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-c", probe, "nodes", "--address", address], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180, check=False)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"code": 0, "torch": False}, r.stdout + r.stderr
    assert bad[:12] in r.stdout and "alive" in r.stdout
