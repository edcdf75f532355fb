"""Context parallelism: activation memory per rank and step time against the sequence length, per cp and style.

    python bench/context_parallel.py [--quick] [--world 4]

At world 4 (re-launched under torchrun on loopback, real gloo), the tiny model at dim 64 (as
tests/trainer/test_context_parallel.py trains it), one sample per micro-batch, a global batch of 4 samples, ZeRO 0
(no gathered parameters in the count), for seq_len 512, 1024, 2048, 4096 (``--quick``: 512, 1024) and each
layout: cp 1 (dp 4), cp 2 (dp 2) and cp 4 (dp 1) with each ``cp_style``. Every layout trains the same
tokens per step. Per layout, after one warm-up step: one step under ``trainer.observe.device_memory.StepMemory``, whose
``max_by_kind["other"]`` is the activation peak (activations, their gradients, temporaries: all but
parameters, gradients and optimizer state), the highest over the ranks; then the median of a few timed
steps, a step counting as slow as its slowest rank.

``max_seq_len`` per cp: under a per-rank activation budget of cp 1's peak at the longest sequence
measured, the longest sequence (a multiple of 2 x cp) each cp's best style fits, by a straight line
through its measured peaks (activation memory grows linearly in the sequence here: the CPU flash kernel
never holds the seq x seq scores). Rank 0 prints a table and, last, one JSON line: ``rows``,
``activation_peak_ratio_cp4`` (cp 4 over cp 1 at the longest sequence, per style and the best),
``max_seq_len`` and ``max_seq_ratio_cp4``, ``step_time_ratio`` (per layout over cp 1 at each sequence).
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import main as bench_main  # noqa: E402
from bench.torchrun import parse_args  # noqa: E402

STYLES = ("ring", "allgather", "ulysses")
BASE = ["model.dim=64", "model.ffn_hidden=192", "model.n_kv_heads=2", "data.max_bytes=2000000",
        "train.global_batch=4", "train.micro_batch=1", "train.warmup_steps=0", "parallel.zero_stage=0"]


def layouts(world: int) -> list[tuple[str, int, list[str]]]:
    out = [("cp1", 1, [])]
    for n in (2, 4):
        if world % n == 0:
            out += [(f"cp{n}_{s}", n, [f"parallel.cp={n}", f'parallel.cp_style="{s}"']) for s in STYLES]
    return out


def seq_lens(quick: bool) -> list[int]:
    return [512, 1024] if quick else [512, 1024, 2048, 4096]


def worker(args) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from bench.torchrun import slowest_rank_medians, time_steps
    from trainer.config.load import load_config
    from trainer.data.corpus import load_corpus
    from trainer.loop import Trainer
    from trainer.observe.device_memory import StepMemory
    from trainer.world import World, forget_meshes, init_distributed, shutdown_distributed

    world = World.from_env()
    cpu = torch.device("cpu")
    init_distributed(world, cpu)
    corpus = load_corpus(load_config(None, BASE).data)
    rows = []
    for seq in seq_lens(args.quick):
        for name, n, over in layouts(world.size):
            forget_meshes()
            gc.collect()
            cfg = load_config(None, BASE + [f"data.seq_len={seq}", f"model.max_seq_len={seq}", *over])
            trainer = Trainer(cfg, world, corpus=corpus, device=cpu)
            trainer.train_step()
            with StepMemory(trainer.parts.modules, trainer.optimizer.optimizer) as mem:
                trainer.train_step()
            peak = torch.tensor([mem.result()["max_by_kind"]["other"]], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            (median,) = slowest_rank_medians(time_steps(trainer.train_step, 2 if args.quick else 3))
            rows.append({"name": name, "cp": n, "style": name.split("_")[1] if n > 1 else None, "seq_len": seq,
                         "activation_peak_bytes": int(peak.item()), "step_s": round(median, 4)})
            if world.is_main:
                r = rows[-1]
                print(f"{seq:>6} {name:<14} {r['activation_peak_bytes'] / 2**20:9.2f} MiB {median:8.3f} s", flush=True)
            del trainer
    if world.is_main:
        print(json.dumps(summarize(rows)), flush=True)
    shutdown_distributed()


def max_seq(points: list[tuple[int, int]], budget: float, n: int) -> int:
    """The longest sequence (a multiple of 2n) whose peak, on the line through ``points``, fits ``budget``."""
    if len(points) == 1:
        (s, b), = points
        slope, icpt = b / s, 0.0
    else:
        (s0, b0), (s1, b1) = points[0], points[-1]
        slope = (b1 - b0) / (s1 - s0)
        icpt = b0 - slope * s0
    return int((budget - icpt) / slope) // (2 * n) * (2 * n)


def summarize(rows: list[dict]) -> dict:
    longest = max(r["seq_len"] for r in rows)
    at = {(r["name"], r["seq_len"]): r for r in rows}
    one = at[("cp1", longest)]["activation_peak_bytes"]
    ratio4 = {r["style"]: round(r["activation_peak_bytes"] / one, 3) for r in rows
              if r["cp"] == 4 and r["seq_len"] == longest}
    budget = one
    best: dict[int, int] = {}
    per_layout = {}
    for name in dict.fromkeys(r["name"] for r in rows):
        pts = sorted((r["seq_len"], r["activation_peak_bytes"]) for r in rows if r["name"] == name)
        n = at[(name, longest)]["cp"]
        per_layout[name] = max_seq(pts, budget, n)
        best[n] = max(best.get(n, 0), per_layout[name])
    times = {f"{name}@{seq}": round(r["step_s"] / at[("cp1", seq)]["step_s"], 3)
             for (name, seq), r in at.items() if name != "cp1"}
    return {"rows": rows, "activation_peak_ratio_cp4": {**ratio4, "best": min(ratio4.values())} if ratio4 else None,
            "activation_budget_bytes": budget, "max_seq_len": {f"cp{n}": s for n, s in best.items()},
            "max_seq_len_by_layout": per_layout,
            "max_seq_ratio_cp4": round(best[4] / best[1], 2) if 4 in best else None,
            "step_time_ratio": times}


if __name__ == "__main__":
    args = parse_args("seq_len 512 and 1024 only, 2 timed steps", extra=lambda ap: ap.set_defaults(world=4))
    bench_main(__file__, worker, args)
