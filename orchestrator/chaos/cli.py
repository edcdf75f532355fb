"""``etrain chaos``: inject faults into a live run, then judge it against a failure-free reference.

    etrain chaos RUN --plan chaos.toml [--reference [REF_RUN]] [--plot run.png] [--json]
    etrain chaos RUN --fault kind=kill_worker,at_step=10 --fault kind=hang_rank,every_s=60,max_count=2

    result = judge(run_id, store, plan, chaos, final, ref_id)   # the same report, from Python

``etrain chaos`` connects to the run's Ray cluster (``--address``), drives the plan
(``orchestrator.chaos.plan``) with the injector (``orchestrator.chaos.injector``) until the run ends,
runs or reuses the reference (the same config under another id, no faults) when ``--reference`` is
given, and prints the report (``orchestrator.chaos.report``) with the oracle's verdict
(``orchestrator.chaos.oracle``). Exit status: 0 when the run passed, 1 when it failed, 2 for a bad plan
(a ConfigError, raised before anything is injected).

A partition needs a link to cut: the nodes of a one-machine Ray cluster share one loopback interface,
so ``partition_node`` works on nodes started in network namespaces of their own on the machine where
``etrain chaos`` runs (``python -m orchestrator.chaos.netns node ...``), and says so for any other node.
"""

from __future__ import annotations

import json
import logging
import os

from checkpointing.errors import ConfigError

from ..phase import Phase
from ..store.run_store import RunStore
from .injector import Chaos
from .oracle import (checkpoint_skipped, final_trajectory, loss_rel_diff, loss_steps, oracle, replayed_steps,
                     skipped_ranges, stale_commits, verify_committed)
from .plan import ChaosPlan, load_plan
from .plot import plot
from .report import assess, format_report, report

log = logging.getLogger("etrain")


def reference_run(spec, store: RunStore, ref_id: str, address: str | None, skip_ranges: list | None = None) -> dict:
    """The failure-free reference: reuse ``ref_id`` when it FINISHED, else run the same config
    under that id (same workers, same checkpoint root) to the end. ``skip_ranges``: the samples the run
    skipped as the data's ([health]), which a new reference skips too (``data.skip_ranges``), so that the
    loss compares at every step after them."""
    from ..driver.run import launch
    from ..store.run_store import RunSpec, UnknownRun

    try:
        store.get_spec(ref_id)
        st = store.get_status(ref_id) or {}
        if Phase.of(st) == Phase.FINISHED:
            return st
        raise ConfigError(f"reference run {ref_id!r} exists but is {Phase.of(st)}; "
                          "name a finished one, or another id for a new reference")
    except UnknownRun:
        pass
    config = json.loads(json.dumps(spec.config))
    config["run_id"] = ref_id
    if skip_ranges:
        config.setdefault("data", {})["skip_ranges"] = [list(r) for r in skip_ranges]
    ref = RunSpec(run_id=ref_id, config=config, workers=spec.workers, min_workers=spec.min_workers,
                  max_workers=spec.max_workers)
    store.create_run(ref)
    log.warning("chaos: running the reference %s (the same config, no faults)", ref_id)
    return launch(ref, store, address=address, progress=False)


def judge(run_id: str, store: RunStore, plan: ChaosPlan, chaos: Chaos | None, final: dict,
          ref_id: str | None = None) -> dict:
    """The report of a run that ended: detection and recovery of every fault, and the oracle."""
    from ..driver.run import parse_spec

    cfg = parse_spec(store.get_spec(run_id))[0]
    history = store.get_history(run_id)
    ref = None
    ref_skipped: list = []
    if ref_id is not None:
        ref = {"status": store.get_status(ref_id) or {}, "history": store.get_history(ref_id)}
        ref_skipped = parse_spec(store.get_spec(ref_id))[0].data.skip_ranges
    problems, cursor = verify_committed(cfg.checkpoint.url, run_id)
    events = store.events(run_id)
    restored = max((e.get("restored_from") or 0 for e in events if e.get("kind") == "formed"), default=0)
    skipped, replayed = skipped_ranges(events, cfg.data.skip_ranges), replayed_steps(events, history)
    reasons = oracle({"status": final, "history": history}, ref, total_steps=cfg.train.steps,
                     global_batch=cfg.train.global_batch, rtol=plan.loss_rtol, atol=plan.loss_atol,
                     verify_problems=problems, final_cursor=cursor, restored_up_to=restored, skipped=skipped,
                     checkpoint_skipped=checkpoint_skipped(cfg.checkpoint.url, run_id), ref_skipped=ref_skipped,
                     replayed=replayed)
    reasons += stale_commits(cfg.checkpoint.url, run_id, events)
    rows = assess(chaos.injections if chaos else [], events, history)
    diff, note = None, None
    if ref:
        steps, note = loss_steps(final_trajectory(history), final_trajectory(ref["history"]),
                                 global_batch=cfg.train.global_batch, skipped=skipped, ref_skipped=ref_skipped,
                                 replayed=replayed)
        diff = loss_rel_diff(history, ref["history"], set(steps))
    out = report(run_id, plan, rows, final, reasons, ref_id, diff)
    out.update(skipped_ranges=skipped, loss_note=note)
    out["checkpoints_verified"] = len(problems)
    out["steps_without_history"] = sum(1 for s in range(1, cfg.train.steps + 1)
                                       if s not in final_trajectory(history))
    return out


def draw_plot(path: str, store: RunStore, run_id: str, result: dict, ref_id: str | None = None) -> list[dict]:
    """``--plot``: the run's loss and world size, its injected faults (``result["faults"]``) and its
    failures, recoveries, resizes, suspends and resumes (its events) marked; returns the marks."""
    return plot(path, store.get_history(run_id), result["faults"], store.get_history(ref_id) if ref_id else None,
                events=store.events(run_id), title=f"chaos: run {run_id}")


def main(args, store: RunStore) -> int:
    """``etrain chaos``: exit 0 when the run passed, 1 when it failed the oracle, 2 for a bad plan."""
    import ray

    from ..driver.run import parse_spec

    plan = load_plan(args.plan, args.fault)
    spec = store.get_spec(args.run)  # UnknownRun names the fix
    if not ray.is_initialized():
        ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", namespace="etrain",
                 log_to_driver=False, logging_level="warning")
    chaos = Chaos(args.run, store, plan)
    print(f"etrain: chaos on run {args.run!r}: {len(plan.faults)} fault(s) planned", flush=True)
    final = chaos.run(timeout_s=args.timeout)
    ref_id = None
    if args.reference is not None:
        ref_id = args.reference or f"{args.run}-reference"
        cfg = parse_spec(spec)[0]
        reference_run(spec, store, ref_id, args.address, skipped_ranges(store.events(args.run), cfg.data.skip_ranges))
    result = judge(args.run, store, plan, chaos, final, ref_id)
    if args.plot:
        draw_plot(args.plot, store, args.run, result, ref_id)
        result["plot"] = args.plot
    print(format_report(result), flush=True)
    if args.json:
        print(json.dumps(result, sort_keys=True, default=str), flush=True)
    return 0 if result["passed"] else 1
