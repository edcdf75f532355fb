"""Recovery and resize of an etrain run against torchrun's restart and torchft's healing, same kills.

    python bench/recovery.py [--quick] [--kills 3] [--workers 2] [--resizes 3]

etrain: a run on a local Ray (127.0.0.1) with ``workers`` TrainWorkers,
checkpointing every 10 steps and with the memory tier on (the default:
a snapshot after every step, one copy in a peer's memory), twice: with one
warm standby worker (``elastic.standby = 1``: the standby takes the dead
worker's place) and with none (the survivors go on smaller at once and the
group grows back when the replacement is up). Every few steps (once the
standby is up, with one) one worker process is SIGKILLed; the figure is the time from the kill to the first step
completed after the recovery (``mttr_s`` with the standby,
``mttr_no_standby_s`` without; medians over kills), the steps redone
(``steps_lost``, with ``steps_lost_median`` and ``steps_lost_max`` over every
kill; target <= 1), where each recovery restored from (``restored_from``:
``memory``, or ``durable`` when memory could not serve), and whether any
recovery restored a step older than the newest commit
(``committed_steps_lost`` must be 0). Then resizes to ``workers + 1`` and
back: ``resize_s`` is the time from the request to the first step completed
at the new size, the median of ``resizes`` grows with a ready standby
(``resize_phases``: the median grow's phases: notice, stop at the boundary,
memory flush, form, plan, restore); without a standby one grow, which also
waits for the new process to boot.

The run with a standby also has one rank SIGSTOPped inside its step after its kills
(``--hang-timeout``, ``elastic.hang_timeout_s``): ``mttr_hang_s`` is the time from the
stop to the first step after the recovery (detected after the hang timeout, the hung
rank killed, the others released from the collective at once), with
``steps_lost_hang``, where it restored from and whether the survivors kept their
processes (``hang_survivors_kept``).

Baselines, in the same run: the same trainer and checkpoint interval under
``torchrun --max-restarts`` (which restarts every process and resumes from the
newest checkpoint), a rank killed the same way; ``baseline_torchrun_mttr_s``
is the time from the kill to the first step logged after the restart. And
torchft (``bench/torchft_baseline.py``, when it is installed): two replica
groups of the same model, one killed and replaced, healing from the live
one (``baseline_torchft_*``; ``baseline_torchft_error`` says why not, when
it cannot run).

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import stop_session, wait_for  # noqa: E402  (after the path: run as a script)
from orchestrator.phase import Phase  # noqa: E402

HUNG_S = 60  # a torchrun restart with no step after this long counts as hung (a normal one: 3-9 s here)
BASE = ["run_id=bench", "model.preset=\"tiny\"", "data.max_bytes=2000000", "train.global_batch=12",
        "train.micro_batch=1", "train.lr=0.003", "checkpoint.interval_steps=10", "checkpoint.keep_last=3"]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 kills each (a few minutes here)")
    ap.add_argument("--kills", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--every", type=int, default=15, help="steps between kills")
    ap.add_argument("--hang-timeout", type=float, default=6.0, help="elastic.hang_timeout_s of the run with a "
                    "standby, which also has one rank SIGSTOPped after its kills (0: no hang)")
    ap.add_argument("--resizes", type=int, default=3, help="grows (and shrinks back) with a standby")
    return ap.parse_args()


# --- etrain ------------------------------------------------------------------------


def bench_etrain(root: str, kills: int, every: int, workers: int, standby: int, resizes: int = 3,
                 hang_timeout_s: float = 0.0) -> dict:
    import ray

    from orchestrator.driver.run import BackgroundRun, connect, prepare_run

    steps = every * (kills + 2) + 30 + 40 * resizes
    overrides = [*BASE, f"train.steps={steps}", f"checkpoint.url=\"file://{root}/etrain-{standby}\"",
                 f"elastic.standby={standby}", f"run_id=\"bench-standby{standby}\"",
                 "elastic.grow_into_idle=false"]  # the sizes are the benchmark's own resizes, not the allocator's
    if hang_timeout_s:
        overrides.append(f"elastic.hang_timeout_s={hang_timeout_s}")
    connect(None, num_cpus=workers + 1 + standby)
    spec, store = prepare_run(None, overrides, workers=workers, max_workers=workers + 1)
    run = BackgroundRun(spec, store)

    mttr, lost, committed_lost, tiers = [], [], 0, []
    for k in range(kills):
        target = every * (k + 1) + 3
        # With a standby, a kill waits for it to be up: mttr_s is the recovery with one (a kill before the
        # replacement of the last one booted would measure the recovery without).
        s = run.wait(lambda x: x["phase"] == Phase.RUNNING and x["step"] >= target and x["world_size"] == workers
                     and x["standby_ready"] >= standby, what=f"step {target} on {workers} workers")
        committed = s["latest_checkpoint"]
        victim = run.events("formed")[-1]["pids"][-1]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        rec = run.wait_event("recovered", k + 1)
        mttr.append(rec["first_step_unix"] - t_kill)
        lost.append(rec["steps_lost"])
        tiers.append(rec.get("tier"))
        if committed is not None and rec["restored_step"] < committed:
            committed_lost += committed - rec["restored_step"]
        print(f"etrain (standby {standby}) kill {k + 1}: step {s['step']}, pid {victim}: recovered in "
              f"{mttr[-1]:.2f} s on {rec['world_after']} workers ({_timeline(rec, t_kill)}), {rec['steps_lost']} steps "
              f"redone, restored {rec['restored_step']} from {rec.get('tier')} (newest commit {committed})",
              flush=True)
    hang = {}
    if hang_timeout_s:  # a rank SIGSTOPped inside its step: detected after hang_timeout_s, the others released
        s = run.wait(lambda x: x["phase"] == Phase.RUNNING and x["world_size"] == workers
                     and x["standby_ready"] >= standby, what="a steady group before the hang")
        pids = run.events("formed")[-1]["pids"]
        victim = pids[-1]
        t_stop = time.time()
        os.kill(victim, signal.SIGSTOP)
        rec = run.wait_event("recovered", kills + 1)
        hang = {"mttr_hang_s": rec["first_step_unix"] - t_stop, "steps_lost_hang": rec["steps_lost"],
                "tier_hang": rec.get("tier"), "phases_hang": rec.get("phases"),
                "survivors_kept": set(pids[:-1]) <= set(run.events("formed")[-1]["pids"])}
        print(f"etrain (standby {standby}) hang of pid {victim} at step {s['step']}: recovered in "
              f"{hang['mttr_hang_s']:.2f} s (hang timeout {hang_timeout_s} s), {rec['steps_lost']} steps redone, "
              f"from {rec.get('tier')} ({_timeline(rec, t_stop)})", flush=True)
    # Resizes from a steady state: a full group, and the standby (if any) up again. Grows to
    # ``workers + 1`` and shrinks back, ``resizes`` times; ``resize_s`` is the median grow.
    grows, shrinks, grow_phases = [], [], []
    for r in range(resizes):
        for size in (workers + 1, workers):
            run.wait(lambda x, n=size: x["phase"] == Phase.RUNNING and x["world_size"] == (workers + workers + 1 - n)
                     and x["standby_ready"] >= (standby if n > workers else 0), what="a steady group")
            t_req = time.time()
            store.update_spec(spec.run_id, workers=size)
            # Only a resize to the new size: a grow back after the last failure is a resize too.
            rs = run.wait_event("resized", len(run.events("resized")) + 1)
            while rs["to_workers"] != size:
                rs = run.wait_event("resized", len(run.events("resized")) + 1)
            took = rs["first_step_unix"] - t_req
            (grows if size > workers else shrinks).append(took)
            if size > workers:
                grow_phases.append({**rs.get("phases", {}), "tier": rs.get("tier")})
            print(f"etrain (standby {standby}) resize {rs['from_workers']} -> {size}: {took:.2f} s from request to "
                  f"the first step ({rs.get('phases')})", flush=True)
            if standby == 0 and size > workers:  # without a standby every grow waits for a boot: one is enough
                break
        if standby == 0:
            break
    store.update_spec(spec.run_id, stop=True)  # the rest of the steps would measure nothing
    result = run.join()
    ray.shutdown()
    return {**hang, "mttr": mttr, "steps_lost": lost, "committed_steps_lost": committed_lost, "grows": grows,
            "shrinks": shrinks, "tiers": tiers, "grow_phases": grow_phases,
            "final_phase": result.get("phase"), "final_step": result.get("step"), "steps": steps}


def _timeline(rec: dict, t_fault: float) -> dict:
    """A recovery's phases with the two ends the controller does not time: ``detect_s`` (from the fault to
    the controller's detection) and ``after_s`` (from the group restored to its first step completed)."""
    phases = rec.get("phases") or {}
    inside = sum(phases.get(k, 0.0) for k in ("settle_s", "wait_replacement_s", "form_s", "plan_s", "restore_s"))
    return {"detect_s": round(rec["detected_unix"] - t_fault, 3), **phases,
            "after_s": round(rec["first_step_unix"] - rec["detected_unix"] - inside, 3)}


# --- torchrun --------------------------------------------------------------------------


def bench_torchrun(root: str, kills: int, every: int, workers: int, max_hung: int = 3) -> dict:
    """``kills`` measured restarts; a restart that hangs is counted and the baseline starts over."""
    mttr, lost, hung, attempt = [], [], 0, 0
    while len(mttr) < kills and hung < max_hung:
        attempt += 1
        got, got_lost, hang = _torchrun_attempt(os.path.join(root, f"torchrun-{attempt}"), kills - len(mttr),
                                                every, workers)
        mttr += got
        lost += got_lost
        hung += hang
    return {"mttr": mttr, "steps_lost": lost, "hung": hung}


def _torchrun_attempt(root: str, kills: int, every: int, workers: int) -> tuple[list, list, int]:
    from orchestrator.chaos import procfs
    from tests.harness import free_port

    os.makedirs(root, exist_ok=True)
    steps = every * (kills + 2) + 30
    log = os.path.join(root, "steps.jsonl")
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), f"--nproc_per_node={workers}",
           f"--max-restarts={kills}", "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "trainer",
           "--quiet", "--log-file", log]
    for o in [*BASE, f"train.steps={steps}", f"checkpoint.url=\"file://{root}\"", "checkpoint.resume=true"]:
        cmd += ["--set", o]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)

    def rows():
        try:
            with open(log) as f:
                return [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []

    mttr, lost, hung = [], [], 0
    try:
        for k in range(kills):
            target = every * (k + 1) + 3
            try:
                wait_for(lambda: rows() and rows()[-1]["step"] >= target, 300, "a step", poll=0.05)
            except TimeoutError:  # a restart of its own (a rank failed) that hung: count it, start over
                hung += 1
                print(f"torchrun: step {target} not reached within 300 s (a restart hung)", flush=True)
                break
            ranks = {procfs.environ(c).get("RANK"): c for c in procfs.children(proc.pid)}
            victim = ranks.get(str(workers - 1))
            if victim is None:
                raise RuntimeError("no rank process found under torchrun")
            n_before, last_step = len(rows()), rows()[-1]["step"]
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            try:
                first = wait_for(lambda: len(r := rows()) > n_before and r[n_before], HUNG_S, "a step after restart")
            except TimeoutError:  # torchrun's restart can hang: count it, start the baseline over
                hung += 1
                print(f"torchrun kill: no step within {HUNG_S} s of the restart (hung)", flush=True)
                break
            mttr.append(first["time"] - t_kill)
            lost.append(max(0, last_step - (first["step"] - 1)))
            print(f"torchrun kill: step {last_step}: first step after restart in {mttr[-1]:.2f} s, "
                  f"{lost[-1]} steps redone", flush=True)
    finally:
        stop_session(proc)
    return mttr, lost, hung


def main() -> int:
    args = parse()
    kills = args.kills or (2 if args.quick else 4)
    from bench.torchft_baseline import bench_torchft, torchft_available

    with tempfile.TemporaryDirectory(prefix="etrain-bench-recovery-") as root:
        base = bench_torchrun(root, kills, args.every, args.workers)
        ft_ok, ft_why = torchft_available()
        ft = bench_torchft(root, kills, args.every) if ft_ok else {"mttr": [], "steps_lost": [], "ok": False,
                                                                    "error": ft_why}
        bare = bench_etrain(root, kills, args.every, args.workers, standby=0, resizes=1)
        warm = bench_etrain(root, kills, args.every, args.workers, standby=1, resizes=args.resizes,
                            hang_timeout_s=args.hang_timeout)
    med = statistics.median
    base_mttr = med(base["mttr"]) if base["mttr"] else float("nan")
    middle = sorted(range(len(warm["grows"])), key=warm["grows"].__getitem__)[len(warm["grows"]) // 2]
    out = {
        "mttr_s": round(med(warm["mttr"]), 3),  # with one warm standby (elastic.standby = 1)
        "mttr_all_s": [round(x, 3) for x in warm["mttr"]],
        "mttr_no_standby_s": round(med(bare["mttr"]), 3),  # survivors go on smaller, grow back later
        "mttr_no_standby_all_s": [round(x, 3) for x in bare["mttr"]],
        "steps_lost": warm["steps_lost"],
        "steps_lost_no_standby": bare["steps_lost"],
        "steps_lost_median": med(warm["steps_lost"] + bare["steps_lost"]),  # per killed worker; target <= 1
        "steps_lost_max": max(warm["steps_lost"] + bare["steps_lost"]),
        "restored_from": warm["tiers"] + bare["tiers"],  # memory, or durable (the fallback)
        "committed_steps_lost": warm["committed_steps_lost"] + bare["committed_steps_lost"],
        "resize_s": round(med(warm["grows"]), 3),  # grow workers -> workers + 1, a standby ready; median
        "resize_all_s": [round(x, 3) for x in warm["grows"]],
        "resize_phases": warm["grow_phases"][middle],  # of the median grow: where its time went
        "resize_shrink_s": round(med(warm["shrinks"]), 3),
        "resize_no_standby_s": round(med(bare["grows"]), 3),  # the grow waits for a new process to boot
        "baseline_torchrun_mttr_s": round(base_mttr, 3),
        "baseline_all_s": [round(x, 3) for x in base["mttr"]],
        "baseline_steps_lost": base["steps_lost"],
        "baseline_hung_restarts": base["hung"],
        "mttr_ratio_vs_torchrun": round(med(warm["mttr"]) / base_mttr, 3),
        "mttr_no_standby_ratio_vs_torchrun": round(med(bare["mttr"]) / base_mttr, 3),
        # torchft (bench/torchft_baseline.py): two replica groups, one killed and replaced, healing from the other
        "baseline_torchft_mttr_s": round(med(ft["mttr"]), 3) if ft["mttr"] else None,
        "baseline_torchft_all_s": [round(x, 3) for x in ft["mttr"]],
        "baseline_torchft_survivor_stall_s": [round(x, 3) for x in ft.get("survivor_stall", [])],
        "baseline_torchft_steps_lost": ft["steps_lost"],
        "baseline_torchft_error": ft.get("error", ""),
        # A rank SIGSTOPped inside its step (the run with a standby): from the stop to the first step after
        # the recovery; target <= hang_timeout_s + 2 s. The survivors keep their processes.
        "mttr_hang_s": round(warm["mttr_hang_s"], 3) if "mttr_hang_s" in warm else None,
        "hang_timeout_s": args.hang_timeout,
        "steps_lost_hang": warm.get("steps_lost_hang"),
        "hang_restored_from": warm.get("tier_hang"),
        "hang_survivors_kept": warm.get("survivors_kept"),
        "final_phases": [bare["final_phase"], warm["final_phase"]],
        "workers": args.workers,
        "kills": kills,
    }
    print(json.dumps(out))
    ok = all(r["final_phase"] == Phase.FINISHED for r in (bare, warm)) and out["committed_steps_lost"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
