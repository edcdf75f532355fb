"""Peak memory of a training step for each ZeRO stage, measured while the step runs, beside the formulas.

    python bench/memory.py [--quick] [--world 4] [--preset tiny|small] [--bucket-mb 0.25] [--device cpu|cuda]

At world 4 (re-launched under torchrun), in fp32 and in bf16, each ZeRO stage 0-3 trains one step
and then a second one under ``trainer.observe.device_memory.StepMemory``, which follows every storage an op
touches and takes the peak of the bytes held for parameters, gradients and optimizer state (see
its docstring for what counts as what). Beside it: the ZeRO paper's formula for the stage
(16P, 4P + 12P/N, 2P + 14P/N, 16P/N in mixed precision; 16P, 8P + 8P/N, 4P + 12P/N, 16P/N in
fp32), this trainer's own accounting (``trainer.observe.device_memory.predict`` plus the stage's transient:
one bucket for stages 1-2, FSDP's gathered blocks for stage 3), and plain DDP (torch
``DistributedDataParallel`` and AdamW, fp32, measured the same way). On CUDA the allocator's
``torch.cuda.max_memory_allocated`` for the step (everything, activations included) comes too.

Figures are those of the rank that peaked highest. Rank 0 prints a table and, last, one JSON line keyed by
layout: ``{"zero0": {"peak_bytes", "predicted_bytes" (the paper's), "accounted_bytes" (ours),
"at_peak": {...}, ...}, ..., "zero0_bf16": ..., "ddp": ...}``. ``--quick``: the tiny preset
(0.9M parameters, buckets of 0.25 MiB, about a minute here); otherwise the small one (25.6M,
buckets of 2 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import relaunch  # noqa: E402

FIELDS = ("peak_bytes", "predicted_bytes", "accounted_bytes", "formula_bytes", "transient_bytes",
          "total_peak_bytes", "allocator_peak_bytes")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the tiny preset (about a minute here)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--preset", default="")
    ap.add_argument("--bucket-mb", type=float, default=0.0, help="parallel.bucket_mb (0: 0.25 tiny, 2 otherwise)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    return ap.parse_args()


def _allocator_peak(device, fn):
    """``fn()``, and the most the CUDA allocator held during it (None on the CPU)."""
    import torch

    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device)


def measure_layout(cfg, world, corpus, device) -> dict:
    """One warm-up step, then the measured one."""
    from trainer.observe import device_memory as memory
    from trainer.loop import Trainer

    trainer = Trainer(cfg, world, corpus=corpus, device=device)
    trainer.train_step()
    res, allocator = _allocator_peak(device, lambda: memory.measure_step(trainer))
    res["allocator_peak_bytes"] = allocator
    res["predicted_bytes"] = res["paper_bytes"]
    res["accounted_bytes"] = res["formula_bytes"] + res["transient_bytes"]
    return res


def measure_ddp(cfg, world, trainer_batcher, device) -> dict:
    """Plain DDP over the same model, batch and AdamW settings (fp32), measured the same way."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from trainer.observe import device_memory as memory
    from trainer.models.decoder.model import Transformer
    from trainer.parallel.tensor import lm_loss

    model = Transformer(cfg.model)
    model.init_weights(cfg.train.seed)
    model.to(device)
    ddp = DistributedDataParallel(model)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay, foreach=True)
    x, y = (v.to(device) for v in trainer_batcher.tokens(trainer_batcher.local_positions(0)))
    n_micro = len(x) // t.micro_batch

    def step() -> None:  # what one writes by hand with DDP
        for xs, ys in zip(x.split(t.micro_batch), y.split(t.micro_batch)):
            (lm_loss(ddp(xs), ys) / n_micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()

    step()

    def measured() -> dict:
        with memory.StepMemory([model], opt) as mem:
            step()
        return mem.result()

    res, allocator = _allocator_peak(device, measured)
    count = sum(p.numel() for p in model.parameters())
    res.update(allocator_peak_bytes=allocator, param_count=count, predicted_bytes=16 * count,
               accounted_bytes=16 * count, formula_bytes=16 * count, transient_bytes=0)
    return res


def worker(args: argparse.Namespace) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from trainer.config.load import load_config
    from trainer.data.corpus import Batcher, load_corpus
    from trainer.parallel.dims import ParallelDims
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    device = torch.device("cuda", world.local_rank) if args.device == "cuda" else torch.device("cpu")
    init_distributed(world, device)
    preset = args.preset or ("tiny" if args.quick else "small")
    bucket_mb = args.bucket_mb or (0.25 if preset == "tiny" else 2.0)
    base = [f'model.preset="{preset}"', "data.max_bytes=4000000", "data.seq_len=64", "train.global_batch=8",
            "train.micro_batch=2", "train.warmup_steps=0", f"parallel.bucket_mb={bucket_mb}",
            f'parallel.device="{device.type}"']
    corpus = load_corpus(load_config(None, base).data)
    layouts = [(f"zero{z}{suffix}", [f"parallel.zero_stage={z}", f'parallel.mixed_precision="{mp}"'])
               for suffix, mp in (("", "fp32"), ("_bf16", "bf16")) for z in range(4)]
    results = {}
    for name, overrides in layouts:
        results[name] = measure_layout(load_config(None, base + overrides), world, corpus, device)
        gc.collect()
    cfg = load_config(None, base + ['parallel.mixed_precision="fp32"'])
    dims = ParallelDims.from_config(cfg, world.size)
    batcher = Batcher(corpus, cfg.data.seq_len, cfg.train.seed, cfg.train.global_batch,
                      dims.dp_rank(world.rank), dims.dp)
    results["ddp"] = measure_ddp(cfg, world, batcher, device)

    # Per layout, the rank that peaked highest (the ranks are alike but for their chunk of each tensor).
    gathered: list = [None] * world.size
    dist.all_gather_object(gathered, results)
    out: dict = {"bench": "memory", "world": world.size, "preset": preset, "device": device.type,
                 "bucket_mb": bucket_mb, "param_count": results["zero0"]["param_count"]}
    names = list(results)
    for n in names:
        r = max((g[n] for g in gathered), key=lambda x: x["peak_bytes"])
        entry = {f: r[f] for f in FIELDS if r.get(f) is not None}
        entry["at_peak"] = r["at_peak"]
        entry["peak_over_predicted"] = round(r["peak_bytes"] / r["predicted_bytes"], 3)
        entry["peak_over_accounted"] = round(r["peak_bytes"] / r["accounted_bytes"], 3)
        entry["peak_by_rank"] = [g[n]["peak_bytes"] for g in gathered]
        out[n] = entry
    if world.is_main:
        print_table(out, names)
        print(json.dumps(out), flush=True)
    shutdown_distributed()


def print_table(out: dict, names: list[str]) -> None:
    mib = 2**20
    print(f"world {out['world']}, preset {out['preset']} ({out['param_count'] / 1e6:.2f}M parameters), "
          f"buckets of {out['bucket_mb']} MiB; MiB, the rank that peaked highest")
    print(f"{'layout':<11} {'paper':>8} {'ours':>8} {'peak':>8} {'/paper':>7} {'/ours':>6} "
          f"{'params':>8} {'grads':>8} {'optim':>8} {'+activ.':>8}")
    for n in names:
        e = out[n]
        a = e["at_peak"]
        print(f"{n:<11} {e['predicted_bytes'] / mib:8.2f} {e['accounted_bytes'] / mib:8.2f} "
              f"{e['peak_bytes'] / mib:8.2f} {e['peak_over_predicted']:7.3f} {e['peak_over_accounted']:6.3f} "
              f"{a['params'] / mib:8.2f} {a['grads'] / mib:8.2f} {a['optimizer'] / mib:8.2f} "
              f"{e['total_peak_bytes'] / mib:8.2f}")


if __name__ == "__main__":
    a = parse_args()
    if "RANK" in os.environ:
        worker(a)
    else:
        sys.exit(relaunch(__file__, a.world))
