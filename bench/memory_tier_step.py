"""The steady-state cost of the memory tier: step time with a snapshot after every step against none.

    python bench/memory_tier_step.py [--quick] [--every 1] [--world 2] [--preset tiny] [--rounds N]
                                     [--steps-per-round N]

One run (world 2 by default, re-launched under torchrun), one Trainer, one
memory tier (one replica), as a Ray worker drives them under ``[recovery]
memory_every_steps = 1`` (``--every``): after each step ``MemoryTier.take_async`` (it waits
for the previous snapshot's background work, copies this rank's state to host
buffers, and lays out, agrees and copies to the peer in the tier's thread,
beside the next step). Rounds alternate between the tier on and off, so noise
on this shared machine hits both alike; a step is timed from a barrier to the
end of its snapshot call, counted as its slowest rank; figures are means over steps. The background work of
the last snapshot of an "on" round is waited for outside the timing.

Prints the means and, last, one JSON line: ``step_s_on``, ``step_s_off``,
``ratio`` (on over off; target <= 1.03), ``bytes_per_rank`` (what the tier
holds), ``snapshots`` (how many became restorable), and figures a loaded
machine moves less: ``host_copy_ms`` (what training waited, rank 0's median),
``background_cpu_ms`` (the tier thread's CPU per snapshot, rank 0's median) and
``cpu_ratio`` (the ranks' process CPU, every thread's, in "on" rounds over "off"
rounds: what the tier costs the cores the ranks share), and ``snapshots_in_place`` (rank 0's snapshots whose
host copy went straight into the memory file its files lie in: all but the first few).
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import alternate, main, parse_args, time_steps  # noqa: E402


def slowest_rank_means(*series: list[float]) -> list[float]:
    """The mean over steps of each series (a snapshot every N-th step costs those steps only: the mean
    spreads it), a step counting as slow as its slowest rank."""
    import torch
    import torch.distributed as dist

    both = torch.tensor([list(s) for s in series])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return [sum(row) / len(row) for row in both.tolist()]


def worker(args) -> None:
    import torch

    from checkpointing.recovery.tier import MemoryTier
    from trainer.config.load import load_config
    from trainer.heap import freeze_boot_heap
    from trainer.loop import Trainer
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, torch.device("cpu"))
    rounds = args.rounds or (6 if args.quick else 12)
    per_round = args.steps_per_round or (10 if args.quick else 20)
    # bench/recovery.py's and bench/chaos_goodput.py's run: the tiny model, global batch 12.
    cfg = load_config("examples/tiny.toml", [f'model.preset="{args.preset}"', "data.max_bytes=2000000",
                                             "train.global_batch=12", "train.micro_batch=1", f"train.steps={10**6}",
                                             "metrics.enabled=false"])
    freeze_boot_heap()  # as a TrainWorker does once booted (trainer.heap)
    trainer = Trainer(cfg, world, device=torch.device("cpu"))
    tier = MemoryTier(world.rank, world.size, replicas=1)
    agreed = []

    def on_step():
        trainer.train_step()
        if trainer.step % args.every == 0:
            agreed.append(tier.take_async(trainer.step, trainer.optimizer.checkpoint_state(), trainer.train_state()))

    cpu = {"on": 0.0, "off": 0.0}  # this process's CPU (every thread's: training, the tier's, gloo's)

    def on():
        c0 = time.process_time()
        times = time_steps(on_step, per_round)
        tier.wait()
        cpu["on"] += time.process_time() - c0
        return times

    def off():
        c0 = time.process_time()
        times = time_steps(trainer.train_step, per_round)
        cpu["off"] += time.process_time() - c0
        return times

    for _ in range(3):  # warm-up: plans, buffers, threads
        on_step()
    tier.wait()
    times_on, times_off = alternate(rounds, on, off)
    step_on, step_off = slowest_rank_means(times_on, times_off)
    ok = sum(1 for f in agreed if f.result().ok and f.result().replication and f.result().replication.ok)
    in_place = sum(1 for f in agreed if f.result().in_place)  # the host copy went where the files lie
    import statistics

    waits = [f.result().phases.get("wait_previous", 0.0) for f in agreed]
    copies = [f.result().phases.get("host_copy", 0.0) for f in agreed]
    background = [f.result().seconds - f.result().blocking_s for f in agreed]
    cpu_thread = [f.result().phases.get("background_cpu", 0.0) for f in agreed]
    import torch.distributed as dist

    both = torch.tensor([cpu["on"], cpu["off"]], dtype=torch.float64)
    dist.all_reduce(both)  # the ranks' CPU together
    cpu_ratio = both[0].item() / both[1].item()
    held = tier.held_bytes()
    tier.close()
    if world.is_main:
        print(f"world {world.size}, preset {args.preset}: {rounds} rounds of {per_round} steps each way; "
              f"step {step_off * 1e3:.1f} ms without the tier, {step_on * 1e3:.1f} ms with a snapshot after each "
              f"({ok} of {len(agreed)} agreed and copied to a peer, {in_place} taken in place; "
              f"{held / 2**20:.1f} MiB held per rank)")
        print(f"  rank 0 medians: waited for the previous snapshot {statistics.median(waits) * 1e3:.1f} ms, "
              f"host copy {statistics.median(copies) * 1e3:.1f} ms, "
              f"background {statistics.median(background) * 1e3:.1f} ms "
              f"(of which the tier thread's CPU {statistics.median(cpu_thread) * 1e3:.1f} ms); CPU of every thread, "
              f"on over off: {cpu_ratio:.3f}")
        print(json.dumps({"bench": "memory_tier_step", "world": world.size, "preset": args.preset, "rounds": rounds,
                          "memory_every_steps": args.every,
                          "steps_per_round": per_round, "step_s_on": round(step_on, 5),
                          "step_s_off": round(step_off, 5), "ratio": round(step_on / step_off, 4),
                          "bytes_per_rank": held, "host_copy_ms": round(statistics.median(copies) * 1e3, 2),
                          "background_cpu_ms": round(statistics.median(cpu_thread) * 1e3, 2),
                          "cpu_ratio": round(cpu_ratio, 4), "snapshots": ok,
                          "snapshots_taken": len(agreed), "snapshots_in_place": in_place}), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main(__file__, worker, parse_args("6 rounds of 10 steps each way", lambda ap: ap.add_argument(
        "--every", type=int, default=1, help="a snapshot after every N-th step ([recovery] memory_every_steps)")))
