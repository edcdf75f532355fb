"""Who this process is in the job, and its process group.

    world = World.from_env()                   # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
    init_distributed(world, device)            # gloo on CPU, NCCL on CUDA
    ...
    shutdown_distributed()

Launcher-agnostic: torchrun, a Ray actor or a test harness only has to set
the usual environment variables (or pass a ``World`` built by hand). A single
process with no launcher gets a one-rank group on an in-memory store, so the
training code has no special case for world size 1.
"""

from __future__ import annotations

import datetime
import logging
import os
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
    if store is None and world.size == 1 and world.master_addr is None:
        store = dist.HashStore()
    if store is not None:
        dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size, timeout=timeout,
                                **kwargs)
    else:
        if world.master_addr is None or world.master_port is None:
            raise ConfigError("MASTER_ADDR and MASTER_PORT must be set for a multi-process run (torchrun sets them)")
        if _under_torchrun(world) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=_agent_store(world, timeout), rank=world.rank,
                                    world_size=world.size, timeout=timeout, **kwargs)
            return
        init_method = "env://" if _under_torchrun(world) else f"tcp://{world.master_addr}:{world.master_port}"
        dist.init_process_group(backend, init_method=init_method, rank=world.rank, world_size=world.size,
                                timeout=timeout, **kwargs)


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


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_meshes()


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
