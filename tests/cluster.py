"""A real multi-node Ray cluster on 127.0.0.1, for tests that drive runs inside it.

    cluster = LocalCluster(node_cpus=[3])          # a head (no CPUs) + one 3-CPU node, separate raylets
    node = cluster.add_node(1)                     # capacity joins ...
    cluster.remove_node(node)                      # ... and leaves (its raylet and workers die)

Every node is its own raylet (``ray.cluster_utils.Cluster``), all bound to
loopback: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray from swapping
127.0.0.1 for the machine's routable address, and token authentication is
off for this loopback-only cluster.
"""

from __future__ import annotations

import os

# The run every Ray test starts from (tests/orchestrator/test_orchestrator.py, tests/orchestrator/test_chaos.py): the tiny model,
# 40 steps, a checkpoint every 4; the failure-free reference of the session trains exactly this.
# ZeRO-2: parameters stay whole through the 6 micro-batches of a step, which steps 2.5x faster than
# ZeRO-3 on a loaded 2-core machine; ZeRO-3 (FSDP2) is covered by the parity and checkpoint tests,
# and by the chaos test of a second fault during a recovery.
STEPS = 40
INTERVAL = 4
GLOBAL_BATCH = 12
RUN_BASE = ['model.preset="tiny"', "data.seq_len=32", "data.max_bytes=1000000", f"train.steps={STEPS}",
            f"train.global_batch={GLOBAL_BATCH}", "train.micro_batch=1", "train.warmup_steps=4",
            "train.log_every=1000", f"checkpoint.interval_steps={INTERVAL}", 'metrics.file_sd_dir="-"',
            "parallel.zero_stage=2"]

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
# Ray reads these when it is first imported: set them before anything imports it.
os.environ.update(RAY_ENV)


# The runs the current test started; an autouse fixture (tests/conftest.py) closes them when the test
# ends, so that a test that fails half-way leaves no run behind for the next one.
RUNS: list = []


def start_run(root: str, *overrides: str, workers: int = 2, min_workers: int | None = None,
              max_workers: int | None = None, store: str | None = None, run_id: str | None = None):
    """A run of RUN_BASE plus ``overrides`` with its checkpoints under ``root`` (and its store there
    unless ``store`` is given), in the background; returns it and its store."""
    import uuid

    from orchestrator.driver.run import prepare_run

    run_id = run_id or f"t-{uuid.uuid4().hex[:6]}"
    spec, st = prepare_run("examples/tiny.toml", [*RUN_BASE, f'checkpoint.url="{root}"', *overrides],
                           workers=workers, min_workers=min_workers, max_workers=max_workers, run_id=run_id,
                           store=store or root)
    return follow(spec, st), st


def reference_run(root: str, *overrides: str, workers: int = 2) -> dict:
    """A failure-free run of RUN_BASE plus ``overrides``, run id "reference", to its end: what faulted runs of
    the same config must match. Its final status, plus ``root`` and ``store`` (where it ran) and its step
    ``history``."""
    from orchestrator.driver.run import BackgroundRun, prepare_run

    spec, st = prepare_run("examples/tiny.toml", [*RUN_BASE, f'checkpoint.url="{root}"', *overrides],
                           workers=workers, run_id="reference", store=root)
    run = BackgroundRun(spec, st)
    try:
        final = run.join()
    finally:
        run.close()
    assert final["phase"] == "FINISHED", final
    return {**final, "final": final, "root": root, "store": st, "history": st.get_history("reference")}


def follow(spec, store):
    """Drive the run of ``spec`` in the background (closed at the end of the test)."""
    from orchestrator.driver.run import BackgroundRun

    run = BackgroundRun(spec, store)
    RUNS.append(run)
    return run


class LocalCluster:
    def __init__(self, node_cpus: list[int]):
        import ray
        from ray.cluster_utils import Cluster

        from tests.harness import free_port

        # The dashboard serves Ray's state API (``ray.util.state``) and the job server (``ray job submit``).
        self.dashboard_port = free_port()
        # Every node's dashboard agent on a free port: its default (52365) is taken by any other Ray on this
        # machine, and a head without its agent takes no job (`ray job submit`: "No available agent").
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": True,
            "dashboard_host": "127.0.0.1", "dashboard_port": self.dashboard_port,
            "dashboard_agent_listen_port": free_port()})
        self.nodes = [self.add_node(n, wait=False) for n in node_cpus]
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace="etrain", log_to_driver=False, logging_level="warning")

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_node(self, cpus: int, wait: bool = True, labels: dict | None = None):
        from tests.harness import free_port

        node = self.cluster.add_node(num_cpus=cpus, node_ip_address="127.0.0.1",
                                     dashboard_agent_listen_port=free_port(), **({"labels": labels} if labels else {}))
        if wait:
            self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node) -> None:
        self.cluster.remove_node(node, allow_graceful=False)

    def replace_killed_nodes(self) -> int:
        """Nodes whose raylet was killed from outside (chaos kills it): drop them from the cluster's own
        list, so that later ``add_node`` calls wait only for the living, and add a 1-CPU node for each.
        Returns how many were replaced."""
        dead = [n for n in self.cluster.worker_nodes
                if any(p.process.poll() is not None for p in n.all_processes.get("raylet", []))]
        for node in dead:
            self.cluster.remove_node(node, allow_graceful=False)
            self.add_node(1, wait=False)
        return len(dead)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
