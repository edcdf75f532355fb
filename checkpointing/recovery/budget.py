"""The memory tier's budget: how many host bytes one rank's tier may hold.

    budget = tier_budget(0, fraction=0.5, ranks_on_host=4, available=available_bytes())
    MemoryTier(..., memory_budget_bytes=budget.bytes)      # 0: no bound
    budget.describe()     # "1.2 GiB per rank (0.5 of 9.6 GiB available on this host, 4 ranks)"

``[recovery] memory_budget_bytes`` (docs/operations.md#recovery-tiers):

* ``0`` (the default): derived when the group forms, on each rank's host:
  ``memory_budget_fraction`` (0.5) of the memory available to the tier, shared
  equally by the ranks of the group on that host. The memory available is the
  kernel's ``MemAvailable`` (``/proc/meminfo``), or less where the process's
  cgroup (a container, a Kubernetes pod) has a lower limit, plus what this
  worker already holds of the tier (snapshots kept from the group before,
  which ``MemAvailable`` no longer counts). Where the host's memory cannot be
  read the tier has no bound, and says so.
* ``> 0``: that many bytes per rank.
* ``-1``: no bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_FRACTION = 0.5
NO_BOUND = -1
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class Budget:
    """What the tier of one rank may hold: ``bytes`` (0: no bound) and how that was decided."""

    bytes: int
    how: str  # "derived", "explicit", "none" (asked for no bound), "unknown" (the host's memory could not be read)
    available_bytes: int | None = None
    ranks_on_host: int = 1
    fraction: float = DEFAULT_FRACTION

    def describe(self) -> str:
        if self.how == "explicit":
            return f"{human_bytes(self.bytes)} per rank (memory_budget_bytes)"
        if self.how == "none":
            return "no bound (memory_budget_bytes = -1)"
        if self.how == "unknown":
            return "no bound: this host's available memory could not be read (set memory_budget_bytes)"
        return (f"{human_bytes(self.bytes)} per rank ({self.fraction:g} of {human_bytes(self.available_bytes or 0)} "
                f"available on its host, {self.ranks_on_host} rank{'s' if self.ranks_on_host != 1 else ''})")

    def to_dict(self) -> dict:
        return {"budget_bytes": self.bytes, "budget": self.how, "available_bytes": self.available_bytes,
                "ranks_on_host": self.ranks_on_host, "fraction": self.fraction}


def tier_budget(setting: int, fraction: float = DEFAULT_FRACTION, ranks_on_host: int = 1, held_bytes: int = 0,
                available: int | None = None) -> Budget:
    """The budget for ``[recovery] memory_budget_bytes = setting`` (see the module docstring).
    ``held_bytes``: what this worker already holds of the tier; ``available``: the host's available
    bytes (:func:`available_bytes`; None: unknown, no bound)."""
    if setting > 0:
        return Budget(setting, "explicit")
    if setting == NO_BOUND:
        return Budget(0, "none")
    ranks = max(1, ranks_on_host)
    if available is None:
        return Budget(0, "unknown", ranks_on_host=ranks, fraction=fraction)
    share = int(fraction * (available / ranks + held_bytes))
    return Budget(max(1, share), "derived", available, ranks, fraction)


def available_bytes(meminfo: str = "/proc/meminfo", cgroup_fs: str = "/sys/fs/cgroup",
                    self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Host bytes this process could still take: ``MemAvailable``, capped by the room left under the
    memory limit of its cgroup and of each cgroup above it (v2, or v1's memory controller). None
    when ``meminfo`` has no ``MemAvailable`` (not Linux)."""
    avail = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return None
    if avail is None:
        return None
    room = _cgroup_room(cgroup_fs, self_cgroup)
    return min(avail, room) if room is not None else avail


def _cgroup_room(cgroup_fs: str, self_cgroup: str) -> int | None:
    """The smallest (limit - usage) over this process's cgroup and its ancestors that have a memory limit."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    dirs = []
    for line in lines:
        hier, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hier == "0" and controllers == "":  # v2: one unified hierarchy
            files, base = ("memory.max", "memory.current"), cgroup_fs
        elif "memory" in controllers.split(","):  # v1's memory controller
            files, base = ("memory.limit_in_bytes", "memory.usage_in_bytes"), os.path.join(cgroup_fs, "memory")
        else:
            continue
        parts = [p for p in path.split("/") if p and p != ".."]
        # The process's own group and its ancestors; inside a container the mount is the group itself.
        dirs += [(os.path.join(base, *parts[:i]), files) for i in range(len(parts), -1, -1)]
    rooms = []
    for d, (limit_name, usage_name) in dict.fromkeys(dirs):
        try:
            with open(os.path.join(d, limit_name)) as f:
                limit_text = f.read().strip()
            with open(os.path.join(d, usage_name)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= _UNLIMITED:
            continue
        rooms.append(max(0, int(limit_text) - usage))
    return min(rooms) if rooms else None


def human_bytes(n: float) -> str:
    """``1.2 GiB``, ``512 KiB``, ``0 B``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def state_bytes(state_dict) -> int:
    """The bytes of this rank's tensors in ``state_dict`` (local shards of DTensors): what a snapshot holds,
    less a few hundred bytes of envelope per tensor and the metadata."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state_dict, dict):
        return sum(state_bytes(v) for v in state_dict.values())
    if isinstance(state_dict, DTensor):
        state_dict = state_dict._local_tensor
    return state_dict.numel() * state_dict.element_size() if isinstance(state_dict, torch.Tensor) else 0
