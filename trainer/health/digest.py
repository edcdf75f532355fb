"""Digests of a rank's training state: a 64-bit hash of each tensor's bytes, and who should hold the same bytes.

    leaves = state_leaves(optimizer.checkpoint_state())     # [(key, tensor)], a fixed order per layout
    ids = [identity(key, t, rank) for key, t in leaves]     # equal on the ranks that hold the same shard
    d = digest(local_tensor(t))                             # int, 64 bits

The state is what a checkpoint holds (the optimizer's ``checkpoint_state()``: the parameters or their fp32
masters, and the AdamW moments), each rank's local shard of it. Two ranks hold the same bytes of a leaf when
their coordinates agree on every mesh axis the leaf is sharded over (a ``Replicate`` axis is a replica axis):
data-parallel replicas under ZeRO 0-2 and HSDP, the tensor-parallel ranks of a replicated norm. A plain
tensor is a global scalar (the AdamW step count) or, at world 1, the whole state.

On CPU the digest is xxh3-64 over the tensor's bytes (no copy); on a GPU it is computed on the device from
an integer view (a position-weighted sum and an xor-fold, 64 bits) and only the 8 bytes come to the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xxhash
from torch.distributed.tensor import DTensor, Replicate

Identity = tuple


def state_leaves(state: dict) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a ``checkpoint_state()`` with their keys (``model.<fqn>``, ``optim.<fqn>.<k>``), in order."""
    out: list[tuple[str, torch.Tensor]] = []

    def walk(prefix: str, v) -> None:
        if isinstance(v, torch.Tensor):
            out.append((prefix, v))
        elif isinstance(v, dict):
            for k, sub in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), sub)

    walk("", state)
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a leaf (a DTensor's local tensor, else the tensor), detached."""
    return (t._local_tensor if isinstance(t, DTensor) else t).detach()


def identity(key: str, t: torch.Tensor, rank: int) -> Identity:
    """What names the bytes this rank holds of leaf ``key``: equal on exactly the ranks that must hold equal bytes."""
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        coord = mesh.get_coordinate() or ()
        names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
        sharded = tuple((names[i], coord[i]) for i, p in enumerate(t.placements)
                        if not isinstance(p, Replicate) and i < len(coord))
        return (key, names, sharded)
    if t.numel() <= 1:
        return (key, "global")
    return (key, "rank", rank)  # a plain tensor at world > 1: nobody else is known to hold it


def digest(t: torch.Tensor) -> int:
    """A 64-bit digest of the tensor's bytes (its values bit for bit: -0.0 and 0.0 differ, so do two nans)."""
    t = t.detach()
    if t.device.type != "cpu":
        return _device_digest(t)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return 0
    return xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy())


def combine(digests: Iterable[int]) -> int:
    """One digest of many, in order."""
    h = xxhash.xxh3_64()
    for d in digests:
        h.update(int(d).to_bytes(8, "little"))
    return h.intdigest()


_MASK = (1 << 64) - 1


def _device_digest(t: torch.Tensor, chunk: int = 1 << 24) -> int:
    """On the device: the elements as integers of their own width, a position-weighted sum (odd weights from
    the position) and an xor-fold of (element + position), in chunks so the scratch stays bounded; 8 bytes
    come back."""
    flat = t.contiguous().reshape(-1)
    width = flat.element_size()
    ints = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]).to(torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    fold = torch.zeros((), dtype=torch.int64, device=t.device)
    for lo in range(0, ints.numel(), chunk):
        part = ints[lo : lo + chunk]
        pos = torch.arange(lo, lo + part.numel(), device=t.device, dtype=torch.int64)
        total += (part * (pos * 2654435761 * 2 + 1)).sum()
        mixed = (part + pos * 0x9E3779B97F4A7C15 % (1 << 61)) * 0x100000001B3
        fold ^= _xor_reduce(mixed)
    hi, lo_ = int(total.item()) & _MASK, int(fold.item()) & _MASK
    return xxhash.xxh3_64_intdigest(hi.to_bytes(8, "little") + lo_.to_bytes(8, "little") + bytes([width]))


def _xor_reduce(x: torch.Tensor) -> torch.Tensor:
    """The xor of every element (a halving tree of bitwise xors: torch has no xor reduction)."""
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, torch.zeros(1, dtype=x.dtype, device=x.device)])
        x = torch.bitwise_xor(x[0::2], x[1::2])
    return x.reshape(()) if x.numel() else torch.zeros((), dtype=torch.int64, device=x.device)
