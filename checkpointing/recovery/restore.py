"""Restoring from the memory tier: which holder gives each file, and the load itself.

    plan = plan_restore({rank: tier.holdings(), ...}, tier.needed())   # None: use the durable checkpoint
    load_from_memory(state_dict, {name: bytes or fetch()}, snapshot)   # collective, resharded

A restore from memory is a durable restore with another storage under it: the
files come from host memory (this rank's own snapshot, the copies it holds for
peers, files fetched from another holder), and are read by the durable reader
(:class:`checkpointing.dcp.reader.EtrainReader`, every file checked against the
step's agreed table before use, the DCP metadata through the restricted
unpickler) with the durable load planner, so the result is bitwise what a
durable load of the same state gives, into any world size or layout.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..dcp.format import CorruptCheckpointError
from ..errors import CheckpointError
from ..manifest import METADATA_NAME
from .snapshot import MemorySnapshot, MemoryStorage, Source, step_rel


class SnapshotKey(NamedTuple):
    """A snapshot held across a worker's process groups: the same step may be held from two groups of
    different layouts (a step snapshotted at 3 workers, restored at 2, is not the 2-worker group's)."""

    step: int
    epoch: int


@dataclass(frozen=True)
class RestorePlan:
    """Where each file of the snapshot ``key`` is taken from: ``where[name]`` is a holder (a rank, a worker).
    ``key`` is a :class:`SnapshotKey`, or a step alone within one tier."""

    key: SnapshotKey | int
    where: dict[str, Hashable]
    reason: str  # why this step (and not a newer one), for the recovery event

    @property
    def step(self) -> int:
        return self.key.step if isinstance(self.key, SnapshotKey) else self.key


def plan_restore(holdings: Mapping[Hashable, Mapping[SnapshotKey | int, Iterable[str]]],
                 needed: Mapping[SnapshotKey | int, Iterable[str]]) -> RestorePlan | None:
    """The newest agreed step whose every file is held by someone, and where each file is.

    ``holdings``: per holder (in order of preference: a restore takes each file from
    the first holder listed that has it), the files it holds per step, its own and
    its replicas. ``needed``: per agreed step, every file of that step (its agreed
    table and the DCP metadata, :meth:`MemorySnapshot.file_table`). None when no
    step is complete: the caller restores from the durable checkpoint.
    """
    holdings = {h: {_key(k): v for k, v in steps.items()} for h, steps in holdings.items()}
    needed = {_key(k): v for k, v in needed.items()}
    held: dict[SnapshotKey | int, dict[str, Hashable]] = {}
    for holder, steps in holdings.items():
        for step, names in steps.items():
            for name in names:
                held.setdefault(step, {}).setdefault(name, holder)
    skipped = []
    for step in sorted(needed, reverse=True):
        want = set(needed[step])
        have = held.get(step, {})
        missing = sorted(want - set(have))
        if not want or missing:
            skipped.append(f"step {step} lacks {len(missing)} file(s) ({', '.join(missing[:3])})")
            continue
        why = "the newest agreed step" if not skipped else "newer steps incomplete: " + "; ".join(skipped)
        return RestorePlan(step, {name: have[name] for name in sorted(want)}, why)
    return None


def _key(k) -> SnapshotKey | int:
    """A key as planned: (step, epoch) pairs (lists after a trip through Ray or JSON) as a SnapshotKey."""
    return SnapshotKey(*k) if isinstance(k, (tuple, list)) else k


def load_from_memory(state_dict: dict[str, Any], sources: dict[str, Source], snapshot: MemorySnapshot, *,
                     process_group=None, collective: bool = True) -> None:
    """Load step ``snapshot.step`` into ``state_dict`` in place, resharded to its layout, from ``sources``
    (file name -> bytes, or a callable that fetches them: this rank's own files, the copies it holds, files
    of another holder). Collective. ``snapshot`` (any rank's of that step, its files may be left out)
    gives the agreed table and the DCP metadata: every file is checked against the table before use, and
    the metadata is read with the restricted unpickler. Goes through the durable reader and planner
    (:class:`checkpointing.dcp.reader.EtrainReader`, ``SafeLoadPlanner``), so the result is what a durable
    load of the same state gives. CorruptCheckpointError naming the file when one is missing or bad.

    ``collective=False``: each rank reads its part alone, without DCP's exchange of load plans (two
    object collectives, each rank's plan pickled: DCP's global load plan is every rank's own, unchanged),
    and a failed read raises on that rank only: the caller agrees on the outcome."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..dcp.reader import EtrainReader, SafeLoadPlanner, load_failure
    from ..storage.retry import describe

    if not snapshot.agreed:
        raise CheckpointError(f"the memory snapshot of step {snapshot.step} was never agreed by every rank; "
                              "restore from the durable checkpoint")
    rel = step_rel(snapshot.step)
    storage = MemoryStorage({f"{rel}/{k}": v for k, v in {METADATA_NAME: snapshot.metadata, **sources}.items()})
    reader = EtrainReader(storage, rel, snapshot.file_table())
    reader.read_metadata()  # checked here (the restricted unpickler), before DCP sees it
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group,
                 no_dist=not (collective and dist.is_initialized()))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        cause = load_failure(e)
        if isinstance(cause, CorruptCheckpointError):
            raise CorruptCheckpointError(f"cannot restore step {snapshot.step} from memory: {cause}") from e
        reason = str(cause) if isinstance(cause, CheckpointError) else describe(cause)
        raise CheckpointError(f"cannot restore step {snapshot.step} from memory: {reason}") from e
