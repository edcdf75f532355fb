"""How close `etrain plan` is to measured runs: peak memory per rank and the ranking of step times.

    python bench/plan_accuracy.py [--quick] [--no-calibrate]

Layouts of the ``tiny`` and ``small`` presets at world 4 and world 2 (re-launched under torchrun on
127.0.0.1, gloo, fp32 on the CPU) covering ZeRO 0-3, HSDP, TP, SP, PP (1F1B and GPipe) and activation
checkpointing (full and every k-th block). Each trains a warm-up step, then one step under
:class:`trainer.observe.device_memory.StepMemory` (every storage an op touches, activations included: its
``total_peak_bytes``), then a few timed steps (a barrier before each, the slowest rank's median).
Beside each, the planner's prediction for the same config and world: the highest
:func:`trainer.plan.accounting.rank_memory` total over the ranks, and
:func:`trainer.plan.cost.step_time` with this machine's calibrated profile (the parent first runs
what ``etrain plan --calibrate`` runs, into a temporary ``$ETRAIN_HOME``; ``--no-calibrate`` uses
the stored fit or the default CPU profile). A table, then one JSON line, last:
``{"memory_rel_err_p50", "memory_rel_err_max", "step_time_spearman", "search_1024_devices_s", "rows": [...]}``
(the last: the search for Llama-3-70B on 1,024 H100s, target under 10 s).
``--quick``: 12 layouts and 3 timed steps each (a few minutes here); otherwise 15 layouts, 6 steps.
``--rescore OUTPUT``: no training; the measured rows of an earlier run's output predicted again (after a
change to the planner, without measuring again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import relaunch  # noqa: E402

BASE = ["data.max_bytes=400000", "data.seq_len=64", "train.global_batch=8", "train.micro_batch=2",
        "train.warmup_steps=0", 'parallel.device="cpu"', 'parallel.mixed_precision="fp32"', "metrics.enabled=false"]
TINY = ['model.preset="tiny"', "parallel.bucket_mb=0.25"]
SMALL = ['model.preset="small"', "parallel.bucket_mb=2"]
Z = "parallel.zero_stage="

# (name, overrides), by world size; the first 12 are the --quick set.
LAYOUTS = {
    4: [("tiny_zero0", TINY + [Z + "0"]), ("tiny_zero1", TINY + [Z + "1"]), ("tiny_zero2", TINY + [Z + "2"]),
        ("tiny_zero3", TINY + [Z + "3"]),
        ("tiny_hsdp_2x2", TINY + [Z + "3", "parallel.dp_replicate=2"]),
        ("tiny_tp2_zero2", TINY + [Z + "2", "parallel.tp=2"]),
        ("tiny_tp2_sp_zero3", TINY + [Z + "3", "parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("tiny_pp2_1f1b_zero1", TINY + [Z + "1", "parallel.pp=2", "train.micro_batch=1"]),
        ("tiny_zero3_ac_full", TINY + [Z + "3", 'parallel.activation_checkpoint="full"']),
        ("small_zero3", SMALL + [Z + "3"])],
    2: [("small_zero0", SMALL + [Z + "0"]),
        ("small_pp2_ac_full", SMALL + [Z + "0", "parallel.pp=2", "train.micro_batch=1",
                                       'parallel.activation_checkpoint="full"'])],
}
EXTRA = {4: [("tiny_pp2_tp2_gpipe", TINY + ["parallel.pp=2", "parallel.tp=2", 'parallel.pp_schedule="gpipe"',
                                            "train.micro_batch=1"]),
             ("small_tp2_sp_ac_every2", SMALL + [Z + "2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                                 'parallel.activation_checkpoint="every_k"'])],
         2: [("tiny_tp2_sp", TINY + ["parallel.tp=2", "parallel.sequence_parallel=true"])]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="12 layouts, 3 timed steps each")
    ap.add_argument("--no-calibrate", action="store_true", help="use the stored fit (or the default CPU profile)")
    ap.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)  # set by the parent for its ranks
    ap.add_argument("--rescore", metavar="OUTPUT", help="no runs: predict again for the measured rows of an earlier "
                                                         "run's output (its last line), with the current planner")
    return ap.parse_args()


def layouts(world: int, quick: bool) -> list:
    return LAYOUTS[world] + ([] if quick else EXTRA[world])


def worker(args: argparse.Namespace) -> None:
    import gc

    import torch.distributed as dist

    from bench.torchrun import slowest_rank_medians, time_steps
    from trainer.observe import device_memory as memory
    from trainer.config.load import load_config
    from trainer.data.corpus import load_corpus
    from trainer.loop import Trainer
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    import torch

    init_distributed(world, torch.device("cpu"))
    corpus = load_corpus(load_config(None, BASE).data)
    out = []
    for name, overrides in layouts(world.size, args.quick):
        gc.collect()
        cfg = load_config(None, BASE + overrides)
        trainer = Trainer(cfg, world, corpus=corpus, device=torch.device("cpu"))
        trainer.train_step()
        res = memory.measure_step(trainer)
        times = time_steps(trainer.train_step, 3 if args.quick else 6)
        (median,) = slowest_rank_medians(times)
        peaks: list = [None] * world.size
        dist.all_gather_object(peaks, res["total_peak_bytes"])
        out.append({"name": name, "world": world.size, "overrides": overrides, "measured_peak_bytes": max(peaks),
                    "measured_peak_by_rank": peaks, "measured_step_s": median})
        del trainer
    if world.is_main:
        with open(os.environ["PLAN_ACCURACY_OUT"], "w") as f:
            json.dump(out, f)
    shutdown_distributed()


def predict(row: dict, dev) -> dict:
    from trainer.config.load import load_config
    from trainer.parallel.dims import ParallelDims
    from trainer.plan.accounting import rank_memory
    from trainer.plan.cost import step_time

    cfg = load_config(None, BASE + row["overrides"])
    dims = ParallelDims.from_config(cfg, row["world"])
    mems = [rank_memory(cfg, dims, r, mixed=False) for r in range(row["world"])]
    step = max(step_time(cfg, dims, r, dev)["step_s"] for r in range(row["world"]))
    return {"predicted_peak_bytes": max(m["total"] for m in mems), "predicted_step_s": step,
            "predicted_by_rank": [m["total"] for m in mems]}


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__)
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / den if den else float("nan")


def main(args: argparse.Namespace) -> int:
    from trainer.config.load import load_config
    from trainer.plan.calibrate import apply, calibrate, load
    from trainer.plan.cost import DEVICES, custom

    if not args.no_calibrate:  # the fit stays in a temporary $ETRAIN_HOME: the user's is left alone
        os.environ["ETRAIN_HOME"] = tempfile.mkdtemp(prefix="plan-accuracy-")
        fit = calibrate(load_config(None, BASE + SMALL), "cpu", "cpu")  # the larger model dominates
    else:
        fit = load("cpu")
    dev = apply(custom(DEVICES["cpu"], gpus_per_node=4), fit)
    rows = []
    if args.rescore:
        with open(args.rescore) as f:
            last = [line for line in f if line.startswith("{")][-1]
        keep = ("name", "world", "overrides", "measured_peak_bytes", "measured_peak_by_rank", "measured_step_s")
        rows = [{k: r[k] for k in keep} for r in json.loads(last)["rows"]]
    for world in () if args.rescore else (4, 2):
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        os.environ["PLAN_ACCURACY_OUT"] = path
        sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if not a.startswith("--world")), f"--world={world}"]
        code = relaunch(__file__, world)
        if code:
            print(f"plan_accuracy: world {world} failed (exit {code})", file=sys.stderr)
            return code
        with open(path) as f:
            rows += json.load(f)
        os.unlink(path)
    errs = []
    mib = 2**20
    print(f"{'layout':<24} {'world':>5} {'pred MiB':>9} {'meas MiB':>9} {'err':>7} {'pred s':>8} {'meas s':>8}")
    for r in rows:
        r.update(predict(r, dev))
        r["memory_rel_err"] = abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        errs.append(r["memory_rel_err"])
        print(f"{r['name']:<24} {r['world']:>5} {r['predicted_peak_bytes'] / mib:9.2f} "
              f"{r['measured_peak_bytes'] / mib:9.2f} {r['memory_rel_err'] * 100:6.1f}% "
              f"{r['predicted_step_s']:8.4f} {r['measured_step_s']:8.4f}")
    rho = spearman([r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows])
    search_s = search_seconds()
    print(f"search of Llama-3-70B on 1,024 h100 devices: {search_s:.2f} s (target < 10 s)")
    out = {"bench": "plan_accuracy", "quick": args.quick, "layouts": len(rows), "search_1024_devices_s": search_s,
           "calibration": {k: fit.get(k) for k in ("flops", "flops_per_core", "bandwidth", "latency", "cores",
                                                   "crowded_call_s")} if fit else None,
           "memory_rel_err_p50": round(statistics.median(errs), 4), "memory_rel_err_max": round(max(errs), 4),
           "step_time_spearman": round(rho, 4), "rows": rows}
    print(json.dumps(out), flush=True)
    return 0


def search_seconds() -> float:
    """Wall time of the planner's search for Llama-3-70B (seq 8192, batch 1024) on 1,024 H100s."""
    import time

    from trainer.config import DataConfig, ModelConfig, RunConfig, TrainConfig
    from trainer.plan.cost import DEVICES
    from trainer.plan.search import plan_size
    from trainer.plan.shape import LLAMA3

    cfg = RunConfig(model=ModelConfig(**LLAMA3["70b"]), data=DataConfig(seq_len=8192),
                    train=TrainConfig(global_batch=1024, micro_batch=1))
    t0 = time.monotonic()
    plan_size(cfg, 1024, DEVICES["h100"])
    return round(time.monotonic() - t0, 3)


if __name__ == "__main__":
    a = parse_args()
    if "RANK" in os.environ:
        worker(a)
    else:
        sys.exit(main(a))
