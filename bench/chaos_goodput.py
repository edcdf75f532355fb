"""Goodput under chaos: the tiny config with a worker killed every minute, against the same run
without faults, one after the other on the same local Ray.

    python bench/chaos_goodput.py [--quick] [--every 60] [--steps N]

Both runs: 2 workers and one warm standby on a local Ray (127.0.0.1), a
checkpoint every 20 steps. The chaos run gets ``kill_worker`` every
``--every`` seconds (a random member, seeded) through ``orchestrator.chaos``,
and is judged by the chaos oracle against the failure-free run (same final
step, every sample once, loss within 1e-3 at every step, every checkpoint
verifies, nothing committed lost).

Prints the chaos run's effective goodput first, then one JSON line last:
``goodput`` (effective training time over wall time of the chaos run: the time of
the steps the final model holds, redone steps left out, as ``etrain_goodput_ratio``
reports it), ``step_time_ratio`` (every trained step's time, redone ones too, over
the same wall time: ``etrain_step_time_ratio``, what ``goodput`` meant before),
both again for the failure-free run (``goodput_no_faults``,
``step_time_ratio_no_faults``), the ratio of the two goodputs, the faults, time to
detect / recover (p50, p95), steps lost and whether the oracle passed. Target:
effective goodput >= 0.95 with a fault every 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="1200 steps per run (about 25 minutes in all on a loaded 2-core machine)")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between kills")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: about 10 faults' worth)")
    return ap.parse_args()


def main() -> None:
    args = parse()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from orchestrator.chaos.cli import judge
    from orchestrator.chaos.injector import Chaos
    from orchestrator.chaos.plan import load_plan
    from orchestrator.driver.run import BackgroundRun, connect, prepare_run

    steps = args.steps or (1200 if args.quick else 4000)
    root = f"file://{tempfile.mkdtemp(prefix='etrain-goodput-')}/runs"
    base = ['model.preset="tiny"', "data.max_bytes=2000000", "train.global_batch=12", "train.micro_batch=1",
            f"train.steps={steps}", "train.log_every=100000", "checkpoint.interval_steps=20",
            'metrics.file_sd_dir="-"', "elastic.standby=1", f'checkpoint.url="{root}"']
    connect(None, num_cpus=3)

    def run(run_id: str, plan=None) -> tuple[dict, Chaos | None]:
        spec, st = prepare_run("examples/tiny.toml", base, workers=2, min_workers=1, max_workers=2,
                               run_id=run_id, store=root)
        bg = BackgroundRun(spec, st)
        chaos = None
        if plan is not None:
            chaos = Chaos(run_id, st, plan)
            t = threading.Thread(target=chaos.run, kwargs={"timeout_s": 24 * 3600}, daemon=True)
            t.start()
        final = bg.join(timeout=24 * 3600)
        bg.close()
        return final, chaos, st

    ref, _, st = run("no-faults")
    plan = load_plan(None, [f"kind=kill_worker,every_s={args.every}"])
    plan.seed = 3
    final, chaos, st = run("chaos", plan)
    result = judge("chaos", st, plan, chaos, final, "no-faults")
    print(f"chaos: effective goodput {final['goodput']:.3f} (step time ratio {final['step_time_ratio']:.3f}), "
          f"{result['faults_injected']} kills, {result['steps_lost']} steps lost; no faults: effective goodput "
          f"{ref['goodput']:.3f} (step time ratio {ref['step_time_ratio']:.3f}); oracle "
          f"{'PASS' if result['passed'] else 'FAIL: ' + '; '.join(result['reasons'])}")
    print(json.dumps({
        "bench": "chaos_goodput", "steps": steps, "fault_every_s": args.every,
        "goodput": round(final["goodput"], 4), "step_time_ratio": round(final["step_time_ratio"], 4),
        "goodput_no_faults": round(ref["goodput"], 4), "step_time_ratio_no_faults": round(ref["step_time_ratio"], 4),
        "goodput_ratio_vs_no_faults": round(final["goodput"] / ref["goodput"], 4),
        "faults_injected": result["faults_injected"], "faults_recovered": result["faults_recovered"],
        "time_to_detect_s": result["time_to_detect_s"], "time_to_recover_s": result["time_to_recover_s"],
        "steps_lost": result["steps_lost"], "committed_steps_lost": result["committed_steps_lost"],
        "oracle_passed": result["passed"], "max_loss_rel_diff": result["max_loss_rel_diff"],
    }), flush=True)


if __name__ == "__main__":
    main()
