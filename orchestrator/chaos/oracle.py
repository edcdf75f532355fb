"""The oracle: did a run that went through faults train what a failure-free run of its config trains?

    traj = final_trajectory(store.get_history(run_id))       # step -> the HistoryRow that stands
    reasons = oracle({"status": final, "history": history}, ref, total_steps=..., global_batch=...,
                     rtol=..., atol=..., verify_problems=..., final_cursor=...)   # [] when it passes
    problems, cursor = verify_committed(ckpt_url, run_id)    # every committed checkpoint re-verified
    reasons += stale_commits(ckpt_url, run_id, events)       # commits a fence should have refused

The verdict against a failure-free reference run of the same config: the same final step; every step
trained once in the final trajectory with its data cursor at exactly step x global batch (no sample
skipped or repeated); the loss at every step within ``loss_rtol`` of the reference; every committed
checkpoint verifies; no checkpoint committed by an epoch after a newer one formed (a stale writer the
fence should have refused). Each reason is a sentence for the report; the oracle only reads.
History rows may be :class:`~orchestrator.store.run_store.HistoryRow` or the plain lists they are stored as.
"""

from __future__ import annotations

from ..phase import Phase
from ..store.run_store import HistoryRow


def final_trajectory(history: list) -> dict[int, HistoryRow]:
    """Step -> its last row: a step redone after a restore replaces the lost one."""
    out: dict[int, HistoryRow] = {}
    for row in map(HistoryRow.of, history):
        out[int(row.step)] = row
    return out


def oracle(run: dict, ref: dict | None, *, total_steps: int, global_batch: int, rtol: float, atol: float,
           verify_problems: dict[int, list[str]], final_cursor: int | None, restored_up_to: int = 0) -> list[str]:
    """Reasons the run fails the oracle (empty: it passes). ``run``/``ref``: {"status", "history"}.

    A step missing from the history is accepted only when a group restored a checkpoint at or after
    it (its rank 0 died before reporting it, but the checkpoint proves it was trained)."""
    reasons = []
    st = run["status"]
    if Phase.of(st) != Phase.FINISHED:
        reasons.append(f"the run ended {st.get('phase')} ({st.get('reason', '')}), not FINISHED")
    if st.get("step") != total_steps:
        reasons.append(f"final step {st.get('step')}, expected {total_steps}")
    traj = final_trajectory(run["history"])
    missing = [s for s in range(restored_up_to + 1, total_steps + 1) if s not in traj]
    if missing:
        reasons.append(f"steps never trained: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    bad_cursor = [s for s, row in traj.items() if int(row.samples_consumed) != s * global_batch]
    if bad_cursor:
        s = bad_cursor[0]
        reasons.append(f"data cursor off at step {s}: {traj[s].samples_consumed} samples consumed, expected "
                       f"{s * global_batch} (a sample skipped or repeated)")
    if final_cursor is not None and final_cursor != total_steps * global_batch:
        reasons.append(f"the final checkpoint's cursor is {final_cursor}, expected {total_steps * global_batch}")
    for step, problems in sorted(verify_problems.items()):
        if problems:
            reasons.append(f"committed checkpoint step {step} does not verify: {problems[0]}")
    if ref is not None:
        if ref["status"].get("step") != st.get("step"):
            reasons.append(f"final step {st.get('step')} differs from the reference's {ref['status'].get('step')}")
        rt = final_trajectory(ref["history"])
        worst = max(((_rel_diff(traj[s].loss, rt[s].loss), s) for s in traj if s in rt), default=(0.0, None))
        over = [s for s in traj if s in rt and abs(traj[s].loss - rt[s].loss) > atol + rtol * abs(rt[s].loss)]
        if over:
            s = over[0]
            reasons.append(f"loss at step {s} is {traj[s].loss:.6g}, the reference's {rt[s].loss:.6g}: beyond "
                           f"rtol {rtol:g} (worst relative difference {worst[0]:.3g} at step {worst[1]})")
    return reasons


def _rel_diff(loss: float, ref_loss: float) -> float:
    return abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)


def loss_rel_diff(history: list, ref_history: list) -> float | None:
    """The largest relative difference of the loss at a step from the reference's (None: no step in common)."""
    a, b = final_trajectory(history), final_trajectory(ref_history)
    diffs = [_rel_diff(a[s].loss, b[s].loss) for s in a if s in b]
    return max(diffs) if diffs else None


def verify_committed(ckpt_url: str, run_id: str) -> tuple[dict[int, list[str]], int | None]:
    """Every committed checkpoint's problems (empty lists when it verifies), and the newest one's cursor."""
    from checkpointing.manager import CheckpointManager

    if not ckpt_url:
        return {}, None
    mgr = CheckpointManager(ckpt_url, run_id)
    steps = mgr.committed_steps()
    problems = {s: mgr.verify(s) for s in steps}
    cursor = mgr.read_manifest(steps[-1]).trainer_state.get("samples_consumed") if steps else None
    return problems, cursor


def stale_commits(ckpt_url: str, run_id: str, events: list[dict]) -> list[str]:
    """Committed checkpoints whose commit came after a newer epoch formed: writers the fence should have
    refused (a partitioned or hung rank that lived on). A manifest's time is taken after its writer read
    the fence, and an epoch's ``formed`` event is written after the fence moved to it."""
    from checkpointing.manager import CheckpointManager

    formed = [(e["epoch"], e["time"]) for e in events if e.get("kind") == "formed" and "epoch" in e]
    if not ckpt_url or not formed:
        return []
    mgr = CheckpointManager(ckpt_url, run_id)
    out = []
    for step in mgr.committed_steps():
        m = mgr.read_manifest(step)
        newer = min((t for epoch, t in formed if epoch > m.epoch), default=None)
        if newer is not None and m.created_unix > newer:
            out.append(f"checkpoint step {step} was committed by epoch {m.epoch} {m.created_unix - newer:.2f} s after "
                       "a newer epoch formed: a stale writer got past the fence")
    return out
