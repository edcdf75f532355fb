"""How ZeRO 1-2 cut parameters into per-rank chunks and group them into buckets for one collective each.

    start, length = chunk_bounds(size, n, r)        # torch.chunk's rule: chunk r of n along one dim
    buckets = make_buckets(slots, n, limit_bytes)   # consecutive slots, at most limit_bytes each
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .common import local_tensor


def chunk_bounds(size: int, n: int, r: int) -> tuple[int, int]:
    """(start, length) of chunk ``r`` of ``n`` along a dim of ``size`` (torch.chunk rule)."""
    cs = math.ceil(size / n) if size else 0
    start = min(r * cs, size)
    return start, max(0, min(cs, size - start))


@dataclass
class Slot:
    """One parameter as ZeRO sees it on this rank."""

    fqn: str
    param: nn.Parameter
    local: torch.Tensor  # the whole local tensor (the TP shard, if any)
    dim: int  # the dim ZeRO chunks
    starts: list[int]  # chunk start per shard rank
    lengths: list[int]  # chunk length per shard rank
    inner: int  # elements per index along ``dim``
    offset: int  # position in a rank's section of the packed buffer
    width: int  # elements reserved per rank for this parameter
    flat_offset: int  # position in the flat full-gradient buffer (stages 0/1)
    replicas: int  # identical copies of this rank's gradient chunk, world-wide
    decay: bool
    master: nn.Parameter | None = None  # what AdamW updates (a view of ``chunk`` in fp32)
    arrived: bool = False  # stage 2: its gradient waits in ``param.grad`` for the rest of its bucket

    def chunk(self, r: int) -> torch.Tensor:
        return self.local.narrow(self.dim, self.starts[r], self.lengths[r])

    def chunk_shape(self, r: int) -> torch.Size:
        s = list(self.local.shape)
        s[self.dim] = self.lengths[r]
        return torch.Size(s)


@dataclass
class Bucket:
    """Consecutive slots whose gradients are reduced, and parameters gathered, by one collective."""

    slots: list[Slot]
    lo: int  # its range in a rank's section
    hi: int
    ready: int = 0  # stage 2: slots whose gradient arrived since the bucket was last reduced
    reduced: bool = False  # stage 2: reduced into the shard at least once this step

    def region(self, row: torch.Tensor, s: Slot, r: int) -> torch.Tensor:
        """Chunk ``r`` of slot ``s`` inside one ``hi - lo`` row of a bucket buffer, in the chunk's shape."""
        k = s.offset - self.lo
        return row[k : k + s.lengths[r] * s.inner].view(s.chunk_shape(r))


def make_buckets(slots: list[Slot], n: int, limit_bytes: float) -> list[Bucket]:
    """Cut ``slots`` into runs of at most ``limit_bytes`` of packed fp32 gradient (``n`` chunks each), from
    the last backwards (about backward's order); a parameter larger than the limit is a bucket alone."""
    runs: list[list[Slot]] = []
    size = 0.0
    for s in reversed(slots):
        nbytes = 4 * n * s.width
        if not runs or size + nbytes > limit_bytes:
            runs.append([])
            size = 0.0
        runs[-1].append(s)
        size += nbytes
    return [Bucket(run[::-1], run[-1].offset, run[0].offset + run[0].width) for run in runs]


def local_grad(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The local tensor of gradient ``g`` in the placements of its parameter ``p`` (under TP the
    vocabulary-sharded embedding's can come back replicated at the full shape)."""
    if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
        with torch.no_grad():
            g = g.redistribute(p.device_mesh, p.placements)
    return local_tensor(g)
