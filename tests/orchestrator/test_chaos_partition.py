"""A network partition (``partition_node``) on a Ray cluster whose worker nodes run in network namespaces
(tests/netns_cluster.py: a head on bridge etr-br0 and three 1-CPU nodes in etr-n1..etr-n3).

The run trains on two nodes with a warm standby on the third; rank 0's node is cut off while its
processes keep running. The survivor's collective hangs, the controller detects it (the hang deadline,
or the actor's death once Ray declares the node dead) and re-forms without that node; the isolated
worker, still running, then tries to commit a checkpoint of its old epoch and the fence refuses it.
When the link heals, that node's raylet learns it was declared dead and ends its processes. The run
passes the oracle against a failure-free reference of the same config, run first on the same cluster
(the session's reference runs on the loopback cluster, which cannot run beside this one here).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import uuid

import pytest

from checkpointing.dcp.writer import file_prefix
from orchestrator.chaos import netns, procfs
from orchestrator.chaos.cli import judge
from orchestrator.chaos.injector import Chaos
from orchestrator.chaos.plan import load_plan
from orchestrator.chaos.report import format_report
from tests.cluster import start_run
from tests.harness import wait_for
from tests.netns_cluster import NetnsCluster, node_ns

pytestmark = pytest.mark.ray

# A hang is no step for 4 s (a step takes about 0.25 s here), as in tests/orchestrator/test_chaos.py. A warm standby
# takes the cut-off rank's place at once (the survivor, blocked in a collective with the isolated rank,
# is replaced too: see ControllerOptions.settle_s), instead of waiting for new workers to boot.
STEPS = 24
RUN = ("elastic.hang_timeout_s=4", f"train.steps={STEPS}")
CUT_AT = 12  # the step whose checkpoint the isolated rank 0 tries to commit after the fence moved on


@pytest.fixture(scope="module")
def partition_cluster():
    why = netns.can_create_namespaces()
    if why:
        pytest.skip(f"network namespaces cannot be created here ({why}); partition tests need root")
    import ray

    # This process can be connected to one Ray cluster at a time: the session's loopback cluster (other
    # Ray tests) is left for this module's and joined again after it.
    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    ray.shutdown()
    cluster = NetnsCluster(nodes=3, node_cpus=1, keep_logs=bool(os.environ.get("ETRAIN_KEEP_NETNS_LOGS")))
    try:
        yield cluster
    finally:
        cluster.shutdown()
        if previous:
            ray.init(address=previous, namespace="etrain", log_to_driver=False, logging_level="warning")


def start(root: str, run_id: str, standby: int = 1):
    return start_run(root, *RUN, f"elastic.standby={standby}", min_workers=1, max_workers=2, run_id=run_id)


def worker_actor(run_id: str, pid: int):
    """The TrainWorker actor of ``run_id`` whose process is ``pid``."""
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(f"etrain-{run_id}-w"):
            actor = ray.get_actor(a["name"], namespace=a["namespace"])
            if ray.get(actor.ping.remote(), timeout=30) == pid:
                return actor
    raise AssertionError(f"no worker of run {run_id} has pid {pid}")


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()



def test_partitioned_node_is_replaced_its_stale_commit_refused_and_the_run_passes_the_oracle(
        partition_cluster, tmp_path):
    import ray

    root = f"file://{tmp_path}/runs"
    ref, _ = start(root, "reference", standby=0)  # a standby changes no step's math, and boots a third worker
    assert ref.join()["phase"] == "FINISHED"

    run_id = f"p-{uuid.uuid4().hex[:6]}"
    run, st = start(root, run_id)
    formed = run.wait_event("formed")
    victim = formed["pids"][0]
    # Rank 0's file of step CUT_AT waits 10 s before it is written: its save is still in flight when the link
    # is cut, and the commit is tried by an isolated worker. The cut comes once rank 1's marker is written:
    # the save's collectives are over, and rank 0 needs no peer to commit.
    ray.get(worker_actor(run_id, victim).set_storage_faults.remote(
        {"delay_s": 10.0, "ops": ["put"], "path_contains": f"step_{CUT_AT:09d}/{file_prefix(formed['epoch'])}__0_"}),
        timeout=30)
    ranks = os.path.join(tmp_path, "runs", run_id, "checkpoints", f"step_{CUT_AT:09d}", "_ranks")
    wait_for(lambda: glob.glob(os.path.join(ranks, "*", "rank_00001.json")), f"rank 1's marker of step {CUT_AT}")

    plan = load_plan(None, [f"kind=partition_node,at_step={CUT_AT},rank=0,duration_s=60"])
    chaos = Chaos(run_id, st, plan)
    out: dict = {}
    driver = threading.Thread(target=lambda: out.update(final=chaos.run(timeout_s=300)), daemon=True)
    driver.start()
    # Order the race for the test: the isolated worker is held (SIGSTOP) from the cut until the group of
    # the next epoch has formed, so that its commit comes after the fence moved; then it runs on, cut off.
    try:
        wait_for(lambda: chaos.injections, "the partition")
        os.kill(victim, signal.SIGSTOP)
        wait_for(lambda: any(e["kind"] == "formed" and e["epoch"] > formed["epoch"] for e in st.events(run_id)),
                 "a group without the cut-off node")
    finally:
        if not procfs.gone(victim):
            os.kill(victim, signal.SIGCONT)
    driver.join(400)
    final = out["final"]
    run.join()

    result = judge(run_id, st, plan, chaos, final, "reference")
    print(format_report(result))
    assert result["passed"], json.dumps(result, indent=1, default=str)
    (f,) = result["faults"]
    assert f["target"]["rank"] == 0 and f["target"]["pid"] == victim
    ns = f["target"]["netns"]
    assert ns in {node_ns(n) for n in (1, 2, 3)} and f["target"]["link"] == f"{ns}-h"
    # The hang deadline (4 s) plus the pings that find the cut-off worker unresponsive (2 s), or Ray's
    # health checks (3 misses 1 s apart), whichever comes first.
    assert f["detected"] and f["time_to_detect_s"] <= 10, f
    assert f["recovered"] and f["committed_steps_lost"] == 0
    assert f["node_dead_after_s"] is not None and f["node_dead_after_s"] <= 15, f
    assert f["partition_s"] is not None and f["partition_s"] <= 61
    events = st.events(run_id)
    assert all(victim not in e["pids"] for e in events if e["kind"] == "formed" and e["time"] > f["injected_unix"])
    assert final["step"] == STEPS and result["max_loss_rel_diff"] <= 1e-3

    # The isolated worker tried to commit step CUT_AT of its old epoch and the fence refused it.
    node_dir = os.path.join(partition_cluster.temp_dir, f["target"]["netns"])
    logs = glob.glob(os.path.join(node_dir, "session_*", "logs", f"worker-*-{victim}.err"))
    text = "".join(read(p) for p in logs)
    assert f"checkpoint at step {CUT_AT} failed" in text and "is fenced off by epoch" in text, (logs, text[-3000:])
    # Healed, the node learns that Ray declared it dead: its raylet ends, and the isolated worker with it.
    wait_for(lambda: procfs.gone(victim), "the end of the isolated worker after the heal", timeout=60)
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert f["target"]["node"] not in alive
