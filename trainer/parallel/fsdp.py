"""ZeRO-3 as FSDP2: ``fully_shard`` per block, then the root; HSDP over a 2-D mesh.

The optimizer that steps FSDP2's sharded parameters is :class:`trainer.zero.fsdp.FSDPOptimizer`;
this module only wraps the modules.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import ParallelConfig
from .dims import resolve_precision


def shard_blocks(model: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, pcfg: ParallelConfig,
                 device: torch.device, pipelined: bool) -> None:
    """ZeRO-3: FSDP2 ``fully_shard`` per block, then the root (embedding, norm, head).

    A 2-D ``dp_mesh`` (dp_replicate, dp_shard) gives HSDP: sharded within
    dp_shard, replicated across dp_replicate. Under pipeline parallelism the
    parameters stay unsharded between forward and backward, since every
    micro-batch would otherwise all-gather them again.
    """
    from torch.distributed.fsdp import fully_shard

    policies = fsdp_policies(pcfg, device)
    # ZeRO++'s hpZ: after forward keep a secondary shard within groups of hpz_partition_size ranks (FSDP2's
    # reshard_after_forward=<int>), so backward all-gathers inside a group (a node) rather than across all.
    reshard: bool | int = (pcfg.hpz_partition_size or True) if not pipelined else False
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward.
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard if i < len(blocks) - 1 else False, **policies)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, **policies)


def fsdp_policies(pcfg: ParallelConfig, device: torch.device) -> dict:
    """``fully_shard``'s mixed-precision and offload policies for the run (every FSDP unit takes the same)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    mp = MixedPrecisionPolicy()
    if resolve_precision(pcfg, device) == torch.bfloat16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload: OffloadPolicy = OffloadPolicy()
    if pcfg.offload == "cpu":
        # On a CPU device the "host" copies are the same memory, but FSDP2 runs its offload path all the
        # same (copies in and out around each use), so the path is exercised without a GPU.
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return {"mp_policy": mp, "offload_policy": offload}
