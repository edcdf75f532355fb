"""ZeRO++ under ZeRO-3: quantized collectives plugged into FSDP2 (``set_custom_all_gather`` /
``set_custom_reduce_scatter``).

    install_fsdp_comms(fsdp_modules, cfg.parallel, shard_size)   # once, before the first forward

FSDP2 hands its custom all-gather one flat buffer per module: this rank's shards of every parameter
(``input``, a slice of ``output``), and ``output`` for every rank's. :class:`QuantizedAllGather` sends
them as int8 blocks (qwZ) and writes every rank's dequantized values into ``output``, this rank's own
slice included, so every replica computes with the same weights while the sharded fp32 parameter (the
master the optimizer updates) keeps full precision. With hpZ (``reshard_after_forward=<int>``, see
:mod:`trainer.parallel.fsdp`) the backward all-gather runs within the smaller group over the secondary
shard, which is a slice of the already dequantized weights: it goes unquantized, inside the group (the
fast link), and gives the very values of the forward.

:class:`QuantizedReduceScatter` is qgZ: the reduce-scatter input (one row per rank) as int8 rows by
one all-to-all, summed in fp32 by each receiver.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist


from .. import compat
from ..config import ParallelConfig
from .collectives import quantized_all_gather, quantized_reduce_scatter

log = logging.getLogger("etrain")


def comm_classes():
    """(QuantizedAllGather, QuantizedReduceScatter) on this torch's FSDP2 interfaces; ConfigError without them."""
    all_gather_base, reduce_scatter_base = compat.require_fsdp_comm_bases()

    class QuantizedAllGather(all_gather_base):
        """qwZ: FSDP2's parameter all-gather over the shard group as int8 blocks (other groups: as is)."""

        def __init__(self, block: int, shard_size: int):
            self.block, self.shard_size = block, shard_size
            self.warned = False

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            # hpZ's secondary group (smaller), or float8's uint8 inputs: not quantized here.
            if group.size() != self.shard_size or not output_tensor.is_floating_point():
                if not output_tensor.is_floating_point() and not self.warned:
                    log.warning("parallel.quantized_weights has no effect on float8 weights (already 1 byte each): "
                                "their all-gather goes as is")
                    self.warned = True
                return compat.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            quantized_all_gather(output_tensor, input_tensor, group, self.block)
            return None  # done: FSDP2 reads a None work as a finished all-gather

    class QuantizedReduceScatter(reduce_scatter_base):
        """qgZ: FSDP2's gradient reduce-scatter as an int8 all-to-all with an fp32 sum."""

        def __init__(self, block: int):
            self.block = block
            self.warned = False

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            avg = op == dist.ReduceOp.AVG
            if not (avg or op == dist.ReduceOp.SUM):
                if not self.warned:
                    log.warning("parallel.quantized_gradients: FSDP2 asked for reduce op %s; reduce-scattering "
                                "unquantized", op)
                    self.warned = True
                return compat.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group,
                                                    async_op=async_op)
            quantized_reduce_scatter(output_tensor, input_tensor, group, self.block)
            if avg:
                output_tensor.div_(group.size())
            return None

    return QuantizedAllGather, QuantizedReduceScatter


def install_fsdp_comms(modules, pcfg: ParallelConfig, shard_size: int, rank: int = 0) -> None:
    """Give each FSDP2 module ZeRO++'s collectives as ``pcfg`` asks (nothing when neither is on)."""
    if not (pcfg.quantized_weights or pcfg.quantized_gradients):
        return
    if shard_size < 2:
        if rank == 0:
            log.warning("parallel.quantized_weights / quantized_gradients have no effect: the ZeRO-3 shard group "
                        "has one rank (dp_shard=1), so nothing is all-gathered or reduce-scattered")
        return
    all_gather_cls, reduce_scatter_cls = comm_classes()
    for m in modules:
        if pcfg.quantized_weights:
            m.set_custom_all_gather(all_gather_cls(pcfg.quantization_block, shard_size))
        if pcfg.quantized_gradients:
            m.set_custom_reduce_scatter(reduce_scatter_cls(pcfg.quantization_block))
