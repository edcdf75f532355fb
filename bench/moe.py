"""The built-in Mixture of Experts under expert parallelism: the trainer against a hand-written loop.

    python bench/moe.py [--quick] [--world 4] [--ep 1,2,4]

At world 4 (re-launched under torchrun, gloo on loopback), for each ep: the etrain Trainer on moe-tiny
(8 experts, top 2, every block MoE, ZeRO-3 with the experts' own FSDP units over the ranks outside ep) and a
hand-written loop over the same model, parallelized the same way (``build_model_parts``: the same expert
dispatch and sharding) with the loop written out: micro-batches, the loss plus the aux loss, backward,
the global gradient norm by one all-reduce, clipping, torch's AdamW (one per mesh: the experts' DTensors
live on the expert mesh). Rounds alternate so that noise on this shared machine hits both alike.

Reported per ep: tokens/s of each, ``overhead_ratio`` (trainer step time / loop step time; target <= 1.10 on
CPU), the all-to-all bytes per step the communication meter counted (mean over the ranks, after the timed
rounds) against trainer.plan.experts' formula, and the load-imbalance ratio (max / mean tokens per expert,
the step log's ``moe_imbalance``), and the trainer's tokens/s with its experts by grouped GEMM and by a loop
over the experts (``grouped_gemm_tokens_per_s``, ``loop_experts_tokens_per_s``; trainer.models.grouped;
``grouped_gemm``: whether torch runs it here). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import alternate, main, parse_args, slowest_rank_medians, time_steps  # noqa: E402

OVERRIDES = ['model.preset="moe-tiny"', "data.max_bytes=4000000", "data.seq_len=64", "train.global_batch=16",
             "train.micro_batch=4", "train.warmup_steps=0", "parallel.zero_stage=3", f"train.steps={10**6}",
             'parallel.mixed_precision="fp32"']


def hand_loop(cfg, world, trainer):
    """One step of the hand-written loop over the model as ``build_model_parts`` parallelizes it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.models.moe import aux_loss, moe_layers
    from trainer.parallel.dims import ParallelDims
    from trainer.parallel.parallelize import build_model_parts
    from trainer.parallel.tensor import lm_loss

    dims = ParallelDims.from_config(cfg, world.size)
    model = build_model_parts(cfg, dims, dims.build_mesh("cpu"), world.rank, torch.device("cpu")).modules[0]
    layers = moe_layers(model)
    t = cfg.train
    by_mesh: dict = {}
    for p in model.parameters():
        by_mesh.setdefault(id(p.device_mesh) if isinstance(p, DTensor) else 0, []).append(p)
    opts = [torch.optim.AdamW(ps, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay,
                              foreach=True) for ps in by_mesh.values()]
    params = list(model.parameters())
    x, y = trainer.batcher.tokens(trainer.batcher.local_positions(0))
    n_micro = len(x) // t.micro_batch

    def step() -> None:
        for i in range(n_micro):
            sl = slice(i * t.micro_batch, (i + 1) * t.micro_batch)
            loss = lm_loss(model(x[sl]), y[sl]) + aux_loss(layers)
            (loss / n_micro).backward()
        # ZeRO-3 without replicas: every gradient element lives on one rank; the norm is one all-reduce away.
        sq = torch.stack([p.grad.to_local().float().pow(2).sum() for p in params]).sum()
        dist.all_reduce(sq)
        coef = min(1.0, t.grad_clip / (float(sq.sqrt()) + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_([p.grad.to_local() for p in params], coef)
        for opt in opts:
            opt.step()
            opt.zero_grad()

    return step


def measure(args: argparse.Namespace, world, corpus, ep: int) -> dict:
    import statistics

    import torch
    import torch.distributed as dist

    from tests.jobs import comm_per_step
    from trainer.config.load import load_config
    from trainer.loop import Trainer
    from trainer.parallel.dims import ParallelDims
    from trainer.plan.experts import all_to_all_per_step
    from trainer.observe.telemetry import comm_meter

    cfg = load_config(None, OVERRIDES + [f"parallel.ep={ep}"])
    trainer = Trainer(cfg, world, corpus=corpus, device=torch.device("cpu"))
    loop = hand_loop(cfg, world, trainer)
    rounds = args.rounds or (2 if args.quick else 5)
    per_round = args.steps_per_round or (3 if args.quick else 8)
    for _ in range(2):  # warm-up
        loop()
        trainer.train_step()
    stats: list = []
    ours, base = alternate(rounds, lambda: time_steps(lambda: stats.append(trainer.train_step()), per_round),
                           lambda: time_steps(loop, per_round))
    ours_s, base_s = slowest_rank_medians(ours, base)
    grouped_s, loop_s = experts_with_and_without_grouped_gemm(trainer, rounds, per_round)
    meter = comm_meter()
    meter.enabled = True
    meter.name_axes(trainer.mesh)
    before = meter.snapshot()
    n = 3
    for _ in range(n):
        trainer.train_step()
    meter.enabled = False
    comm = comm_per_step(meter, before, n).get("all_to_all/ep", {"bytes": 0.0, "bus_bytes": 0.0, "calls": 0})
    got = torch.tensor([comm["bytes"], comm["bus_bytes"]], dtype=torch.float64)
    dist.all_reduce(got)
    size, bus, calls = all_to_all_per_step(cfg, ParallelDims.from_config(cfg, world.size), 4)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    return {"ep": ep, "tokens_per_s": round(tokens / ours_s, 1), "baseline_tokens_per_s": round(tokens / base_s, 1),
            "overhead_ratio": round(ours_s / base_s, 4), "steps_measured": len(ours),
            "grouped_gemm": grouped_mm_runs_here(), "grouped_gemm_tokens_per_s": round(tokens / grouped_s, 1),
            "loop_experts_tokens_per_s": round(tokens / loop_s, 1),
            "all_to_all_bytes_per_step": round(float(got[0]) / world.size), "formula_bytes_per_step": round(size),
            "all_to_all_bus_bytes_per_step": round(float(got[1]) / world.size),
            "formula_bus_bytes_per_step": round(bus), "all_to_all_calls_per_step": comm["calls"],
            "formula_calls": calls, "imbalance_ratio": round(statistics.mean(s.moe_imbalance for s in stats), 3)}


def grouped_mm_runs_here() -> bool:
    import torch

    from trainer.models.grouped import grouped_mm_runs

    return grouped_mm_runs(torch.zeros(1, 8), torch.zeros(2, 8, 8))


def experts_with_and_without_grouped_gemm(trainer, rounds: int, per_round: int) -> tuple[float, float]:
    """The trainer's step time (median, slowest rank) with its experts by grouped GEMM and by the loop over
    experts (trainer.models.grouped), in alternating rounds."""
    from trainer.models.moe import Experts

    experts = [m for m in trainer.parts.modules[0].modules() if isinstance(m, Experts)]

    def steps(grouped: bool):
        for m in experts:
            m.grouped = grouped
        return time_steps(trainer.train_step, per_round)

    grouped, loop = alternate(rounds, lambda: steps(True), lambda: steps(False))
    for m in experts:
        m.grouped = True
    return slowest_rank_medians(grouped, loop)


def worker(args: argparse.Namespace) -> None:
    import torch

    from trainer.config.load import load_config
    from trainer.data.corpus import load_corpus
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, torch.device("cpu"))
    corpus = load_corpus(load_config(None, OVERRIDES).data)
    rows = [measure(args, world, corpus, int(ep)) for ep in args.ep.split(",")]
    if world.is_main:
        print(f"{'ep':>3} {'trainer tok/s':>14} {'loop tok/s':>11} {'overhead':>9} {'a2a B/step':>11} "
              f"{'formula':>9} {'imbalance':>9} {'grouped tok/s':>14} {'expert loop tok/s':>18}")
        for r in rows:
            print(f"{r['ep']:>3} {r['tokens_per_s']:>14.0f} {r['baseline_tokens_per_s']:>11.0f} "
                  f"{r['overhead_ratio']:>9.3f} {r['all_to_all_bytes_per_step']:>11} "
                  f"{r['formula_bytes_per_step']:>9} {r['imbalance_ratio']:>9.3f} "
                  f"{r['grouped_gemm_tokens_per_s']:>14.0f} {r['loop_experts_tokens_per_s']:>18.0f}")
        print(json.dumps({"bench": "moe", "world": world.size, "preset": "moe-tiny", "device": "cpu",
                          "max_overhead_ratio": max(r["overhead_ratio"] for r in rows), "by_ep": rows}), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    a = parse_args("2 rounds of 3 steps per ep (a few minutes here)",
                   lambda ap: ap.add_argument("--ep", default="1,2,4", help="the ep degrees, comma-separated"))
    if "--world" not in sys.argv:
        a.world = 4
    main(__file__, worker, a)
