"""Where a group restores from in the memory tier: asked of the live workers, decided by the controller.

    plan, why = memory_restore_plan(group, holders, committed_step)   # plan None: restore from storage
    group.submit(w, "restore", plan)                                   # every member of the new group

Each holder answers ``memory_holdings`` (``TrainWorker``: per snapshot key, the
files it holds and the files of that step); the newest snapshot whose every file
some holder has wins (:func:`checkpointing.memory_restore.plan_restore`), each
file from the first holder listed that has it, so the members of the new group
come first and read their own files in place. The plan carries the holders'
actor handles: a member fetches a file it lacks from its holder
(``orchestrator.memory_restore``).
"""

from __future__ import annotations

from .worker_group import WorkerGroup


def memory_restore_plan(group: WorkerGroup, holders: list[str], committed_step: int | None = None,
                        timeout_s: float = 10.0) -> tuple[dict | None, str]:
    """The newest memory-tier snapshot every file of which one of ``holders`` holds (each file from the
    first holder listed that has it), unless the durable checkpoint (``committed_step``) is newer:
    ``({"key", "where", "handles"}, why)`` for ``TrainWorker.restore``, or ``(None, why not)``."""
    from checkpointing.memory_restore import plan_restore

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
                needed.setdefault(tuple(key), set()).update(names)
    if not needed:
        return None, "no worker holds a snapshot in memory"
    plan = plan_restore(held, needed)
    if plan is None:
        return None, (f"no step is held completely by the live workers (the newest, {max(needed)[0]}, lost "
                      "files with its workers)")
    if committed_step is not None and plan.step[0] < committed_step:
        return None, f"the durable checkpoint (step {committed_step}) is newer than memory (step {plan.step[0]})"
    handles = {w: group.handle(w) for w in set(plan.where.values())}
    return {"key": plan.step, "where": plan.where, "handles": handles}, plan.reason
