"""Ray nodes in Linux network namespaces: a link per node that ``etrain chaos`` can cut (``partition_node``).

On one machine every Ray node normally shares the loopback interface, so there is no link between two
nodes to cut. A node started in a network namespace of its own reaches the rest of the cluster only
through a veth pair whose host end is a port of a bridge: bringing that end down cuts the node off while
its processes keep running; bringing it up heals the partition. As root, on the machine:

    python -m orchestrator.chaos.netns bridge             # etr-br0 with 10.213.0.1/24 (the head's address)
    ray start --head --node-ip-address=10.213.0.1 --port=6379 --num-cpus=0
    python -m orchestrator.chaos.netns node etr-n1 10.213.0.11 --address=10.213.0.1:6379 --num-cpus=1
    ...                                                   # the node runs until Ctrl-C (ray start --block)
    python -m orchestrator.chaos.netns down etr-n1        # its processes, namespace and link
    python -m orchestrator.chaos.netns down --bridge      # the bridge, once every node is down

``node`` creates namespace ``etr-n1`` with ``eth0`` at 10.213.0.11/24 (the peer of ``etr-n1-h``, a port of
the bridge), loopback up, a default route through the bridge and a resolv.conf that fails lookups at
once (/etc/netns/etr-n1/resolv.conf, unless one is there), then runs ``ray start --address=...
--node-ip-address=10.213.0.11 --num-cpus=N --block`` inside it with ``ip netns exec``, with
``GLOO_SOCKET_IFNAME=eth0``. Everything the node uses must be reachable from the namespace: the head
at its bridge address (never 127.0.0.1, which is the namespace's own loopback), the run store and
checkpoints on a filesystem path (``file://``, shared by every namespace of the machine) or a server
on a bridge address.

``etrain chaos`` finds a rank's namespace from its worker's pid (:func:`node_link`) and cuts and heals
the host end of its link (:func:`set_link`) from the host namespace, so it must run on the machine of
the namespaces, as root.

Invariants: a node's link is the veth pair ``NAME-h`` (host end, a port of the bridge) / ``eth0`` (in
the namespace); a namespace half made is undone before the error is raised; ``down`` ends the processes
before it removes the namespace (which outlives its name while a process is in it) and removes only the
resolv.conf files this module wrote. Every failure of ``ip`` is a NetnsError that says what to do.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from checkpointing.errors import EtrainError

from . import procfs

BRIDGE = "etr-br0"
BRIDGE_CIDR = "10.213.0.1/24"
NETNS_DIR = "/run/netns"  # where `ip netns add` names namespaces
NETNS_ETC = "/etc/netns"  # files `ip netns exec` mounts over /etc in the namespace of the same name
# The module's old name, kept: resolv.conf files written under it are still recognised as ours.
RESOLV_MARK = "# written by orchestrator.netns"
NODE_IF = "eth0"  # a node's end of its link, inside its namespace
HOST_SUFFIX = "-h"  # the host end of a node's veth is named after its namespace
IFNAME_MAX = 15  # Linux interface names
# A namespace has ports of its own, so a node's agents can listen on fixed ones. With the default (0,
# any port) the raylet waits for each agent to write the port it took to a file, and gives up (the node
# fails to start) when a loaded machine takes too long to start the agents' Pythons.
AGENT_PORTS = ("--dashboard-agent-grpc-port=52366", "--dashboard-agent-listen-port=52365",
               "--runtime-env-agent-port=52367", "--metrics-export-port=52368")


class NetnsError(EtrainError):
    """A namespace, link or bridge could not be created, found or changed."""


# --- ip(8) ---------------------------------------------------------------------------------------


def ip(*args: str) -> str:
    """``ip ARGS``; NetnsError with its message when it fails (not root, a name taken, ...)."""
    if shutil.which("ip") is None:
        raise NetnsError("the `ip` command (iproute2) is not installed")
    p = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if p.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {p.stderr.strip() or p.returncode}")
    return p.stdout


def ip_json(*args: str) -> list[dict]:
    out = ip("-j", *args).strip()
    return json.loads(out) if out else []


def namespaces() -> list[str]:
    return [n["name"] for n in ip_json("netns", "list")]


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def addresses(ns: str | None = None) -> set[str]:
    """The IPv4 addresses of namespace ``ns`` (None: this process's namespace)."""
    rows = ip_json(*(["-n", ns] if ns else []), "-4", "addr", "show")
    return {a["local"] for r in rows for a in r.get("addr_info", []) if "local" in a}


def can_create_namespaces() -> str | None:
    """None when this process may create network namespaces and veth pairs, else why not."""
    probe = f"etr-probe{os.getpid() % 100000}"
    try:
        ip("netns", "add", probe)
    except NetnsError as e:
        return str(e)
    try:
        ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
    except NetnsError as e:
        return str(e)
    finally:
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


# --- the bridge and the namespaces ----------------------------------------------------------------


def create_bridge(name: str = BRIDGE, cidr: str = BRIDGE_CIDR) -> None:
    """A bridge in the host namespace with ``cidr``, the address of the head and the nodes' gateway."""
    if link_exists(name):
        raise NetnsError(f"link {name} exists already; remove it (`python -m orchestrator.chaos.netns down "
                         f"--bridge --bridge-name {name}`) or choose another name")
    ipaddress.ip_interface(cidr)  # ValueError names a malformed address
    ip("link", "add", name, "type", "bridge", "forward_delay", "0")
    ip("addr", "add", cidr, "dev", name)
    ip("link", "set", name, "up")


def delete_bridge(name: str = BRIDGE) -> None:
    if link_exists(name):
        ip("link", "del", name)


def bridge_interface(name: str = BRIDGE) -> ipaddress.IPv4Interface:
    rows = ip_json("-4", "addr", "show", "dev", name) if link_exists(name) else []
    for a in (rows[0].get("addr_info", []) if rows else []):
        return ipaddress.IPv4Interface(f"{a['local']}/{a['prefixlen']}")
    raise NetnsError(f"bridge {name} does not exist or has no IPv4 address; create it first: "
                     "`python -m orchestrator.chaos.netns bridge`")


def host_end(ns: str) -> str:
    return f"{ns}{HOST_SUFFIX}"


def create_node_netns(ns: str, address: str, *, bridge: str = BRIDGE) -> str:
    """Namespace ``ns`` with ``eth0`` at ``address`` on the bridge's subnet, loopback up and a default
    route through the bridge; returns the host end of its link. Undone by :func:`delete_node_netns`."""
    if len(host_end(ns)) > IFNAME_MAX:
        raise NetnsError(f"namespace name {ns!r} is too long: its link {host_end(ns)!r} must have at most "
                         f"{IFNAME_MAX} characters")
    gw = bridge_interface(bridge)
    if ipaddress.ip_address(address) not in gw.network or ipaddress.ip_address(address) == gw.ip:
        raise NetnsError(f"{address} must be a free address of the bridge's subnet {gw.network} (the bridge "
                         f"has {gw.ip})")
    if ns in namespaces() or link_exists(host_end(ns)):
        raise NetnsError(f"namespace {ns} or link {host_end(ns)} exists already; remove them first: "
                         f"`python -m orchestrator.chaos.netns down {ns}`")
    link = host_end(ns)
    ip("netns", "add", ns)
    try:
        ip("link", "add", link, "type", "veth", "peer", "name", NODE_IF, "netns", ns)
        ip("link", "set", link, "master", bridge)
        ip("link", "set", link, "up")
        ip("-n", ns, "addr", "add", f"{address}/{gw.network.prefixlen}", "dev", NODE_IF)
        ip("-n", ns, "link", "set", NODE_IF, "up")
        ip("-n", ns, "link", "set", "lo", "up")  # Ray's processes also talk over the node's own loopback
        ip("-n", ns, "route", "add", "default", "via", str(gw.ip))
        write_resolv_conf(ns)
    except (NetnsError, OSError):
        delete_node_netns(ns)
        raise
    return link


def write_resolv_conf(ns: str) -> None:
    """``/etc/netns/NS/resolv.conf``, which ``ip netns exec`` mounts over /etc/resolv.conf: a name server
    on the namespace's own loopback, where none listens, so that every lookup fails at once.

    The machine's name server is out of the namespace's reach (the machine does not route for it), and
    torch's TCPStore looks up the name of its own and its peers' addresses: each lookup waited for the
    resolver's timeout, 10 s per re-formation here. A resolv.conf already there (one that names a server
    the namespace can reach) is kept."""
    path = os.path.join(NETNS_ETC, ns, "resolv.conf")
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{RESOLV_MARK}: no name server is reachable from this namespace; fail lookups at once\n"
                "nameserver 127.0.0.1\n")


def _remove_resolv_conf(ns: str) -> None:
    """The resolv.conf :func:`write_resolv_conf` wrote (never one it did not), and the folders if empty."""
    path = os.path.join(NETNS_ETC, ns, "resolv.conf")
    try:
        with open(path) as f:
            if f.read().startswith(RESOLV_MARK):
                os.remove(path)
    except FileNotFoundError:
        pass
    for d in (os.path.dirname(path), NETNS_ETC):
        try:
            os.rmdir(d)
        except OSError:  # not empty (someone else's files), or gone
            pass


def pids_in(ns: str) -> list[int]:
    """The processes that run in namespace ``ns``."""
    try:
        st = os.stat(os.path.join(NETNS_DIR, ns))
    except FileNotFoundError:
        return []
    out = []
    for pid in procfs.pids():
        try:
            s = os.stat(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            out.append(pid)
    return out


def delete_node_netns(ns: str, *, kill: bool = True, timeout_s: float = 10.0) -> None:
    """End the processes still in ``ns`` (SIGTERM, then SIGKILL after ``timeout_s``), remove its link and
    the namespace. A namespace outlives its name while a process is in it; hence the processes first."""
    if kill:
        end_processes(ns, timeout_s)
    if link_exists(host_end(ns)):
        ip("link", "del", host_end(ns))  # the pair goes with either end
    if ns in namespaces():
        ip("netns", "del", ns)
    _remove_resolv_conf(ns)


def end_processes(ns: str, timeout_s: float = 10.0) -> None:
    """End every process in namespace ``ns``: SIGTERM, then SIGKILL to those left after ``timeout_s``."""
    pids = pids_in(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procfs.signal_each(pids, sig)
        deadline = time.monotonic() + timeout_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if not procfs.gone(p)]
            time.sleep(0.1)
        if not pids:
            return


# --- Ray nodes -----------------------------------------------------------------------------------


def ray_node_command(ns: str, head: str, address: str, num_cpus: int, *, temp_dir: str | None = None,
                     extra: tuple[str, ...] = ()) -> list[str]:
    """``ip netns exec NS ray start --address=HEAD --node-ip-address=ADDRESS --num-cpus=N --block``."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = ["ip", "netns", "exec", ns, ray if os.path.exists(ray) else "ray", "start", f"--address={head}",
           f"--node-ip-address={address}", f"--num-cpus={num_cpus}", "--block", "--disable-usage-stats",
           *AGENT_PORTS]
    if temp_dir:
        cmd.append(f"--temp-dir={temp_dir}")
    return [*cmd, *extra]


def start_ray_node(ns: str, head: str, address: str, num_cpus: int, *, temp_dir: str | None = None,
                   extra: tuple[str, ...] = (), env: dict | None = None, log_path: str | None = None):
    """The Ray node of namespace ``ns`` (created already), as a process of its own session; ending it
    (SIGTERM) stops the node, as Ctrl-C on ``ray start --block`` does."""
    with open(log_path, "ab") if log_path else contextlib.nullcontext(subprocess.DEVNULL) as out:
        return subprocess.Popen(ray_node_command(ns, head, address, num_cpus, temp_dir=temp_dir, extra=extra),
                                env=node_env(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def node_env(extra: dict | None = None) -> dict:
    """The environment of a namespaced node's ``ray start``, which its workers inherit.

    Gloo (and NCCL) bind to the address the machine's hostname resolves to, unless told an interface.
    In a namespace that address is not the node's (often 127.0.0.1, the namespace's own loopback: peers
    on other nodes are refused), so they are told ``eth0``, the node's end of its link."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.setdefault(var, NODE_IF)
    return {**env, **(extra or {})}


# --- partitions ------------------------------------------------------------------------------------


def namespace_of(pid: int) -> str | None:
    """The name (under /run/netns) of the network namespace process ``pid`` runs in; None when it is
    this process's own namespace. NetnsError when there is no such process here, or its namespace has
    no name."""
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except FileNotFoundError:
        raise NetnsError(f"no process {pid} on this machine") from None
    except PermissionError:
        raise NetnsError(f"cannot read the network namespace of process {pid}: run as root") from None
    own = os.stat("/proc/self/ns/net")
    if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
        return None
    for name in sorted(os.listdir(NETNS_DIR)) if os.path.isdir(NETNS_DIR) else []:
        s = os.stat(os.path.join(NETNS_DIR, name))
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            return name
    raise NetnsError(f"process {pid} runs in a network namespace that has no name under {NETNS_DIR} (a "
                     "container's?); start the node with `python -m orchestrator.chaos.netns node ...`")


def host_link(ns: str) -> str:
    """The host end (in this process's namespace) of the veth pair that connects namespace ``ns``."""
    ids = {n["name"]: n.get("id") for n in ip_json("netns", "list")}
    if ns not in ids:
        raise NetnsError(f"no network namespace {ns} under {NETNS_DIR}")
    inside = {r["ifindex"] for r in ip_json("-n", ns, "link", "show", "type", "veth")}
    ours = [r["ifname"] for r in ip_json("link", "show", "type", "veth")
            if ids[ns] is not None and r.get("link_netnsid") == ids[ns] and r.get("link_index") in inside]
    if len(ours) != 1:
        raise NetnsError(f"namespace {ns} has {len(ours)} veth links to this namespace, not 1: nothing (or "
                         "no one thing) to cut; set it up with `python -m orchestrator.chaos.netns node ...`")
    return ours[0]


def node_link(pid: int, node_ip: str) -> tuple[str, str]:
    """(namespace, host end of its link) of the Ray node at ``node_ip`` whose worker is process ``pid``.

    NetnsError says why there is none: the process is not on this machine, or its node shares this
    machine's network (no link of its own to cut)."""
    how = ("start that node in a network namespace of its own on this machine: `python -m "
           "orchestrator.chaos.netns node NAME ADDRESS --address=HEAD:PORT` (docs/chaos.md, \"Network partitions\")")
    try:
        ns = namespace_of(pid)
    except NetnsError as e:
        raise NetnsError(f"{e}: partition_node cuts the links of nodes that run in network namespaces on the "
                         f"machine where `etrain chaos` runs; {how}") from None
    if ns is None:
        where = "on this machine" if node_ip in addresses() else f"at {node_ip}"
        raise NetnsError(f"the node {where} shares the network namespace of `etrain chaos` (this machine's "
                         f"network): it has no link of its own to cut; {how}")
    if node_ip not in addresses(ns):
        raise NetnsError(f"process {pid} runs in namespace {ns}, which does not have the node's address "
                         f"{node_ip}: it is not that node's worker (is the node on another machine?)")
    return ns, host_link(ns)


def set_link(link: str, up: bool) -> None:
    """Bring the host end of a node's link up (heal) or down (cut: the node's packets go nowhere, its
    connections stay open and silent, as across a failed switch)."""
    ip("link", "set", "dev", link, "up" if up else "down")


# --- the command ----------------------------------------------------------------------------------


def run_node(args) -> int:
    """``node``: the namespace, and its Ray node until Ctrl-C or SIGTERM, which end the node (``ray start``
    drains it first) and then remove the namespace."""
    link = create_node_netns(args.name, args.address, bridge=args.bridge_name)
    print(f"namespace {args.name} at {args.address} (link {link}); starting its Ray node", flush=True)
    temp_dir = args.temp_dir or os.path.join(tempfile.gettempdir(), f"ray-{args.name}")

    def stop(signum, frame):
        raise KeyboardInterrupt

    # Both signals, explicitly: a shell starts background commands with SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    proc = subprocess.Popen(ray_node_command(args.name, args.head, args.address, args.num_cpus, temp_dir=temp_dir),
                            env=node_env(), start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()  # `ray start --block` stops its node on SIGTERM
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            return 1  # its processes end with the namespace below
    finally:
        if not args.keep:
            delete_node_netns(args.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.chaos.netns",
                                description="Ray nodes in network namespaces, for partition_node chaos (as root)")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bridge", help="create the bridge the namespaces connect to")
    b.add_argument("--bridge-name", default=BRIDGE)
    b.add_argument("--cidr", default=BRIDGE_CIDR, help="the bridge's address: the head's and the gateway")
    n = sub.add_parser("node", help="create namespace NAME at ADDRESS and run a Ray node in it until Ctrl-C")
    n.add_argument("name")
    n.add_argument("address")
    n.add_argument("--address", dest="head", required=True, help="the head's GCS, HOST:PORT on the bridge")
    n.add_argument("--num-cpus", type=int, required=True)
    n.add_argument("--bridge-name", default=BRIDGE)
    n.add_argument("--temp-dir", help="Ray's temp dir for this node (default /tmp/ray-NAME: nodes that start "
                                      "at once in one session dir may take the same socket names)")
    n.add_argument("--keep", action="store_true", help="keep the namespace when the node ends")
    d = sub.add_parser("down", help="end a namespace's processes, remove it and its link (or the bridge)")
    d.add_argument("names", nargs="*")
    d.add_argument("--bridge", action="store_true", help="remove the bridge too")
    d.add_argument("--bridge-name", default=BRIDGE)
    args = p.parse_args(argv)
    try:
        if args.cmd == "bridge":
            create_bridge(args.bridge_name, args.cidr)
            print(f"bridge {args.bridge_name} at {args.cidr}")
        elif args.cmd == "node":
            return run_node(args)
        else:
            for name in args.names:
                delete_node_netns(name)
            if args.bridge:
                delete_bridge(args.bridge_name)
    except NetnsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
