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
fault was injected, detected and recovered without losing a committed step; a fault inside the trainer
(``bitflip``, ``poison_batch``) must also get the verdict its kind calls for (:func:`expected_verdict`).
Nothing here reads the store or the cluster: the rows are computed from the events and history handed in.
"""

from __future__ import annotations

from ..store.run_store import HistoryRow
from .injector import Injection
from .plan import CLUSTER_KINDS, IN_PROCESS_KINDS, PROCESS_KINDS, ChaosPlan


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
    used_sdc: set[int] = set()
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
        elif inj.kind in IN_PROCESS_KINDS and not inj.error:
            row.update(silent_fault(inj, events, history, used_sdc))
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


def expected_verdict(inj: Injection) -> str | None:
    """The verdict the trainer must reach: a poisoned batch is the data's; a transient flip is found and
    replayed clean; a persistent flip of the state (param, optimizer) comes back on its rank. A persistent
    flip of a gradient or an activation leaves no trace in the state, and the trainer may judge it the data's
    (it never evicts a rank on a loss alone): no expectation."""
    if inj.kind == "poison_batch":
        return "data"
    if not inj.target.get("persistent"):
        return "transient"
    return "persistent" if inj.target.get("target") in ("param", "optimizer") else None


def silent_fault(inj: Injection, events: list[dict], history: list[HistoryRow], used: set[int]) -> dict:
    """A fault inside the trainer: detected by the run's ``sdc`` event at or after the step it fires at (its
    verdict and step; ``steps_to_detect`` from the fault's step), recovered by the ``rollback`` just before it
    (its ``seconds``, the restore and the replay, are the time to recover; its ``steps_reworked`` the steps
    lost). A persistent one is recovered by the eviction: the first step after the resize without the rank.
    Time to detect: from the end of the step before the fault's to the rollback's start."""
    at = int(inj.target.get("fires_at_step") or inj.step)
    out: dict = {"fires_at_step": at, "expected_verdict": expected_verdict(inj)}
    sdc = [k for k, e in enumerate(events) if e.get("kind") == "sdc" and k not in used
           and e.get("time", 0.0) >= inj.time - 0.5 and int(e.get("step") or 0) >= at]
    if inj.kind == "poison_batch":  # the data's verdict at the poisoned step, when there is one
        sdc = sorted(sdc, key=lambda k: (events[k].get("verdict") != "data", events[k].get("step") != at))
    if not sdc:
        return out
    k = sdc[0]
    used.add(k)
    e = events[k]
    out.update(detected=True, verdict=e.get("verdict"), detected_at_step=e.get("step"),
               steps_to_detect=int(e.get("step") or 0) - at, sdc_rank=e.get("rank"), sdc_node=e.get("node"),
               sdc_target=e.get("target"))
    if e.get("samples") is not None:
        out["samples"] = e["samples"]
    rb = next((r for r in reversed(events[:k]) if r.get("kind") == "rollback" and r.get("step") == e.get("step")), None)
    fired = next((h.unix for h in history if h.step == at - 1 and h.unix >= inj.time), inj.time)
    detected_unix = e["time"] - (rb["seconds"] if rb else 0.0)
    out["time_to_detect_s"] = max(0.0, detected_unix - fired)
    if rb is not None:
        out["rollback"] = {key: rb.get(key) for key in ("from_step", "to_step", "seconds", "steps_reworked")}
    if e.get("verdict") in ("transient", "data") and rb is not None:
        out.update(recovered=True, time_to_recover_s=rb["seconds"], steps_lost=rb.get("steps_reworked"),
                   committed_steps_lost=0)
    elif e.get("verdict") == "persistent":
        act = next((h for h in events if h.get("kind") == "health" and h.get("action")
                    and h.get("time", 0.0) >= inj.time), None)
        out["action"] = act.get("action") if act else None
        resized = next((r for r in events if r.get("kind") == "resized" and act and r.get("first_step_unix")
                        and r["time"] >= act["time"]), None)
        if out["action"] == "evict" and resized is not None:
            out.update(recovered=True, time_to_recover_s=resized["first_step_unix"] - detected_unix, steps_lost=0,
                       committed_steps_lost=0, evicted_rank=act.get("rank"))
        elif out["action"] == "stop":
            out["note"] = "the run suspended at its verified step (health.on_persistent = \"stop\")"
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
        if r["detected"] and r.get("expected_verdict") and r.get("verdict") != r["expected_verdict"]:
            problems.append(f"fault {r['fault']} ({r['kind']}) at step {r['fires_at_step']} was judged "
                            f"{r.get('verdict')!r}, not {r['expected_verdict']!r}")
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
    if r.get("skipped_ranges"):
        lines.append(f"  samples skipped as the data's: {r['skipped_ranges']}")
    if r.get("loss_note"):
        lines.append(f"  loss compared: {r['loss_note']}")
    for f in r["faults"]:
        lines.append(f"  - fault {f['fault']} {f['kind']} at step {f['step']}: "
                     + (f"not injected ({f['error']})" if f["error"] else
                        f"detected {s(f['time_to_detect_s'])}, recovered {s(f['time_to_recover_s'])}, "
                        f"steps lost {f['steps_lost']}" + _partition_note(f) + _silent_note(f)))
    lines.append("  PASS" if r["passed"] else "  FAIL: " + "; ".join(r["reasons"]))
    return "\n".join(lines)


def _partition_note(f: dict) -> str:
    if f["kind"] != "partition_node" or f["error"]:
        return ""
    dead = f.get("node_dead_after_s")
    ray_view = "the node still alive for Ray when healed" if dead is None else f"node declared dead after {dead:.2f} s"
    t = f["target"]
    return f"; link {t.get('link')} ({t.get('netns')}) cut for {_fmt(f.get('partition_s'))}, {ray_view}"


def _silent_note(f: dict) -> str:
    if f["kind"] not in IN_PROCESS_KINDS or f["error"]:
        return ""
    if not f["detected"]:
        return f"; fired at step {f.get('fires_at_step')}, no sdc event after it"
    rb = f.get("rollback") or {}
    where = f" on rank {f['sdc_rank']}" if f.get("sdc_rank") is not None else ""
    return (f"; fired at step {f['fires_at_step']}, {f['verdict']}{where} at step {f['detected_at_step']}"
            + (f", rolled back to step {rb['to_step']}" if rb.get("to_step") is not None else "")
            + (f", samples {f['samples']} skipped" if f.get("samples") else "")
            + (f", rank {f['evicted_rank']} evicted" if f.get("evicted_rank") is not None else ""))
