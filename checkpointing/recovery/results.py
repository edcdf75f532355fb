"""What became of a memory snapshot and of its copies to peers (:class:`checkpointing.recovery.tier.MemoryTier`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .snapshot import MemorySnapshot


@dataclass
class ReplicationResult:
    step: int
    ok: bool
    reason: str = ""
    seconds: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0


@dataclass
class SnapshotResult:
    """What became of one :meth:`MemoryTier.take`."""

    step: int
    status: str  # "agreed", "failed" (some rank could not copy: never used) or "refused" (over budget)
    reason: str = ""
    snapshot: MemorySnapshot | None = None  # this rank's, when agreed
    seconds: float = 0.0  # the whole snapshot, start to agreement (and copies, in take_async)
    phases: dict[str, float] = field(default_factory=dict)
    blocking_s: float = 0.0  # of which training waited (take: all; take_async: the host copy)
    planned: bool = False  # laid out by dcp.save's planning (else by the last plan: the layout held)
    replication: ReplicationResult | None = None  # take_async's copies to peers
    in_place: bool = False  # take_async's host copy went where the files lie (only their headers were written)
    over_budget: dict[int, tuple[int, int]] = field(default_factory=dict)  # refused: {rank: (bytes, its budget)}

    @property
    def ok(self) -> bool:
        return self.status == "agreed"
