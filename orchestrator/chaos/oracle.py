"""The oracle: did a run that went through faults train what a failure-free run of its config trains?

    traj = final_trajectory(store.get_history(run_id))       # step -> the HistoryRow that stands
    problems, cursor = verify_committed(ckpt_url, run_id)    # every committed checkpoint re-verified
    skipped = skipped_ranges(events, cfg.data.skip_ranges)   # samples skipped as the data's ([health])
    reasons = oracle({"status": final, "history": history}, ref, total_steps=..., global_batch=...,
                     rtol=..., atol=..., verify_problems=problems, final_cursor=cursor, skipped=skipped,
                     checkpoint_skipped=checkpoint_skipped(ckpt_url, run_id), ref_skipped=...,
                     replayed=replayed_steps(events, history))                  # [] when it passes
    reasons += stale_commits(ckpt_url, run_id, events)       # commits a fence should have refused
    steps, note = loss_steps(traj, ref_traj, global_batch=..., skipped=skipped, ...)   # what the loss check compares

The verdict against a failure-free reference run of the same config: the same final step; every step
trained once in the final trajectory with its data cursor at exactly step x global batch (no sample
skipped or repeated); the loss at every step within ``loss_rtol`` of the reference; every committed
checkpoint verifies; no checkpoint committed by an epoch after a newer one formed (a stale writer the
fence should have refused). Each reason is a sentence for the report; the oracle only reads.

Silent faults ([health]) change two of these. A batch skipped as the data's (a ``poison_batch``) moves the
cursor past it, so every step's cursor is still step x global batch, and the samples never trained must be
exactly the ranges the run's ``sdc`` data events list (with ``data.skip_ranges``), whole steps, as the final
checkpoint's ``skipped_ranges`` records them (a resume from it trains what the run trained). The loss is
compared at every step but the skipped ones when the reference skipped the same samples (``etrain chaos
--reference`` runs a new one with ``data.skip_ranges`` set so), else only before the first skip: the
models differ from there on. A rollback replays steps without reporting them (only the step that showed the
fault is reported again); their rows are the first pass's, trained on a state the fault may already have
corrupted before it was found, and are left out of the comparison (:func:`replayed_steps`).
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


def merge_ranges(ranges) -> list[list[int]]:
    """[start, end) sample ranges sorted, overlapping and touching ones merged."""
    out: list[list[int]] = []
    for a, b in sorted([int(a), int(b)] for a, b in ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def skipped_ranges(events: list[dict], config_ranges=()) -> list[list[int]]:
    """The samples a run never trained on: its ``sdc`` events with the data's verdict (their ``samples``) and
    its config's ``data.skip_ranges``, merged."""
    found = [e["samples"] for e in events if e.get("kind") == "sdc" and e.get("verdict") == "data" and e.get("samples")]
    return merge_ranges([*config_ranges, *found])


def skipped_steps(ranges: list[list[int]], global_batch: int) -> set[int]:
    """The steps whose batch lies in ``ranges`` (step k trains samples [(k-1) x global batch, k x global batch))."""
    return {k for a, b in ranges for k in range(a // global_batch + 1, -(-b // global_batch) + 1)}


def replayed_steps(events: list[dict], history: list) -> set[int]:
    """Steps a rollback trained again whose last row is from before it: a rollback (event ``rollback``:
    ``to_step``, the verified step, up to ``step``, the one that showed the fault) reports only that last step
    again, so the rows of the steps between are the first pass's. A later row (a re-formed group trained
    them again) supersedes as any redone step's does."""
    traj = final_trajectory(history)
    out = set()
    for e in events:
        if e.get("kind") == "rollback" and e.get("to_step") is not None:
            began = e["time"] - float(e.get("seconds") or 0.0)
            out.update(s for s in range(int(e["to_step"]) + 1, int(e["step"])) if s in traj and traj[s].unix <= began)
    return out


def loss_steps(traj: dict, ref_traj: dict, *, global_batch: int, skipped=(), ref_skipped=(),
               replayed=frozenset()) -> tuple[list[int], str | None]:
    """The steps whose loss is compared with the reference's, and a note when some are left out."""
    mine, theirs = merge_ranges(skipped), merge_ranges(ref_skipped)
    out = [s for s in sorted(traj) if s in ref_traj and s not in replayed]
    notes = []
    if replayed & set(traj):
        notes.append(f"{len(replayed & set(traj))} steps replayed by a rollback without a row of their own left out")
    if mine == theirs:
        gone = skipped_steps(mine, global_batch)
        out = [s for s in out if s not in gone]
        if mine:
            notes.append(f"the reference skipped the same samples {mine}: every other step compared")
    else:
        first = min(skipped_steps(mine, global_batch) | skipped_steps(theirs, global_batch))
        out = [s for s in out if s < first]
        notes.append(f"samples skipped {mine}, the reference's {theirs}: the loss compared before step {first} only "
                     "(a reference with data.skip_ranges set to the run's compares every step)")
    return out, "; ".join(notes) or None


def oracle(run: dict, ref: dict | None, *, total_steps: int, global_batch: int, rtol: float, atol: float,
           verify_problems: dict[int, list[str]], final_cursor: int | None, restored_up_to: int = 0,
           skipped=(), checkpoint_skipped: list | None = None, ref_skipped=(), replayed=frozenset()) -> list[str]:
    """Reasons the run fails the oracle (empty: it passes). ``run``/``ref``: {"status", "history"}.

    A step missing from the history is accepted only when a group restored a checkpoint at or after
    it (its rank 0 died before reporting it, but the checkpoint proves it was trained). ``skipped``: the
    samples the run skipped (:func:`skipped_ranges`); ``checkpoint_skipped``: its final checkpoint's list
    (None: no checkpoint); ``ref_skipped``: the reference's ``data.skip_ranges``; ``replayed``:
    :func:`replayed_steps`."""
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
    skipped = merge_ranges(skipped)
    for a, b in skipped:
        if a % global_batch or b % global_batch or b > total_steps * global_batch:
            reasons.append(f"skipped samples [{a}, {b}) are not whole steps of the run's {total_steps * global_batch} "
                           f"samples (global batch {global_batch})")
    if checkpoint_skipped is not None and merge_ranges(checkpoint_skipped) != skipped:
        reasons.append(f"the final checkpoint lists skipped samples {merge_ranges(checkpoint_skipped)}, the run "
                       f"skipped {skipped}: a resume from it would not train what this run trained")
    for step, problems in sorted(verify_problems.items()):
        if problems:
            reasons.append(f"committed checkpoint step {step} does not verify: {problems[0]}")
    if ref is not None:
        if ref["status"].get("step") != st.get("step"):
            reasons.append(f"final step {st.get('step')} differs from the reference's {ref['status'].get('step')}")
        rt = final_trajectory(ref["history"])
        steps, _ = loss_steps(traj, rt, global_batch=global_batch, skipped=skipped, ref_skipped=ref_skipped,
                              replayed=replayed)
        worst = max(((_rel_diff(traj[s].loss, rt[s].loss), s) for s in steps), default=(0.0, None))
        over = [s for s in steps if abs(traj[s].loss - rt[s].loss) > atol + rtol * abs(rt[s].loss)]
        if over:
            s = over[0]
            reasons.append(f"loss at step {s} is {traj[s].loss:.6g}, the reference's {rt[s].loss:.6g}: beyond "
                           f"rtol {rtol:g} (worst relative difference {worst[0]:.3g} at step {worst[1]})")
    return reasons


def _rel_diff(loss: float, ref_loss: float) -> float:
    return abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)


def loss_rel_diff(history: list, ref_history: list, steps=None) -> float | None:
    """The largest relative difference of the loss at a step from the reference's (None: no step in common);
    ``steps``: only those (:func:`loss_steps`)."""
    a, b = final_trajectory(history), final_trajectory(ref_history)
    diffs = [_rel_diff(a[s].loss, b[s].loss) for s in a if s in b and (steps is None or s in steps)]
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


def checkpoint_skipped(ckpt_url: str, run_id: str) -> list | None:
    """The newest committed checkpoint's ``skipped_ranges`` ([] when it lists none); None without a checkpoint."""
    from checkpointing.manager import CheckpointManager

    if not ckpt_url:
        return None
    mgr = CheckpointManager(ckpt_url, run_id)
    steps = mgr.committed_steps()
    return list(mgr.read_manifest(steps[-1]).trainer_state.get("skipped_ranges") or []) if steps else None


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
