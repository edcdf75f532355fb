"""Verified snapshots in host memory: the steps a run can roll back to, as a sparse ring.

    ring = VerifiedRing(depth=3, every=16)
    ring.add(step, leaves, extra)          # a copy of each leaf's local shard, with its digest
    for snap in ring.newest_first(): ...   # the newest verified step, then older ones (faults found late)
    snap.restore(leaves)                   # copies back into the live tensors (each copy's digest checked first)

Slot ``i`` holds the newest verified step whose check number (step / every) is a multiple of 16**i (or,
until there is one, the first verified step):
with a check every 16 steps and depth 3, the newest check (N), the newest of every 16th (at most 256
steps back) and of every 256th (4096). Slots that name the same step share one copy, so memory is
between one and ``depth`` copies of the local state. A copy is only ever of a verified step and is read
back only after its digests are checked again (host memory can flip bits too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .digest import digest, local

SPACING = 16


@dataclass
class Snapshot:
    step: int
    tensors: list[torch.Tensor]  # host copies of each leaf's local shard, in leaf order
    digests: list[int]  # of the copies when made
    extra: dict = field(default_factory=dict)  # the trainer's state at that step (cursor, windows, skips)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def intact(self) -> bool:
        return all(digest(t) == d for t, d in zip(self.tensors, self.digests))

    def restore(self, leaves: list[tuple[str, torch.Tensor]]) -> None:
        if len(leaves) != len(self.tensors):
            raise ValueError(f"a snapshot of {len(self.tensors)} tensors cannot restore {len(leaves)}")
        for (_, live), saved in zip(leaves, self.tensors):
            local(live).copy_(saved, non_blocking=False)


class VerifiedRing:
    def __init__(self, depth: int, every: int):
        self.depth = depth
        self.every = max(1, every)
        self.slots: list[Snapshot | None] = [None] * depth

    def add(self, step: int, leaves: list[tuple[str, torch.Tensor]], extra: dict) -> Snapshot:
        """A verified step's copy, each tensor's digest taken of the copy."""
        copies = [_host_copy(local(t)) for _, t in leaves]
        snap = Snapshot(step, copies, [digest(c) for c in copies], dict(extra))
        check = step // self.every
        for i in range(self.depth):
            if i == 0 or check % (SPACING ** i) == 0 or self.slots[i] is None:
                self.slots[i] = snap
        return snap

    def newest_first(self) -> list[Snapshot]:
        seen, out = set(), []
        for s in self.slots:
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                out.append(s)
        return sorted(out, key=lambda s: -s.step)

    def newest(self) -> Snapshot | None:
        snaps = self.newest_first()
        return snaps[0] if snaps else None

    def drop_after(self, step: int) -> None:
        """Forget snapshots newer than ``step`` (found bad: a fault older than their check)."""
        self.slots = [s if s is not None and s.step <= step else None for s in self.slots]

    def clear(self) -> None:
        self.slots = [None] * self.depth

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.newest_first())


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.detach().clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    out.copy_(t.detach())  # blocking: the copy is the verified state, read back only after its check
    return out
