"""The chaos report: when each fault was injected, detected and recovered, and the run's verdict.

    rows = assess(chaos.injections, store.events(run_id), store.get_history(run_id))  # one dict a fault
    r = report(run_id, plan, rows, final_status, reasons, ref_id, loss_diff)          # JSON-able
    print(format_report(r))                                                           # for people

For every fault: time to detect (injection to the controller's failure event), time to recover
(injection to the first step after the recovery), steps lost and committed steps lost; p50/p95 over
faults; the run's two goodput figures as the controller reported them in its status (not computed
here): ``goodput``, effective training time (the steps the final model holds) over wall time, and
``step_time_ratio``, every trained step's time (redone ones too) over wall time; and the
oracle's reasons (``orchestrator.chaos.oracle``). A run passes when the oracle found nothing and every
fault was injected, detected and recovered without losing a committed step. Nothing here reads the
store or the cluster: the rows are computed from the events and history handed in.
"""

from __future__ import annotations

from ..store.run_store import HistoryRow
from .injector import Injection
from .plan import CLUSTER_KINDS, PROCESS_KINDS, ChaosPlan


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def assess(injections: list[Injection], events: list[dict], history: list) -> list[dict]:
    """Detection and recovery of each injected fault, from the run's events and step history."""
    history = [HistoryRow.of(h) for h in history]
    failures = [e for e in events if e.get("kind") == "failure"]
    recovered = [e for e in events if e.get("kind") == "recovered"]
    formed = [e for e in events if e.get("kind") == "formed"]
    ckpt_failed = [e for e in events if e.get("kind") == "checkpoint_failed"]
    # A window fault that outlived the run's last step (its final save may have run inside it) was
    # trained through when the run finished.
    finished = any(e.get("kind") == "finished" for e in events)
    used: set[int] = set()
    out = []
    for inj in injections:
        row = {"fault": inj.fault, "kind": inj.kind, "step": inj.step, "injected_unix": inj.time,
               "target": inj.target, "error": inj.error, "detected": False, "recovered": False,
               "time_to_detect_s": None, "time_to_recover_s": None, "steps_lost": None,
               "committed_steps_lost": None}
        if inj.kind in PROCESS_KINDS and not inj.error:
            det = next((k for k, e in enumerate(failures) if k not in used and e["time"] >= inj.time - 0.5), None)
            pid = inj.target.get("pid")
            # A second fault during a recovery may be absorbed by it: the victim is left out of the next group.
            dropped = next((e for e in formed if e["time"] >= inj.time and pid not in e.get("pids", [])), None)
            t_det = None
            if det is not None:
                used.add(det)
                t_det = failures[det]["time"]
            elif dropped is not None:
                t_det = dropped["time"]
            if t_det is not None:
                row.update(detected=True, time_to_detect_s=max(0.0, t_det - inj.time))
                rec = next((e for e in recovered if e.get("first_step_unix") and e["first_step_unix"] >= t_det), None)
                if rec is not None:
                    row.update(recovered=True, time_to_recover_s=rec["first_step_unix"] - inj.time,
                               steps_lost=rec.get("steps_lost"), restored_step=rec.get("restored_step"),
                               committed_steps_lost=max(0, (inj.committed or 0) - rec.get("restored_step", 0)))
            if inj.kind == "partition_node":  # how long the link was cut; when Ray gave the node up
                row.update(partition_s=None if inj.ended is None else round(inj.ended - inj.time, 2),
                           node_dead_after_s=inj.target.get("node_dead_after_s"))
        elif inj.kind == "storage" and not inj.error:
            end = inj.ended or float("inf")
            failed = [e for e in ckpt_failed if inj.time <= e["time"] <= end + 60]
            row.update(detected=True, checkpoint_failures=len(failed), time_to_detect_s=0.0,
                       note="faults absorbed by retries" if not failed else "saves failed and were reported")
            # recovered: training went on through the window (a step completed after it ended, or the
            # run reached its last step while the fault was still on)
            after = next((h for h in history if h.unix >= end), None)
            if after is not None:
                row.update(recovered=True, time_to_recover_s=after.unix - inj.time, steps_lost=0,
                           committed_steps_lost=0)
            elif (inj.target.get("until_end") or finished) and any(h.unix >= inj.time for h in history):
                row.update(recovered=True, steps_lost=0, committed_steps_lost=0,
                           note=row["note"] + "; the run finished with the fault still on")
        elif inj.kind == "etcd_outage" and not inj.error:
            end = inj.ended or float("inf")
            during = [h for h in history if inj.time <= h.unix <= end]
            after = next((h for h in history if h.unix >= end), None)
            row.update(detected=True, time_to_detect_s=0.0, steps_during_outage=len(during))
            if after is not None:
                row.update(recovered=True, time_to_recover_s=after.unix - inj.time, steps_lost=0,
                           committed_steps_lost=0)
        elif inj.kind in CLUSTER_KINDS and not inj.error:
            row.update(cluster_change(inj, events))
        out.append(row)
    return out


def cluster_change(inj: Injection, events: list[dict]) -> dict:
    """A drained node: detected by the run's ``preempted`` event, recovered by the resize off the node (or, when
    the node went first, by the recovery from its loss). An added node: recovered by a grow after it."""
    after = [e for e in events if e["time"] >= inj.time - 0.5]
    resized = [e for e in after if e.get("kind") == "resized" and e.get("first_step_unix")]
    if inj.kind == "add_node":
        grow = next((e for e in resized if e["to_workers"] > e["from_workers"]), None)
        if grow is None:
            return {"detected": True, "time_to_detect_s": 0.0, "note": "the run did not grow after the node joined"}
        return {"detected": True, "time_to_detect_s": 0.0, "recovered": True, "steps_lost": 0,
                "time_to_recover_s": grow["first_step_unix"] - inj.time, "committed_steps_lost": 0,
                "grew": [grow["from_workers"], grow["to_workers"]]}
    notice = next((e for e in after if e.get("kind") == "preempted" and e.get("reason") == "drain"), None)
    if notice is None:
        return {}
    out = {"detected": True, "time_to_detect_s": max(0.0, notice["time"] - inj.time), "action": notice["action"]}
    off = next((e for e in resized if "draining" in str(e.get("reason", ""))), None)
    lost = next((e for e in after if e.get("kind") == "recovered"), None)
    if off is not None and (lost is None or off["time"] <= lost["time"]):
        deadline = inj.time + inj.target.get("deadline_s", float("inf"))
        out.update(recovered=True, steps_lost=0, committed_steps_lost=0,
                   time_to_recover_s=off["first_step_unix"] - inj.time,
                   before_deadline=off["first_step_unix"] <= deadline)
    elif lost is not None:
        out.update(recovered=True, steps_lost=lost.get("steps_lost"),
                   time_to_recover_s=lost["first_step_unix"] - inj.time,
                   committed_steps_lost=max(0, (inj.committed or 0) - lost.get("restored_step", 0)),
                   note="the node went before the run could shrink off it: recovered as a failure")
    return out


def report(run_id: str, plan: ChaosPlan, rows: list[dict], status: dict, reasons: list[str],
           ref_id: str | None, loss_diff: float | None) -> dict:
    ttd = [r["time_to_detect_s"] for r in rows if r["time_to_detect_s"] is not None and r["kind"] in PROCESS_KINDS]
    ttr = [r["time_to_recover_s"] for r in rows if r["time_to_recover_s"] is not None]
    problems = list(reasons)
    for r in rows:
        if r["error"]:
            problems.append(f"fault {r['fault']} ({r['kind']}) was not injected: {r['error']}")
        elif not r["recovered"]:
            problems.append(f"fault {r['fault']} ({r['kind']}) at step {r['step']}: "
                            + ("detected but not recovered" if r["detected"] else "never detected"))
        elif r.get("committed_steps_lost"):
            problems.append(f"fault {r['fault']} ({r['kind']}): {r['committed_steps_lost']} committed steps lost")
    return {
        "run_id": run_id, "reference": ref_id, "passed": not problems, "reasons": problems,
        "faults_injected": sum(1 for r in rows if not r["error"]),
        "faults_detected": sum(1 for r in rows if r["detected"]),
        "faults_recovered": sum(1 for r in rows if r["recovered"]),
        "time_to_detect_s": {"p50": _pct(ttd, 0.5), "p95": _pct(ttd, 0.95)},
        "time_to_recover_s": {"p50": _pct(ttr, 0.5), "p95": _pct(ttr, 0.95)},
        "steps_lost": sum(r["steps_lost"] or 0 for r in rows),
        "committed_steps_lost": sum(r["committed_steps_lost"] or 0 for r in rows),
        "goodput": status.get("goodput"), "step_time_ratio": status.get("step_time_ratio"),
        "final_step": status.get("step"), "phase": status.get("phase"),
        "max_loss_rel_diff": loss_diff, "loss_rtol": plan.loss_rtol, "faults": rows,
    }


def _fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.2f} {unit}".rstrip()


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def format_report(r: dict) -> str:
    s = _fmt
    lines = [f"chaos report for run {r['run_id']}" + (f" (reference {r['reference']})" if r["reference"] else ""),
             (f"  faults: {r['faults_injected']} injected, {r['faults_detected']} detected, "
              f"{r['faults_recovered']} recovered"),
             f"  time to detect  p50 {s(r['time_to_detect_s']['p50'])}  p95 {s(r['time_to_detect_s']['p95'])}",
             f"  time to recover p50 {s(r['time_to_recover_s']['p50'])}  p95 {s(r['time_to_recover_s']['p95'])}",
             (f"  steps lost {r['steps_lost']} (committed {r['committed_steps_lost']}); goodput "
              f"{_ratio(r['goodput'])} effective, step time ratio {_ratio(r.get('step_time_ratio'))}; "
              f"final step {r['final_step']} ({r['phase']})")]
    if r["max_loss_rel_diff"] is not None:
        lines.append(f"  loss vs reference: max relative difference {r['max_loss_rel_diff']:.3g} "
                     f"(tolerance {r['loss_rtol']:g})")
    for f in r["faults"]:
        lines.append(f"  - fault {f['fault']} {f['kind']} at step {f['step']}: "
                     + (f"not injected ({f['error']})" if f["error"] else
                        f"detected {s(f['time_to_detect_s'])}, recovered {s(f['time_to_recover_s'])}, "
                        f"steps lost {f['steps_lost']}" + _partition_note(f)))
    lines.append("  PASS" if r["passed"] else "  FAIL: " + "; ".join(r["reasons"]))
    return "\n".join(lines)


def _partition_note(f: dict) -> str:
    if f["kind"] != "partition_node" or f["error"]:
        return ""
    dead = f.get("node_dead_after_s")
    ray_view = "the node still alive for Ray when healed" if dead is None else f"node declared dead after {dead:.2f} s"
    t = f["target"]
    return f"; link {t.get('link')} ({t.get('netns')}) cut for {_fmt(f.get('partition_s'))}, {ray_view}"
