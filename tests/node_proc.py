"""A Ray worker node in a process of its own, as ``ray start --block`` runs one: on SIGTERM it drains its
node (Ray's own handler, for ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``), waits for the node to go idle and
exits. ``ray start`` itself cannot join the loopback test cluster: with multi-node clusters enabled it
swaps 127.0.0.1 for the machine's routable address.

    python -m tests.node_proc GCS_ADDRESS DASHBOARD_AGENT_PORT [CPUS]
"""

from __future__ import annotations

import sys
import time

import tests.cluster  # noqa: F401  (Ray's environment for the loopback cluster, before Ray is imported)


def main(gcs_address: str, agent_port: int, cpus: int = 1) -> None:
    import ray._private.node
    import ray._private.parameter

    params = ray._private.parameter.RayParams(
        gcs_address=gcs_address, node_ip_address="127.0.0.1", num_cpus=cpus, num_gpus=0,
        object_store_memory=150 * 1024 * 1024, min_worker_port=0, max_worker_port=0, include_log_monitor=False,
        node_manager_port=0, dashboard_agent_listen_port=agent_port)
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    print(node.node_id, flush=True)
    while True:  # SIGTERM: Ray's handler drains the node, then exits the process
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *(int(a) for a in sys.argv[3:]))
