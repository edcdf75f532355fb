"""Who this process is in the job, and its process group.

    world = World.from_env()                   # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
    init_distributed(world, device)            # gloo on CPU, NCCL on CUDA
    ...
    shutdown_distributed()

Launcher-agnostic: torchrun, a Ray actor or a test harness only has to set
the usual environment variables (or pass a ``World`` built by hand). A single
process with no launcher gets a one-rank group on an in-memory store, so the
training code has no special case for world size 1.

Where the process group listens (docs/operations.md#ports): rank 0's
rendezvous store on ``MASTER_ADDR`` only (:func:`listening_store`; torch's own
store listens on every interface whatever host it is given), and the gloo and
NCCL sockets of every group on the loopback interface when the job is local
(``MASTER_ADDR`` is a loopback address, or one process with none): see
:func:`collectives_on_loopback`.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpointing.errors import ConfigError

log = logging.getLogger("etrain")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @classmethod
    def from_env(cls) -> World:
        def num(name: str, default: int) -> int:
            raw = os.environ.get(name)
            if raw is None:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None

        size = num("WORLD_SIZE", 1)
        rank = num("RANK", 0)
        if not 0 <= rank < size:
            raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={size}")
        port = os.environ.get("MASTER_PORT")
        return cls(rank=rank, size=size, local_rank=num("LOCAL_RANK", rank),
                   master_addr=os.environ.get("MASTER_ADDR"), master_port=int(port) if port else None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(world: World, device: torch.device, *, store: dist.Store | None = None,
                     timeout_s: float = 300.0) -> None:
    """Create the default process group for ``world`` (gloo or NCCL by device)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend_for(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if (world.master_addr is None and world.size == 1) or (world.master_addr and is_loopback(world.master_addr)):
        collectives_on_loopback()
    if store is None and world.size == 1 and world.master_addr is None:
        store = dist.HashStore()
    if store is None:
        if world.master_addr is None or world.master_port is None:
            raise ConfigError("MASTER_ADDR and MASTER_PORT must be set for a multi-process run (torchrun sets them)")
        if _under_torchrun(world) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = _agent_store(world, timeout)
        elif world.is_main:
            store = listening_store(world.master_addr, world.master_port, timeout, world_size=world.size)
        else:
            store = dist.TCPStore(world.master_addr, world.master_port, world.size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size, timeout=timeout, **kwargs)
    global _exit_hook
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_free_groups_at_exit)


def listening_store(addr: str, port: int, timeout: datetime.timedelta, *,
                    world_size: int | None = None) -> dist.TCPStore:
    """A rendezvous store (the server side) that listens on ``addr`` only, at ``port`` (0: a free one).

    ``dist.TCPStore(addr, ...)`` would listen on every interface (0.0.0.0 / ::) whatever ``addr``
    says; a socket bound here and handed over (``master_listen_fd``, which the store then owns and
    closes) keeps the store to the address its peers dial.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=sock.detach())


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (an IP address or a host name) is this machine's loopback."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        pass
    try:
        return all(ipaddress.ip_address(ai[4][0]).is_loopback for ai in socket.getaddrinfo(addr, None))
    except (OSError, ValueError):
        return False


def collectives_on_loopback() -> None:
    """Make the gloo and NCCL groups this process creates listen on the loopback interface, for a
    job whose ranks all run on this machine: by default gloo listens on the address the machine's
    host name resolves to and NCCL on its first network interface, both reachable from the
    network. ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set by the user are left as they are."""
    lo = loopback_interface()
    if lo is None:
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, lo)


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux), None if it cannot be told."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read().strip(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
        except (OSError, ValueError):
            continue
    return next((n for n in names if n in ("lo", "lo0")), None)


def _agent_store(world: World, timeout: datetime.timedelta) -> dist.Store:
    """The torchrun agent's store, under a prefix of this restart's own.

    The agent serves one store at MASTER_PORT for the whole job, and its static
    rendezvous (torchrun's default with ``--master_addr``) keeps the same keys
    across restarts. Process groups key their rendezvous by group name, which
    is the same in every attempt, so a restarted rank would read the address
    of a peer from before the restart (the process that was killed) and fail
    with "connection refused", or wait on a barrier counter already spent.
    A prefix per ``TORCHELASTIC_RESTART_COUNT`` gives every attempt fresh keys.
    """
    client = dist.TCPStore(world.master_addr, world.master_port, world.size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"etrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def _under_torchrun(world: World) -> bool:
    """Whether ``world`` is the one torchrun (its elastic agent) set up in this process's environment."""
    env = os.environ
    return ("TORCHELASTIC_RUN_ID" in env and env.get("MASTER_ADDR") == world.master_addr
            and env.get("MASTER_PORT") == str(world.master_port) and env.get("RANK") == str(world.rank))


def shutdown_distributed(background: bool = False) -> None:
    """Leave every process group of this process (torch forgets them, and shuts NCCL's communicators down,
    before this returns).

    ``background``: the groups' objects are freed by a thread of their own (a process that lives on and
    joins a new group next: a re-formed TrainWorker). Freeing a gloo group joins its threads and closes
    its connections, 15-25 ms of a recovery's path on 2 cores here; the new group need not wait for it.
    """
    global _freeing
    if dist.is_initialized():
        groups = _process_groups() if background else []
        dist.destroy_process_group()
        if groups:  # the last references: the groups' destructors (which release the GIL) run in the thread
            join_freeing()
            _freeing = threading.Thread(target=groups.clear, name="etrain-free-groups", daemon=True)
            _freeing.start()
    forget_meshes()


_freeing: threading.Thread | None = None
_exit_hook = False


def _free_groups_at_exit() -> None:
    """Free every process group while the interpreter still runs (atexit). A gloo group's threads live as long
    as the group object, which the model's FSDP state and meshes still hold after ``shutdown_distributed``; one
    of them finishing a collective's bookkeeping (dropping a tensor: it takes the GIL) while the interpreter
    finalizes is ended by Python inside C++, and the process aborts ("terminate called without an active
    exception", exit -6) after a run that succeeded. By now the trainer is unreferenced: a collection frees the
    groups left (``shutdown_distributed``), whose destructors join their threads. A group still initialized is
    left to torch (the order of its NCCL communicators' shutdown is torch's)."""
    join_freeing()
    gc.collect()


def join_freeing(timeout: float | None = None) -> None:
    """Wait for the groups left by ``shutdown_distributed(background=True)`` to be freed."""
    if _freeing is not None:
        _freeing.join(timeout)


def abort_groups() -> int:
    """Abort every process group of this process, newest first: under NCCL its communicators, inside one NCCL
    group call (as torch's own abort of all groups: aborts of several communicators must not wait on each
    other). A thread blocked in a collective of any of them (the default group, or a mesh's TP, PP, HSDP, CP or
    expert group) raises. Torch's maps are left as they are, so that thread leaves the groups as usual
    (:func:`shutdown_distributed`); from any thread. Returns how many groups were aborted."""
    if not dist.is_initialized():
        return 0
    groups = _process_groups() or [dist.group.WORLD]
    nccl = None
    if dist.is_nccl_available() and torch.cuda.is_available():
        try:
            backend = dist.group.WORLD._get_backend(torch.device("cuda"))
            nccl = backend if isinstance(backend, dist.ProcessGroupNCCL) else None
        except RuntimeError:  # no CUDA backend in the default group
            pass
    if nccl is not None:
        nccl._group_start()
    try:
        for pg in groups:
            try:
                pg.abort()
            except RuntimeError as e:  # left meanwhile by the thread that was blocked: the others still
                log.debug("abort of a process group failed: %s", e)
    finally:
        if nccl is not None:
            nccl._group_end()
    return len(groups)


def visible_device_index(gpu_id: str, visible: str | None) -> int:
    """The local CUDA device index of the GPU a scheduler (Ray) calls ``gpu_id``, given ``CUDA_VISIBLE_DEVICES``
    (``visible``: ordinals or UUIDs, None when unset): its place in that list, or the ordinal itself when every
    GPU is visible. ConfigError when it is not among the visible devices."""
    gpu_id = str(gpu_id).strip()
    if visible is None:
        if gpu_id.isdigit():
            return int(gpu_id)
        raise ConfigError(f"the GPU assigned ({gpu_id!r}) is not an ordinal and CUDA_VISIBLE_DEVICES is unset: "
                          "set CUDA_VISIBLE_DEVICES to the node's GPUs, or let Ray narrow it (unset "
                          "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)")
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if gpu_id in listed:
        return listed.index(gpu_id)
    raise ConfigError(f"the GPU assigned ({gpu_id!r}) is not in CUDA_VISIBLE_DEVICES={visible!r}: list it there, or "
                      "let Ray narrow it (unset RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)")


def _process_groups() -> list:
    """Every process group torch knows in this process, newest first (a private map of torch's, in 2.11 to
    2.13; none when a release moved it: the groups are then freed where torch drops them)."""
    try:
        from torch.distributed import distributed_c10d

        names = dict(distributed_c10d._world.pg_names)
    except AttributeError:
        return []
    return sorted(names, key=names.get, reverse=True)


def forget_meshes() -> None:
    """Drop DTensor's caches of sharding decisions, which hold the device meshes they were made on.

    Two meshes of the same shape and axis names compare equal even across process
    groups, so after a re-formation a cached decision would hand out the old
    mesh, with this rank's old coordinate and dead groups (DCP then sees two ranks
    claim one shard, and training diverges). A process that joins a new group
    must forget them: the Python cache of every thread (a fresh one replaces
    it) and the fast-path cache of the calling thread, which is the one that
    trains (TrainWorker runs all torch work on one thread).
    """
    try:  # private parts of torch 2.13's DTensor: say so if a later torch moved them
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
        from torch.distributed.tensor._sharding_prop import LocalLRUCache

        prop = DTensor._op_dispatcher.sharding_propagator
        prop.propagate_op_sharding = LocalLRUCache(prop.propagate_op_sharding_non_cached)
        torch._C._clear_DTensor_sharding_propagator_cache()
        clear_redistribute_planner_cache()
    except (ImportError, AttributeError) as e:
        log.warning("cannot drop DTensor's sharding caches with this torch (%s): a process that rejoins a "
                    "group under another rank may compute on its old meshes", e)


# Process groups outside the device mesh that carry an axis of their own (expert parallelism's exchange and
# its experts' FSDP groups): group name -> axis. Who makes such a group names it; the comm meter reads it.
_GROUP_AXES: dict[str, str] = {}


def name_group(group, axis: str) -> None:
    """Say that ``group`` (no mesh dimension) carries the collectives of ``axis`` (``etrain_comm_*{axis}``)."""
    _GROUP_AXES[group.group_name] = axis


def group_axis(group_name: str) -> str | None:
    """The axis :func:`name_group` gave the group ``group_name``; None when none did."""
    return _GROUP_AXES.get(group_name)
