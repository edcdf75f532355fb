"""Where a group restores from in the memory tier: asked of the live workers, decided by the controller.

    plan, why = group_restore_plan(group, holders, committed_step)   # plan None: restore from storage
    group.submit(w, "form", ..., plan, True)                           # every member of the new group: it
                                                                       # forms, then restores (TrainWorker)
    why, events, tier = restore_outcome(restored, why, recovering)     # the events the controller tells

Each holder answers ``memory_holdings`` (``TrainWorker``: per snapshot key, the
files it holds and the files of that step); the newest snapshot whose every file
some holder has wins (:func:`checkpointing.recovery.restore.plan_restore`), each
file from the first holder listed that has it, so the members of the new group
come first and read their own files in place. The plan carries the holders'
actor handles: a member fetches a file it lacks from its holder
(``orchestrator.workers.tier_fetch``).

What the controller tells of the tier (``memory_tier`` events, see
docs/operations.md#recovery-tiers) is decided here from the workers' answers:
``action`` ``off`` (a snapshot over the budget turned the tier off for the
group, reported by rank 0's ``progress``), ``refused`` (a resize's snapshot over
the budget), ``fallback`` (a recovery or a resize restored from the durable
checkpoint while the tier is on, and why), ``unbounded`` (no budget could be
derived: the host's memory could not be read).
"""

from __future__ import annotations

from checkpointing.recovery.restore import SnapshotKey, plan_restore

from .tier_fetch import MemoryRestore
from .group import WorkerGroup
from .results import Restored


def group_restore_plan(group: WorkerGroup, holders: list[str], committed_step: int | None = None,
                        timeout_s: float = 10.0) -> tuple[MemoryRestore | None, str]:
    """The newest memory-tier snapshot every file of which one of ``holders`` holds (each file from the
    first holder listed that has it), unless the durable checkpoint (``committed_step``) is newer:
    ``(MemoryRestore, why)`` for ``TrainWorker.restore``, or ``(None, why not)``."""

    calls = [group.submit(w, "memory_holdings") for w in holders]
    done = {id(c) for c in group.wait(calls, timeout=timeout_s)}
    held, needed = {}, {}
    for call in calls:  # a holder that does not answer holds nothing for this restore
        try:
            got = group.result(call, timeout=0) if id(call) in done else None
        except Exception:
            got = None
        if got:
            held[call.wid] = got["holdings"]
            for key, names in got["needed"].items():
                needed.setdefault(SnapshotKey(*key), set()).update(names)
    if not needed:
        return None, "no worker holds a snapshot in memory"
    plan = plan_restore(held, needed)
    if plan is None:
        return None, (f"no step is held completely by the live workers (the newest, {max(needed).step}, lost "
                      "files with its workers)")
    if committed_step is not None and plan.step < committed_step:
        return None, f"the durable checkpoint (step {committed_step}) is newer than memory (step {plan.step})"
    handles = {w: group.handle(w) for w in set(plan.where.values())}
    return MemoryRestore(plan.key, plan.where, handles), plan.reason


def restore_outcome(restored: list[Restored], why: str, recovering: bool) -> tuple[str, list[dict], dict | None]:
    """From every member's ``restore`` result (rank 0's first): why the group restored where it
    did, the ``memory_tier`` events to tell (a fallback to the durable checkpoint in a ``recovering``
    group or after a failed restore from memory; a tier without a bound it could derive), and the
    tier's budget for the ``formed`` event (rank 0's, with the smallest of any rank's; None when off)."""
    first = restored[0]
    events = []
    if first.fallback:
        why = f"the restore from memory failed ({first.fallback})"
    tiers = [r.memory_tier for r in restored if r.memory_tier]
    if tiers and (first.fallback or (recovering and first.tier != "memory")):
        events.append({"action": "fallback", "step": first.step, "reason": why})
    unknown = [t for t in tiers if t.get("budget") == "unknown"]
    if unknown:
        events.append({"action": "unbounded", "rank": unknown[0].get("rank"), "reason": unknown[0].get("describe")})
    if not tiers:
        return why, events, None
    bounded = [t["budget_bytes"] for t in tiers if t.get("budget_bytes")]
    summary = {"budget": tiers[0].get("budget"), "describe": tiers[0].get("describe"),
               "min_budget_bytes": min(bounded) if bounded else 0}
    return why, events, summary


def flush_outcome(flushed: dict, step: int) -> tuple[str, list[dict]]:
    """From every member's ``memory_flush`` result at a resize's boundary ``step``: why the members do not
    all hold it in memory ("" when they do) and the ``memory_tier`` events to tell (a snapshot refused
    over the budget)."""
    refused = [r["refused"] for r in flushed.values() if r.get("refused")]
    why = next((r.get("reason") or f"a member does not hold step {step}" for r in flushed.values()
                if r.get("step") != step), "")
    return why, [refused[0]] if refused else []
