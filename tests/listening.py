"""What a process listens on, read from /proc (Linux), and rank jobs that report it.

    listening(pid)          # [("127.0.0.1", 41234), ("::1", 40001), ...]: its TCP sockets in LISTEN
    is_wildcard("::")       # True for 0.0.0.0 and ::, which every interface reaches
"""

from __future__ import annotations

import ipaddress
import os
import socket

_LISTEN = "0A"


def _address(hex_addr: str) -> tuple[str, int]:
    """``0100007F:1F90`` (/proc/net/tcp: 32-bit words in host byte order) -> ("127.0.0.1", 8080)."""
    ip_hex, port_hex = hex_addr.split(":")
    words = bytes.fromhex(ip_hex)
    packed = b"".join(words[i:i + 4][::-1] for i in range(0, len(words), 4))
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    ip = ipaddress.ip_address(socket.inet_ntop(family, packed))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port_hex, 16)


def listening(pid: int | None = None) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` (default: this one) holds in LISTEN."""
    pid = pid or os.getpid()
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _LISTEN and cols[9] in inodes:
                out.append(_address(cols[1]))
    return out


def is_wildcard(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_unspecified


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def group_listeners(_payload) -> dict:
    """A rank job (tests.harness.run_ranks): join the job's process group as launched (MASTER_ADDR,
    no torchrun), add a gloo group as the memory tier does, and say what this process listens on."""
    import torch
    import torch.distributed as dist

    from trainer.world import World, init_distributed, shutdown_distributed

    init_distributed(World.from_env(), torch.device("cpu"), timeout_s=60)
    try:
        extra = dist.new_group(backend="gloo")
        dist.barrier(group=extra)
        dist.barrier()
        return {"listening": listening(), "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    finally:
        shutdown_distributed()
