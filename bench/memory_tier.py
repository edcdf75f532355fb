"""What a memory-tier snapshot costs, beside the durable checkpoint of the same state in the same run.

    python bench/memory_tier.py [--quick] [--world 2] [--preset small] [--rounds N]

One run (world 2 by default, re-launched under torchrun), one Trainer of the
preset at ZeRO-3, one step trained so AdamW's state exists. Each round, in
turn (so noise on this shared machine hits all alike), on the same state:

* memory tier, in the caller's thread: ``MemoryTier.take`` (the state laid
  out by the last plan, copied into this rank's memory as DCP shard files, and
  the all-ranks agreement), then ``replicate_async`` to one peer rank over the
  tier's own gloo group, timed until every copy arrived and was checked;
* memory tier in the background: ``take_async``, what training waits for (a
  copy of the state into reused host buffers) and until agreed and copied;
* async durable checkpoint to file:// (``CheckpointManager``, the default):
  the time training is blocked (the snapshot to host buffers), and until it
  committed;
* sync durable checkpoint to file://: the whole save.

Figures are medians over rounds, each round counted as its slowest rank. Last,
one JSON line: ``snapshot_s`` (``take``), ``replicate_s``,
``snapshot_blocking_s`` and ``snapshot_async_s`` (``take_async``: training
blocked, and the whole of it), ``bytes_per_rank`` (the most host bytes the
tier held on a rank: its snapshots, the copy it keeps for its peer, the host
buffers), ``durable_blocking_s``, ``durable_commit_s``, ``file_save_s``,
``step_s`` (a training step, for scale) and ``ratio``
(``snapshot_blocking_s`` over ``durable_blocking_s``: training's wait for a
memory snapshot against its wait for the async durable checkpoint).
``--quick``: 2 rounds (else 5).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import relaunch  # noqa: E402

KEYS = ("snapshot_s", "replicate_s", "snapshot_blocking_s", "snapshot_async_s", "durable_blocking_s",
        "durable_commit_s", "file_save_s")


def parse_args():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rounds", type=int, default=0)
    return ap.parse_args()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from checkpointing.recovery.tier import MemoryTier
    from trainer.config.load import load_config
    from trainer.checkpoints import checkpoint_manager
    from trainer.loop import Trainer
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, torch.device("cpu"))
    root = tempfile.mkdtemp(prefix="etrain-bench-memtier-") if world.is_main else None
    box = [root]
    dist.broadcast_object_list(box)
    root = box[0]
    base = [f'model.preset="{args.preset}"', "data.max_bytes=4000000", "data.seq_len=64", "train.global_batch=4",
            "train.micro_batch=2", "train.warmup_steps=0", "parallel.zero_stage=3", f"train.steps={10**6}",
            "metrics.enabled=false", f'checkpoint.url="file://{root}"', "checkpoint.keep_last=1"]
    cfg = load_config(None, base + ['run_id="bench-async"'])
    sync_cfg = load_config(None, base + ['run_id="bench-sync"', "checkpoint.async_save=false"])
    trainer = Trainer(cfg, world, device=torch.device("cpu"))
    trainer.train_step()
    t0 = time.monotonic()
    trainer.train_step()
    step_s = time.monotonic() - t0
    state = trainer.optimizer.checkpoint_state()
    tier = MemoryTier(world.rank, world.size, replicas=1)
    mgr, sync_mgr = checkpoint_manager(cfg, world), checkpoint_manager(sync_cfg, world)
    rounds = args.rounds or (2 if args.quick else 5)
    rows, held = [], 0
    for r in range(rounds + 1):  # round 0 warms up (plans, buffers, threads)
        trainer.step += 1  # one state, saved as a new step each time
        dist.barrier()
        t0 = time.monotonic()
        res = tier.take(trainer.step, state, trainer.train_state())
        t1 = time.monotonic()
        rep = tier.replicate_async(res.snapshot).result()
        t2 = time.monotonic()
        assert res.ok and rep.ok, (res.reason, rep.reason)
        trainer.step += 1
        dist.barrier()
        bg = tier.take_async(trainer.step, state, trainer.train_state()).result()
        assert bg.ok and bg.replication.ok, (bg.reason, bg.replication.reason)
        held = max(held, tier.held_bytes())
        dist.barrier()
        t3 = time.monotonic()
        trainer.save_checkpoint(mgr)
        mgr.wait()
        t4 = time.monotonic()
        (saved,) = mgr.poll()
        dist.barrier()
        t5 = time.monotonic()
        trainer.save_checkpoint(sync_mgr)
        t6 = time.monotonic()
        assert saved.status == "committed" and [s.status for s in sync_mgr.poll()] == ["committed"]
        if r:
            rows.append([t1 - t0, t2 - t1, bg.blocking_s, bg.seconds, saved.blocking_s, t4 - t3, t6 - t5])
    # A round is as slow as its slowest rank.
    worst = torch.tensor(rows, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    med = {k: statistics.median(col) for k, col in zip(KEYS, worst.t().tolist())}
    held_t = torch.tensor([held], dtype=torch.int64)
    dist.all_reduce(held_t, op=dist.ReduceOp.MAX)
    state_mib = sum(len(b) for b in tier.snapshots[max(tier.snapshots)].files.values()) / 2**20
    tier.close()
    if world.is_main:
        print(f"world {world.size}, preset {args.preset}, ZeRO-3: {state_mib:.1f} MiB of shard files per rank, "
              f"medians of {rounds} rounds (slowest rank)")
        print(f"  take (training waits)            {med['snapshot_s'] * 1e3:8.1f} ms")
        print(f"  copy to one peer (background)    {med['replicate_s'] * 1e3:8.1f} ms")
        print(f"  take_async: training waits       {med['snapshot_blocking_s'] * 1e3:8.1f} ms, "
              f"agreed and copied after {med['snapshot_async_s'] * 1e3:.1f} ms")
        print(f"  async durable: blocking          {med['durable_blocking_s'] * 1e3:8.1f} ms, "
              f"committed after {med['durable_commit_s'] * 1e3:.1f} ms")
        print(f"  sync durable file:// save        {med['file_save_s'] * 1e3:8.1f} ms")
        print(f"  a training step (rank 0)         {step_s * 1e3:8.1f} ms")
        print(json.dumps({"bench": "memory_tier", "world": world.size, "preset": args.preset, "rounds": rounds,
                          **{k: round(v, 4) for k, v in med.items()}, "bytes_per_rank": int(held_t.item()),
                          "step_s": round(step_s, 4),
                          "ratio": round(med["snapshot_blocking_s"] / max(med["durable_blocking_s"], 1e-9), 3)}),
              flush=True)
        shutil.rmtree(root, ignore_errors=True)
    shutdown_distributed()


if __name__ == "__main__":
    a = parse_args()
    if "RANK" in os.environ:
        worker(a)
    else:
        sys.exit(relaunch(__file__, a.world))
