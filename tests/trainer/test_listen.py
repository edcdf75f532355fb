"""Where a run listens (docs/operations.md#ports, docs/security.md): never on every interface, and the
rendezvous of each epoch under a key only its members learn from the controller.

A run all of whose processes are on 127.0.0.1 listens on loopback only; the rendezvous store listens
on the address its peers are told to dial. Sockets are read from /proc (tests/listening.py).
"""

from __future__ import annotations

import datetime
import re
import time

import pytest
import torch.distributed as dist

from tests.harness import run_ranks
from tests.listening import is_loopback, is_wildcard, listening


def test_ranks_launched_with_master_addr_listen_on_loopback_only():
    """``python -m trainer`` ranks with MASTER_ADDR=127.0.0.1 (no torchrun): rank 0's rendezvous store
    listened on every interface (torch's TCPStore ignores the host it is given)."""
    out = run_ranks("tests.listening:group_listeners", 2, fresh=True, timeout=120)
    for rank, r in enumerate(out):
        assert r["listening"], f"rank {rank} listens on nothing: the test reads /proc wrongly"
        assert all(is_loopback(ip) for ip, _ in r["listening"]), (rank, r["listening"])
        assert r["gloo_ifname"], "gloo is not pinned to the loopback interface for a local job"


def test_controller_gives_every_epoch_a_rendezvous_key_of_its_own(tmp_path):
    """The controller draws a secret per epoch and hands it to the members' ``form``, nobody else."""
    from tests.fake_group import Fault
    from tests.orchestrator.test_controller import Rig

    r = Rig(tmp_path, workers=2, faults=[Fault(rank=1, step=3, kind="die")])
    try:
        r.drive()
        assert r.ctl.state.name == "FINISHED"
        forms = [(wid, args) for wid, method, args in r.group.log if method == "form"]
        by_epoch: dict[int, set] = {}
        for _, args in forms:
            assert len(args) == 9, f"form got no rendezvous key (or no plan and restore): {args}"
            by_epoch.setdefault(args[0], set()).add(args[6])
        assert len(by_epoch) >= 2
        keys = [k for ks in by_epoch.values() for k in ks]
        assert all(len(ks) == 1 for ks in by_epoch.values()), "the members of an epoch got different keys"
        assert len(set(keys)) == len(by_epoch), "two epochs share a rendezvous key"
        assert all(re.fullmatch(r"[0-9a-f]{32}", k) for k in keys), keys
        assert not any(k in str(e) for e in r.store.events("r") for k in keys), "a key is in the run's events"
    finally:
        r.close()


def test_worker_rendezvous_listens_on_its_node_address_under_the_epochs_key(tmp_path):
    """A TrainWorker's rendezvous store listened on 0.0.0.0 and keyed its epoch by the epoch number
    alone: whoever could reach the port could read, or plant first, the group's addresses."""
    import ray

    from orchestrator.workers.worker import TrainWorker
    from trainer.config.load import load_config

    cfg = load_config("examples/tiny.toml", ['data.max_bytes=200000', 'data.seq_len=16', "train.steps=2",
                                             f'checkpoint.url="file://{tmp_path}/ckpt"', "metrics.enabled=false"])
    w = TrainWorker(cfg, "w0", pg_timeout_s=30)
    node = ray.util.get_node_ip_address()
    port = w.rendezvous_port()
    try:
        mine = [ip for ip, p in listening() if p == port]
        assert mine == [node], f"the rendezvous store listens on {mine}, not on the node's address {node}"
        key = "5f" * 16
        w.form(1, 0, 1, node, port, None, key)
        stranger = dist.TCPStore(node, port, is_master=False, timeout=datetime.timedelta(seconds=10))
        gloo_key = "0//cpu//0/0"  # where rank 0 of the default group published its gloo address
        assert stranger.check([f"etrain/epoch_1/{key}/{gloo_key}"]), "the group did not meet under its key"
        assert not stranger.check([f"etrain/epoch_1/{gloo_key}"]), "the epoch's keys can be guessed"
    finally:
        w.leave()


@pytest.mark.ray
def test_a_local_run_listens_on_loopback_only(ray_cluster, tmp_path):
    """Every process of a local run (controller with its metrics endpoint, workers with their
    rendezvous, process groups and memory tier, and Ray's own on 127.0.0.1) listens on loopback
    only, and none on 0.0.0.0 or ::."""
    import psutil  # Ray's own copy, importable once ray is

    from tests.cluster import start_run

    run, _ = start_run(f"file://{tmp_path}/runs", workers=2)
    run.wait(lambda s: s["phase"] == "RUNNING" and s["step"] >= 2, what="two steps")
    nodes = [ray_cluster.cluster.head_node, *ray_cluster.cluster.worker_nodes]
    roots = [p.process.pid for n in nodes for ps in n.all_processes.values() for p in ps]
    procs = {}
    for pid in roots:
        try:
            top = psutil.Process(pid)
            for p in [top, *top.children(recursive=True)]:
                procs[p.pid] = " ".join(p.cmdline()[:2])[-60:]
        except psutil.NoSuchProcess:
            continue
    pids = {e_pid for e in run.events("formed") for e_pid in e["pids"]}
    assert pids <= set(procs), f"the workers {pids - set(procs)} are not in the cluster's process trees"
    found = {}
    for pid, name in procs.items():
        try:
            found[(pid, name)] = listening(pid)
        except OSError:  # ended meanwhile
            continue
    assert sum(len(v) for (pid, _), v in found.items() if pid in pids) >= 4, found
    bad = {k: v for k, v in found.items() if any(is_wildcard(ip) or not is_loopback(ip) for ip, _ in v)}
    assert not bad, f"listening beyond loopback: {bad}"
    run.close()  # kills the controller mid-run: its workers' placement groups must not outlive it
    import ray

    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        assert time.monotonic() < deadline, f"a killed run still holds {ray.available_resources()} of " \
                                            f"{ray.cluster_resources()}: {ray.util.placement_group_table()}"
        time.sleep(0.2)


def test_the_etcd_compose_file_publishes_its_ports_on_loopback_only():
    """deploy/etcd/docker-compose.yml published etcd's client port (no authentication) on every interface."""
    import ipaddress

    import yaml

    with open("deploy/etcd/docker-compose.yml") as f:
        services = yaml.safe_load(f)["services"]
    published = [(name, str(p)) for name, s in services.items() for p in s.get("ports", [])]
    assert len(published) == 3
    for name, port in published:
        host = port.rsplit(":", 2)[0] if port.count(":") == 2 else ""
        assert host and ipaddress.ip_address(host).is_loopback, f"{name} publishes {port!r} beyond loopback"
    for s in services.values():  # the peer port stays on the compose network
        assert not any(str(p).endswith(":2380") for p in s.get("ports", []))


@pytest.mark.parametrize("addr", ["999.1.1.1", "a b", "http://127.0.0.1", "[::1]", "node:9100"])
def test_a_garbage_metrics_addr_exits_2_naming_the_field(addr, capsys):
    from trainer.cli import main

    rc = main(["--config", "examples/tiny.toml", "--quiet", "--set", f'metrics.addr="{addr}"', "--set",
               "train.steps=1", "--set", "data.max_bytes=100000", "--set", 'checkpoint.url=""'])
    err = capsys.readouterr().err
    assert rc == 2 and "metrics.addr" in err and "Traceback" not in err, (rc, err)
