"""Step-time overhead of the etrain Trainer against a minimal hand-written FSDP2 loop.

    python bench/step.py [--quick] [--world 2] [--preset tiny]

Both run in the same processes (world 2 by default, re-launched under
torchrun), on the same model, initial weights and global batch, alternating
rounds so that noise on this shared machine hits both alike. Prints the
median seconds per step of each and, last, one JSON line:
``steps_per_s``, ``baseline_steps_per_s`` and ``overhead_ratio`` (trainer
step time over baseline step time; 1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import alternate, parse_args, relaunch, slowest_rank_medians, time_steps  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.config.load import load_config
    from trainer.data.corpus import load_corpus
    from trainer.loop import Trainer
    from trainer.models.decoder.model import Transformer
    from trainer.parallel.tensor import lm_loss
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    device = torch.device("cpu")
    init_distributed(world, device)
    rounds = args.rounds or (3 if args.quick else 7)
    per_round = args.steps_per_round or (8 if args.quick else 15)
    cfg = load_config(None, [f'model.preset="{args.preset}"', "data.max_bytes=4000000", "data.seq_len=64",
                             "train.global_batch=8", "train.micro_batch=4", "train.warmup_steps=0",
                             "parallel.zero_stage=3", f"train.steps={10**6}"])
    corpus = load_corpus(cfg.data)
    trainer = Trainer(cfg, world, corpus=corpus, device=device)

    # The baseline: what one would write by hand with FSDP2 for this model.
    mesh = init_device_mesh("cpu", (world.size,))
    model = Transformer(cfg.model)
    model.init_weights(cfg.train.seed)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay, foreach=True)
    local = t.global_batch // world.size
    pos = trainer.batcher.local_positions(0)
    x, y = trainer.batcher.tokens(pos)
    n_micro = local // t.micro_batch

    def baseline_step() -> None:
        for i in range(n_micro):
            sl = slice(i * t.micro_batch, (i + 1) * t.micro_batch)
            (lm_loss(model(x[sl]), y[sl]) / n_micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # warm-up
        baseline_step()
        trainer.train_step()
    ours, base = alternate(rounds, lambda: time_steps(trainer.train_step, per_round),
                           lambda: time_steps(baseline_step, per_round))
    ours_s, base_s = slowest_rank_medians(ours, base)
    if world.is_main:
        print(f"trainer : {ours_s * 1e3:.1f} ms/step (median of {len(ours)})")
        print(f"baseline: {base_s * 1e3:.1f} ms/step (minimal FSDP2 loop)")
        print(json.dumps({
            "bench": "step", "world": world.size, "preset": args.preset, "device": "cpu",
            "steps_per_s": round(1 / ours_s, 3), "baseline_steps_per_s": round(1 / base_s, 3),
            "overhead_ratio": round(ours_s / base_s, 4), "steps_measured": len(ours),
        }), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    a = parse_args("fewer rounds (under a minute here)")
    if "RANK" in os.environ:
        worker(a)
    else:
        sys.exit(relaunch(__file__, a.world))
