"""Jobs for tests/trainer/test_offload.py and bench/offload.py, run inside real process groups (tests.harness).

    run_ranks("tests.offload_jobs:peak_rss", 1, {"base": [...], "layout": [...], "steps": 2}, fresh=True)
"""

from __future__ import annotations

import time

import torch

from trainer.config.load import load_config
from trainer.data.corpus import load_corpus
from trainer.loop import Trainer
from trainer.world import World, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def status_kib(field: str) -> int:
    """A /proc/self/status figure in KiB (VmHWM: the peak resident set; VmRSS: the current one)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_rss(payload: dict) -> dict:
    """Train ``steps`` steps (after ``warmup`` untimed ones) in a fresh process: the peak resident set
    (VmHWM, bytes), steps per second, this rank's optimizer state bytes (AdamW's exp_avg + exp_avg_sq)
    and, under offload="nvme", the swapper's totals (bytes moved, seconds the step waited on I/O)."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        cfg = load_config(None, payload["base"] + payload.get("layout", []))
        trainer = Trainer(cfg, world, corpus=load_corpus(cfg.data), device=CPU)
        for _ in range(payload.get("warmup", 1)):
            trainer.train_step()
        t0 = time.monotonic()
        losses = [trainer.train_step().loss for _ in range(payload.get("steps", 1))]
        seconds = time.monotonic() - t0
        opt = trainer.optimizer
        state = 2 * 4 * sum(p.numel() for g in opt.optimizer.param_groups for p in g["params"])
        off = getattr(opt, "offload", None)
        swap = None
        if off is not None:
            t = off.total_stats
            swap = {"read_bytes": t.read_bytes, "written_bytes": t.written_bytes, "wait_s": t.wait_s,
                    "io_s": t.io_s, "swap_s": t.run_s, "buffer_bytes": off.pool.nbytes,
                    "max_buffers_in_use": off.pool.max_in_use, "units": len(off.units)}
        return {"peak_rss": status_kib("VmHWM") * 1024, "state_bytes": state, "losses": losses,
                "steps_per_s": len(losses) / seconds, "seconds": seconds, "swap": swap}
    finally:
        shutdown_distributed()
