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

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
# Ray reads these when it is first imported: set them before anything imports it.
os.environ.update(RAY_ENV)


class LocalCluster:
    def __init__(self, node_cpus: list[int]):
        import ray
        from ray.cluster_utils import Cluster

        from tests.harness import free_port

        # The dashboard serves Ray's state API (``ray.util.state``) and the job server (``ray job submit``).
        self.dashboard_port = free_port()
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": True,
            "dashboard_host": "127.0.0.1", "dashboard_port": self.dashboard_port})
        self.nodes = [self.add_node(n, wait=False) for n in node_cpus]
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace="etrain", log_to_driver=False, logging_level="warning")

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_node(self, cpus: int, wait: bool = True):
        node = self.cluster.add_node(num_cpus=cpus, node_ip_address="127.0.0.1")
        if wait:
            self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node) -> None:
        self.cluster.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
