"""What a :class:`~orchestrator.workers.worker.TrainWorker`'s group calls return to the controller: one typed value per
call, so that the controller and its states read named fields, never dict keys with defaults.

    TrainResult(status="failed", step=12, error="rank 1: connection reset", kind="collective_failed")
    Formed(rank=0, seconds=0.41, phases={"process_group_s": 0.2, ...})
    Restored(step=12, tier="memory", seconds=0.05, history_row=[...])
    refused_event(snapshot_result, "off")   # the memory_tier event of a snapshot refused over its budget

They travel through Ray (pickled by value), so they hold plain data only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

TrainStatus = Literal["done", "stopped", "failed", "faulty"]


@dataclass(frozen=True)
class TrainResult:
    """The end of a ``train`` call: every step done, stopped at a step boundary on request, or failed (never
    raised: ``error`` says why, ``kind`` is the failure kind the controller's recovery rules use)."""

    status: TrainStatus
    step: int
    error: str = ""
    kind: str = "error"
    # "faulty": [health] found a fault that follows one rank (``rank``, ``host``, ``step``, ``verified_step``);
    # every rank is back at its verified step and the group is intact
    evidence: dict | None = None

    @property
    def failed(self) -> bool:
        return self.status == "failed"


@dataclass(frozen=True)
class Restored:
    """Where a member's ``restore`` took its state from.

    ``tier``: ``memory`` (the step a restore plan named, from the hosts' copies), ``durable`` (the newest
    valid checkpoint, ``from_step``, saved at ``world_size_at_save``) or ``none`` (step 0).
    ``fallback``: why a planned restore from memory failed and the durable checkpoint was read instead.
    ``memory_tier``: this rank's tier budget (None when the tier is off). ``history_row``: the restored
    step's history row (from memory only: a rank 0 that died may never have reported it)."""

    step: int
    tier: Literal["memory", "durable", "none"]
    seconds: float
    from_step: int | None = None
    world_size_at_save: int | None = None
    fallback: str = ""
    memory_tier: dict | None = None
    history_row: list | None = None


@dataclass(frozen=True)
class Formed:
    """A member joined an epoch's process group as ``rank``; ``phases``: where its ``seconds`` went;
    ``restored``: the restore it made next when the form asked for one (``TrainWorker.form(restore=True)``)."""

    rank: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    restored: Restored | None = None


def refused_event(res, action: str) -> dict:
    """The ``memory_tier`` event of a snapshot refused over the budget (``res``: its
    ``checkpointing.recovery.results.SnapshotResult``): ``action`` (off: the tier turned itself off for this
    group; refused: that snapshot only), the first rank over its budget, its bytes, its budget."""
    rank = min(res.over_budget)
    held, budget = res.over_budget[rank]
    return {"action": action, "step": res.step, "rank": rank, "bytes": held, "budget_bytes": budget,
            "ranks": sorted(res.over_budget), "reason": res.reason}


def failure_kind(e: BaseException) -> str:
    """nonfinite (the loss or init_from's weights hold nan/inf: not retried), health ([health] stopped the run:
    too many batches skipped, or a fault no snapshot explains: not retried), collective_failed (a peer
    vanished), hang (a collective timed out) or error (anything else)."""
    from trainer.health import HealthStop
    from trainer.loop import NonFiniteStep
    from trainer.models.hf.hf_dir import NonFiniteWeights

    if isinstance(e, (NonFiniteStep, NonFiniteWeights)):
        return "nonfinite"
    if isinstance(e, HealthStop):
        return "health"
    text = f"{type(e).__name__}: {e}".lower()
    if "timeout" in text or "timed out" in text:
        return "hang"
    if any(w in text for w in ("connection", "peer", "closed", "reset", "broken pipe", "gloo", "nccl")):
        return "collective_failed"
    return "error"
