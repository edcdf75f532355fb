"""What a worker holds of the memory tier across its process groups, and what it answers a restore.

    held = HeldSnapshots()
    held.keep(epoch, tier.detach())            # when the worker leaves a group: its tier's steps, kept
    view = held.view(tier, epoch)              # those, and what the live tier holds now
    view.holdings(), view.needed()             # for plan_restore (the controller gathers every worker's)
    view.file(key, name), view.header(key)     # a file, or a snapshot without files, for another worker
    view.sources(key), view.snapshot(key)      # this worker's files of a step, and the step's table

A snapshot is named by its key ``(step, epoch)``: the same step may be held from
two groups of different layouts (a step snapshotted at 3 workers, restored at 2,
is not the 2-worker group's snapshot of it), and newer keys sort first in a plan.
A worker's tier dies with its process group (its gloo groups do), its bytes do
not: a survivor of a failure keeps what its tier held, and the group formed next
restores from it. Held snapshots are dropped once the new group's tier holds a
restorable step of its own (:meth:`HeldSnapshots.clear`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from ..manifest import METADATA_NAME
from .restore import SnapshotKey
from .snapshot import MemorySnapshot

Entry = tuple[MemorySnapshot | None, dict[int, MemorySnapshot]]  # own snapshot, copies held for peers


class HeldSnapshots:
    """Steps of earlier groups this worker still holds in memory (see the module docstring)."""

    def __init__(self):
        self.entries: dict[SnapshotKey, Entry] = {}
        self._lock = threading.Lock()

    def keep(self, epoch: int, steps: dict[int, Entry]) -> None:
        with self._lock:
            for step, (own, copies) in steps.items():
                if own is not None or copies:
                    self.entries[SnapshotKey(step, epoch)] = (own, copies)

    def clear(self) -> None:
        with self._lock:
            self.entries = {}

    def nbytes(self) -> int:
        with self._lock:
            return HeldView(self.entries).nbytes()

    def view(self, tier=None, epoch: int = -1) -> HeldView:
        """These entries and, keyed by ``epoch``, what the live ``tier`` holds now."""
        with self._lock:
            entries = dict(self.entries)
        if tier is not None:
            entries.update({SnapshotKey(step, epoch): entry for step, entry in tier.held_steps().items()})
        return HeldView(entries)


@dataclasses.dataclass
class HeldView:
    """Snapshots by key: ``(step, epoch)`` across a worker's groups, or the step alone within one tier
    (``MemoryTier.view``)."""

    entries: dict[Any, Entry]

    def nbytes(self) -> int:
        """Host bytes of these snapshots and copies."""
        return sum((own.nbytes if own is not None else 0) + sum(c.nbytes for c in copies.values())
                   for own, copies in self.entries.values())

    def snapshot(self, key) -> MemorySnapshot | None:
        """Any snapshot of ``key`` this worker holds (its own first): each carries the step's agreed table,
        its DCP metadata and trainer state."""
        own, copies = self.entries.get(key, (None, {}))
        return own if own is not None else next(iter(copies.values()), None)

    def holdings(self) -> dict[Any, set[str]]:
        """Per key, the files this worker can give a restore."""
        out: dict[Any, set[str]] = {}
        for key, (own, copies) in self.entries.items():
            names = set(own.names()) if own is not None else {METADATA_NAME}
            for c in copies.values():
                names |= c.names()
            out[key] = names
        return out

    def needed(self) -> dict[Any, set[str]]:
        """Per key, every file of that step (its agreed table and the DCP metadata)."""
        return {key: set(snap.file_table()) for key in self.entries if (snap := self.snapshot(key)) is not None}

    def sources(self, key) -> dict[str, bytes | memoryview]:
        own, copies = self.entries.get(key, (None, {}))
        out: dict[str, bytes | memoryview] = {}
        for c in copies.values():
            out.update(c.sources())
        if own is not None:
            out.update(own.sources())
        return out

    def file(self, key, name: str) -> bytes:
        data = self.sources(key).get(name)
        if data is None:
            raise KeyError(f"this worker holds no {name} of snapshot {key}")
        return bytes(data)

    def header(self, key) -> bytes:
        """The step's snapshot without its files (the wire format): its table, metadata and trainer state."""
        snap = self.snapshot(key)
        if snap is None:
            raise KeyError(f"this worker holds no snapshot {key}")
        return dataclasses.replace(snap, files={}).to_bytes()

