"""``etrain demo`` (``make demo``): the main job on embedded defaults, with a failure, a resize and a suspend.

    etrain demo [--steps 120] [--root file:///tmp/runs]

On a local Ray (127.0.0.1) and local storage (``./runs``), it trains the tiny
model on 2 workers with one warm standby (``elastic.standby = 1``) and, while
the run goes on, does what an operator and bad luck would do:

1. SIGKILLs one worker process mid-run: the survivor keeps its process, the
   standby takes the dead worker's place, the group restores the newest
   checkpoint;
2. resizes the run 2 -> 3 workers (``etrain resize``), at a step boundary;
3. suspends it (``etrain suspend``): a checkpoint is committed and every
   worker released;
4. resumes it on 2 workers (``etrain resume --workers 2``) and finishes.

Then it prints a summary table from the run's events: recoveries, time to
recover, steps lost, resize time, final loss.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

from rich.console import Console
from rich.table import Table

from checkpointing.cli_args import ArgumentParser

from ..phase import Phase
from ..driver.progress import from_tier
from ..driver.run import BackgroundRun, connect, prepare_resume, prepare_run
from ..store.urls import default_root

console = Console()


TINY = os.path.join("examples", "tiny.toml")
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where etrain's examples/ live


def say(text: str) -> None:
    console.print(f"[bold cyan]demo:[/] {text}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(
        prog="etrain demo", description="A local run with a killed worker (a standby takes its place), a resize "
        "2 -> 3, a suspend and a resume on 2 workers, then a summary table of what happened.")
    ap.add_argument("--steps", type=int, default=120, help="steps the run trains (default 120)")
    ap.add_argument("--root", default=None, help="where checkpoints and the run store live (default ./runs)")
    ap.add_argument("--config", default=None, help="the run config (default examples/tiny.toml, here or in "
                    "etrain's checkout)")
    args = ap.parse_args(argv)
    config = args.config or next((c for c in (TINY, os.path.join(CHECKOUT, TINY)) if os.path.isfile(c)), TINY)
    if not os.path.isfile(config):  # refused before Ray starts (it was a traceback from the run preparation)
        ap.error(f"--config {config!r} does not exist; pass a run config, e.g. etrain's {TINY}")
    steps = args.steps
    root = args.root or default_root()
    run_id = f"demo-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"
    overrides = [f"train.steps={steps}", "data.seq_len=32", "data.max_bytes=2000000", "train.log_every=1000",
                 f'checkpoint.url="{root}"', "checkpoint.interval_steps=10", "elastic.standby=1",
                 "elastic.grow_into_idle=false"]  # the demo's own resize takes it to 3, not the allocator
    t_start = time.monotonic()
    local = connect(None, num_cpus=4)  # 3 workers at most + 1 standby
    try:
        return _demo(config, overrides, steps, root, run_id, t_start)
    finally:
        if local:
            import ray

            ray.shutdown()


def _demo(config: str, overrides: list[str], steps: int, root: str, run_id: str, t_start: float) -> int:
    kill_at, resize_at, suspend_at = steps // 5, (2 * steps) // 5, (3 * steps) // 5
    spec, store = prepare_run(config, overrides, workers=2, max_workers=3, run_id=run_id, store=root)
    say(f"run {run_id!r}: the tiny model on 2 workers for {steps} steps; checkpoints and the run store in {root}")

    run = BackgroundRun(spec, store, progress=False)
    run.wait(lambda s: s["phase"] == Phase.RUNNING and s["step"] >= kill_at, what=f"step {kill_at}")
    pids = run.events("formed")[-1]["pids"]
    say(f"step {run.snapshot()['step']}: SIGKILL worker pid {pids[-1]} (rank {len(pids) - 1})")
    os.kill(pids[-1], signal.SIGKILL)
    run.wait_event("recovered")

    run.wait(lambda s: s["phase"] == Phase.RUNNING and s["step"] >= resize_at, what=f"step {resize_at}")
    say(f"step {run.snapshot()['step']}: etrain resize {run_id} --workers 3")
    store.update_spec(run_id, workers=3)
    run.wait_event("resized")

    run.wait(lambda s: s["phase"] == Phase.RUNNING and s["step"] >= suspend_at, what=f"step {suspend_at}")
    say(f"step {run.snapshot()['step']}: etrain suspend {run_id}")
    store.update_spec(run_id, suspended=True)
    suspended = run.join()
    if Phase.of(suspended) != Phase.SUSPENDED:
        say(f"the run ended {suspended.get('phase')} instead of SUSPENDED: {suspended.get('reason')}")
        return 1

    say(f"suspended at step {suspended['step']}; every worker released. etrain resume {run_id} --workers 2")
    spec, store = prepare_resume(run_id, root, workers=2)
    final = BackgroundRun(spec, store, progress=False).join()
    console.print(summary(store.events(run_id), final, time.monotonic() - t_start))
    ok = Phase.of(final) == Phase.FINISHED and final.get("step") == steps
    say(f"run {final.get('phase')} at step {final.get('step')}/{steps}; "
        f"`etrain events {run_id} --store {root}` lists every event")
    return 0 if ok else 1


def summary(events: list[dict], final: dict, wall_s: float) -> Table:
    rec = [e for e in events if e["kind"] == "recovered"]
    res = [e for e in events if e["kind"] == "resized"]
    sus = [e for e in events if e["kind"] == "suspended"]
    formed = [e for e in events if e["kind"] == "formed"]
    t = Table("figure", "value", title="etrain demo: summary")
    t.add_row("recoveries", str(len(rec)))
    for e in rec:
        t.add_row("  time to recover", f"{e['time_to_recover_s']:.2f} s ({e['world_before']} -> {e['world_after']} "
                                       f"workers, restored step {e['restored_step']}{from_tier(e)})")
        t.add_row("  steps lost", str(e["steps_lost"]))
    for e in res:
        t.add_row("resize", f"{e['from_workers']} -> {e['to_workers']} workers in {e['resize_s']:.2f} s, "
                            f"at step {e['step']}{from_tier(e)}")
    for e in sus:
        t.add_row("suspended", f"at step {e['step']} (checkpoint committed: {e['checkpoint_committed']})")
    if formed:
        t.add_row("resumed", f"on {formed[-1]['world_size']} workers from step {formed[-1]['restored_from']}")
    t.add_row("final step", f"{final.get('step')}/{final.get('total_steps')} ({final.get('phase')})")
    t.add_row("final loss", f"{final['loss']:.4f}" if final.get("loss") is not None else "-")
    t.add_row("wall time", f"{wall_s:.0f} s")
    return t


if __name__ == "__main__":
    raise SystemExit(main())
