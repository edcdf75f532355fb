"""A Ray cluster whose worker nodes each run in a network namespace of their own, for partition tests.

    cluster = NetnsCluster(nodes=3)               # a head on bridge etr-br0 + 3 nodes in etr-n1..etr-n3
    ...                                            # the driver (this process) is connected to it
    cluster.shutdown()                             # every process, namespace, link and the bridge it made

The head (no CPUs; the driver and the runs' controllers live on it) runs in this process's namespace at
10.213.0.1 on the bridge; node N runs in namespace ``etr-nN`` at 10.213.0.(10+N), reachable only through
its veth, which ``etrain chaos`` cuts for ``partition_node`` (orchestrator/chaos/netns.py sets them up the way
a user would). No address is loopback: a namespace's 127.0.0.1 is its own. Ray is tuned to declare a
node that stops answering dead within about 6 s, instead of most of a minute.

Needs root (CI runs as root); :func:`orchestrator.chaos.netns.can_create_namespaces` says why not otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from orchestrator.chaos import netns, procfs
from tests.harness import free_port

HEAD_IP = "10.213.0.1"
# A node that misses 3 health checks 1 s apart is dead (Ray's defaults: 5 checks 3 s apart, 10 s each).
HEALTH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
          "health_check_failure_threshold": 3}
# Every Ray process of the cluster: no usage stats, no auth on this private subnet, multi-node allowed
# (tests.cluster turns that off for the loopback cluster of the other tests).
NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
OBJECT_STORE = str(100 * 1024 * 1024)


def node_ns(n: int) -> str:
    return f"etr-n{n}"


def node_ip(n: int) -> str:
    return f"10.213.0.{10 + n}"


class NetnsCluster:
    def __init__(self, nodes: int = 3, node_cpus: int = 1, keep_logs: bool = False):
        # Short: Ray's unix sockets live under it, and their paths may not exceed 107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="etrns-", dir="/tmp")
        self.keep_logs = keep_logs
        self.node_cpus = node_cpus
        self.head: subprocess.Popen | None = None
        self.nodes: dict[int, subprocess.Popen] = {}
        self.bridge = False
        try:
            netns.create_bridge(netns.BRIDGE, f"{HEAD_IP}/24")
            self.bridge = True
            self.address = self._start_head()
            for n in range(1, nodes + 1):
                self.add_node(n)
            self._connect()
            self.wait_for_nodes(nodes + 1)
        except BaseException:
            self.shutdown()
            raise

    def _start_head(self) -> str:
        port = free_port(HEAD_IP)
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray, "start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={port}", "--num-cpus=0",
               "--include-dashboard=false", f"--ray-client-server-port={free_port(HEAD_IP)}",
               f"--object-store-memory={OBJECT_STORE}",
               # Ports of their own (the defaults may be taken by another Ray on this machine), given rather
               # than left to the agents: the raylet then does not wait for their port files (see netns.AGENT_PORTS).
               *(f"--{flag}={free_port(HEAD_IP)}" for flag in (
                   "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                   "runtime-env-agent-port", "metrics-export-port")),
               f"--temp-dir={self.temp_dir}", "--disable-usage-stats", "--block",
               f"--system-config={json.dumps(HEALTH)}"]
        with open(os.path.join(self.temp_dir, "head.log"), "ab") as log:
            self.head = subprocess.Popen(cmd, env={**os.environ, **NODE_ENV}, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        address = f"{HEAD_IP}:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the GCS answers
            if self.head.poll() is not None:
                raise RuntimeError(f"the head node did not start; see {self.temp_dir}/head.log")
            try:
                socket.create_connection((HEAD_IP, port), timeout=1).close()
                return address
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the head node's GCS did not listen on {address} within 60 s")

    def add_node(self, n: int) -> str:
        """Node ``n``: namespace etr-nN at 10.213.0.(10+N) and a Ray node with ``node_cpus`` CPUs in it."""
        ns = node_ns(n)
        netns.create_node_netns(ns, node_ip(n))
        self._start_node(n)
        return ns

    def _start_node(self, n: int) -> None:
        ns = node_ns(n)
        # A temp dir per node: nodes that start at once in one session dir may pick the same socket names.
        self.nodes[n] = netns.start_ray_node(
            ns, self.address, node_ip(n), self.node_cpus, temp_dir=os.path.join(self.temp_dir, ns), env=NODE_ENV,
            extra=(f"--object-store-memory={OBJECT_STORE}",), log_path=os.path.join(self.temp_dir, f"{ns}.log"))

    def _connect(self) -> None:
        import ray

        ray.init(address=self.address, _node_ip_address=HEAD_IP, namespace="etrain", log_to_driver=False,
                 logging_level="warning")

    def wait_for_nodes(self, count: int, timeout: float = 180.0, restarts: int = 2) -> None:
        """Until ``count`` nodes are alive. A node whose ``ray start`` gave up is started again (up to
        ``restarts`` times): on a loaded machine a raylet stops waiting for its agents' Python processes
        to start ("Timed out waiting for file .../dashboard_agent_listen_port_...")."""
        import ray

        deadline = time.monotonic() + timeout
        left = {n: restarts for n in self.nodes}
        while time.monotonic() < deadline:
            if sum(1 for n in ray.nodes() if n["Alive"]) >= count:
                return
            for n, proc in list(self.nodes.items()):
                if proc.poll() is not None and left.get(n, 0) > 0:
                    left[n] -= 1
                    print(f"netns cluster: the Ray node of {node_ns(n)} did not start (see "
                          f"{self.temp_dir}/{node_ns(n)}.log); starting it again", file=sys.stderr)
                    netns.end_processes(node_ns(n))
                    self._start_node(n)
            time.sleep(0.5)
        raise RuntimeError(f"{count} Ray nodes did not come up within {timeout:.0f} s; logs in {self.temp_dir}")

    def remove_node(self, n: int) -> None:
        """Node ``n``'s processes (all of them: they run in its namespace), its namespace and link."""
        netns.delete_node_netns(node_ns(n))
        proc = self.nodes.pop(n, None)
        if proc is not None:
            proc.wait(10)

    def shutdown(self) -> None:
        """Disconnect, end every process this cluster started and remove what it created; never raises."""
        import ray

        ray.shutdown()
        for n in list(self.nodes):
            try:
                self.remove_node(n)
            except (netns.NetnsError, subprocess.TimeoutExpired) as e:
                print(f"netns cluster: removing node {n}: {e}", file=sys.stderr)
        if self.head is not None and self.head.poll() is None:
            self.head.terminate()  # `ray start --block` stops the head's processes on SIGTERM
            try:
                self.head.wait(30)
            except subprocess.TimeoutExpired:
                self.head.kill()
        self._end_leftovers()
        if self.bridge:
            try:
                netns.delete_bridge(netns.BRIDGE)
            except netns.NetnsError as e:
                print(f"netns cluster: {e}", file=sys.stderr)
        if not self.keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _end_leftovers(self) -> None:
        """Processes of this cluster still running after the head stopped (found by its private temp dir)."""
        mine = []
        for pid in procfs.pids():
            try:
                if pid != os.getpid() and any(self.temp_dir in arg for arg in procfs.cmdline(pid)):
                    mine.append(pid)
            except OSError:
                pass
        procfs.signal_each(mine, signal.SIGKILL)
