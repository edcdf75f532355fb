"""What the metrics cost a training step: steps/s with every metric on over steps/s with them off.

    python bench/metrics_overhead.py [--quick] [--world 2] [--preset tiny]

One run (world 2 by default, re-launched under torchrun), one Trainer.
Rounds alternate between "on" and "off" so that noise on this shared machine
hits both alike:

* on: every collective timed by the comm meter (trainer.observe.telemetry), each
  step's figures fed to the exporter, every rank's telemetry sent through
  the launcher's store every ``metrics.every_s`` (default 1 s), rank 0
  serving the Prometheus endpoint, and a scraper reading it every second
  (as Prometheus would, at a 1 s scrape interval: 5x the deployed default).
* off: torch.distributed's own functions (the meter's wrappers removed),
  no exporter, no scrapes.

Prints the median step time of each and, last, one JSON line with
``ratio`` (steps/s on over steps/s off; 1.0 = free).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import alternate, parse_args, relaunch, slowest_rank_medians, time_steps  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from trainer.config.load import load_config
    from trainer.observe.launcher import LauncherMetrics
    from trainer.loop import Trainer
    from trainer.observe.telemetry import comm_meter
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, torch.device("cpu"))
    rounds = args.rounds or (6 if args.quick else 12)
    per_round = args.steps_per_round or (10 if args.quick else 20)
    cfg = load_config(None, [f'model.preset="{args.preset}"', "data.max_bytes=4000000", "data.seq_len=64",
                             "train.global_batch=8", "train.micro_batch=4", "train.warmup_steps=0",
                             "parallel.zero_stage=3", f"train.steps={10**6}", 'metrics.file_sd_dir="-"',
                             'run_id="bench-metrics"'])
    trainer = Trainer(cfg, world, device=torch.device("cpu"))
    meter = comm_meter(install=False)
    store = dist.distributed_c10d._get_default_store()
    metrics = LauncherMetrics(cfg, world, store)  # rank 0 serves from here on; idle while "off"
    stop = threading.Event()
    scraping = threading.Event()

    def scraper() -> None:  # Prometheus' part: one scrape a second while "on"
        while not stop.wait(1.0):
            if scraping.is_set():
                urllib.request.urlopen(metrics.url, timeout=5).read()

    if world.is_main:
        threading.Thread(target=scraper, daemon=True).start()

    def step_with_metrics() -> None:
        metrics.after_step(trainer.train_step(), trainer, None)

    def timed(on: bool) -> list[float]:
        if on:
            meter.install()
            meter.name_axes(trainer.mesh)
            scraping.set()
        else:
            meter.uninstall()
            scraping.clear()
        return time_steps(step_with_metrics if on else trainer.train_step, per_round)

    timed(True)  # warm-up, both ways
    timed(False)
    on_s, off_s = alternate(rounds, lambda: timed(True), lambda: timed(False))
    on_med, off_med = slowest_rank_medians(on_s, off_s)
    stop.set()
    if world.is_main:
        calls = sum(c["calls"] for c in meter.snapshot())
        print(f"metrics on : {on_med * 1e3:.2f} ms/step (median of {len(on_s)})")
        print(f"metrics off: {off_med * 1e3:.2f} ms/step (median of {len(off_s)})")
        print(f"collectives timed: {calls} ({calls / max(1, len(on_s) + per_round):.0f} per step)")
        print(json.dumps({"bench": "metrics_overhead", "world": world.size, "preset": args.preset,
                          "steps_per_s_on": round(1 / on_med, 3), "steps_per_s_off": round(1 / off_med, 3),
                          "ratio": round(off_med / on_med, 4), "steps_measured": len(on_s)}), flush=True)
    metrics.close()
    shutdown_distributed()


if __name__ == "__main__":
    a = parse_args("fewer rounds (about a minute here)")
    if "RANK" in os.environ:
        worker(a)
    else:
        sys.exit(relaunch(__file__, a.world))
