"""Checkpoint save and load throughput, side by side with their baselines in one run.

    python bench/checkpoint.py [--quick]

A ~34M-parameter model with AdamW state (~410 MB of training state), one
training step old, at world 2 (ZeRO 3), re-launched under torchrun. A moto
S3 server is started on loopback for the run. Per round, each figure and its
baseline are measured back to back, and medians over the rounds are reported:

* ``file_ratio_vs_raw``: our sync save to ``file://`` over a raw parallel
  write (and fsync) of the same number of bytes per rank to the same disk.
* ``s3_ratio_vs_raw``: our sync save to ``s3://`` over the endpoint's ceiling:
  parallel PUTs of the same bytes through the same client settings.
* ``s3_speedup_vs_dcp_fsspec``: plain DCP with its ``FsspecWriter`` (default
  settings) to the same endpoint, time over ours.
* ``async_block_ratio``: how long an async save blocks training over the time
  of a sync save to the same place (S3; ``async_block_ratio_file`` for disk).
* ``load_reshard_s``: loading at world 2 a checkpoint saved at world 4.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["model.dim=512", "model.n_layers=10", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_hidden=1536",
         "model.max_seq_len=64", "data.seq_len=16", "data.max_bytes=200000", "train.global_batch=4",
         "train.micro_batch=1", "parallel.zero_stage=3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            return proc, endpoint
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start")


def torchrun(world: int, args: list[str], env: dict) -> str:
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), f"--nproc_per_node={world}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"worker failed ({out.returncode})")
    return out.stdout


def launch(args: argparse.Namespace) -> None:
    import boto3

    moto, endpoint = start_moto()
    tmp = tempfile.mkdtemp(prefix="etrain-bench-ckpt-")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", AWS_ACCESS_KEY_ID="bench",
               AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL_S3=endpoint)
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                     region_name="us-east-1").create_bucket(Bucket="bench")
        common = ["--dir", tmp, "--rounds", str(args.rounds or (1 if args.quick else 3))]
        # The resharding source: the same model saved at world 4.
        torchrun(4, ["--role", "save4", *common], env)
        out = torchrun(2, ["--role", "main", *common], env)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        print("\n".join(lines[:-1]))
        print(lines[-1])
    finally:
        moto.terminate()
        shutil.rmtree(tmp, ignore_errors=True)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.tensor import DTensor

    from checkpointing.manager import CheckpointManager
    from checkpointing.storage.base import Storage
    from trainer.config.load import load_config
    from trainer.loop import Trainer
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, torch.device("cpu"))
    cfg = load_config(None, MODEL)
    trainer = Trainer(cfg, world, device=torch.device("cpu"))
    trainer.train_step()
    file_root = f"file://{args.dir}/file"
    if args.role == "save4":
        mgr = CheckpointManager(file_root, "reshard", rank=world.rank, world_size=world.size, async_save=False)
        trainer.save_checkpoint(mgr)
        shutdown_distributed()
        return

    def local_bytes(state) -> int:
        total = 0
        for sub in (state["model"], *state["optim"].values()):
            for t in (sub.values() if isinstance(sub, dict) else [sub]):
                lt = t.to_local() if isinstance(t, DTensor) else t
                total += lt.numel() * lt.element_size()
        return total

    state = trainer.optimizer.checkpoint_state()
    mine = local_bytes(state)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world.size)]
    dist.all_gather(sizes, torch.tensor([mine]))
    total = int(sum(int(s) for s in sizes))
    blob = np.random.default_rng(world.rank).integers(0, 255, size=mine, dtype=np.uint8).tobytes()

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def raw_file(i: int):
        d = os.path.join(args.dir, f"raw{i}")
        os.makedirs(d, exist_ok=True)
        n = 4  # a few files in parallel, as a hand-written parallel writer would
        step = -(-len(blob) // n)

        def write(k):
            with open(os.path.join(d, f"r{world.rank}_{k}"), "wb") as f:
                f.write(memoryview(blob)[k * step : (k + 1) * step])
                f.flush()
                os.fsync(f.fileno())

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(n) as ex:
            list(ex.map(write, range(n)))

    s3_raw = Storage("s3://bench/raw", concurrency=8)
    phases: dict[str, list[dict]] = {}

    def raw_s3(i: int):
        n = 8
        step = -(-len(blob) // n)
        s3_raw.put_many([(f"{i}/r{world.rank}_{k}", memoryview(blob)[k * step : (k + 1) * step]) for k in range(n)])

    managers: dict = {}

    def ours(root: str, run: str, async_save: bool):
        # One long-lived manager per destination, as in training: its staging
        # buffers stay mapped from one save to the next.
        key = (root, async_save)
        if key not in managers:
            managers[key] = CheckpointManager(root, "ours", rank=world.rank, world_size=world.size,
                                              async_save=async_save, keep_last=1000)
        mgr = managers[key]
        trainer.step += 1  # a new step directory each time
        blocked = {}

        def go():
            t0 = time.perf_counter()
            trainer.save_checkpoint(mgr)
            blocked["s"] = time.perf_counter() - t0
            mgr.wait()
            res = mgr.poll()
            assert res and res[0].ok, res
            phases.setdefault(f"{root.split(':')[0]}_{'async' if async_save else 'sync'}", []).append(res[0].phases)

        return timed(go), blocked["s"]

    def dcp_fsspec(i: int):
        dcp.save(trainer.optimizer.checkpoint_state(), storage_writer=FsspecWriter(f"s3://bench/dcp/{i}"),
                 planner=DefaultSavePlanner())

    def clean():
        """Delete what the last measurement wrote (outside the timings): a moto server
        slows down as it fills, and the page cache fills with old files."""
        if world.rank == 0:
            bucket = Storage("s3://bench")
            for name in bucket.list_dir(""):
                bucket.delete_tree(name)
            for name in os.listdir(args.dir):
                if name != "file":
                    shutil.rmtree(os.path.join(args.dir, name), ignore_errors=True)
            for run in os.listdir(os.path.join(args.dir, "file")):
                if run not in ("reshard",):
                    shutil.rmtree(os.path.join(args.dir, "file", run), ignore_errors=True)
        dist.barrier()

    def measure(name: str, fn):
        out = fn()
        clean()
        return out

    # Warm-up, outside the figures: the first save of a process maps its staging
    # buffers and opens its connections; steady-state saves are what training sees.
    measure("warm", lambda: (ours(file_root, "warm", False), ours("s3://bench", "warm", False),
                             ours(file_root, "warm-async", True), ours("s3://bench", "warm-async", True),
                             dcp_fsspec("warm"), raw_s3("warm"), raw_file("warm")))

    rows = {k: [] for k in ("raw_file", "ours_file", "raw_s3", "ours_s3", "dcp_s3", "block_s3", "sync_s3",
                            "block_file", "sync_file")}
    for i in range(args.rounds):
        # Alternate which of a pair goes first, so drift hits both alike.
        pairs = [
            (lambda: rows["raw_file"].append(measure("raw", lambda: timed(lambda: raw_file(i))))),
            (lambda: rows["ours_file"].append(measure("ours", lambda: ours(file_root, f"ours{i}", False)[0]))),
            (lambda: rows["raw_s3"].append(measure("raw", lambda: timed(lambda: raw_s3(i))))),
            (lambda: rows["ours_s3"].append(measure("ours", lambda: ours("s3://bench", f"ours{i}", False)[0]))),
            (lambda: rows["dcp_s3"].append(measure("dcp", lambda: timed(lambda: dcp_fsspec(i))))),
        ]
        order = pairs if i % 2 == 0 else [pairs[1], pairs[0], pairs[3], pairs[2], pairs[4]]
        for run in order:
            run()
        rows["sync_file"].append(rows["ours_file"][-1])
        rows["sync_s3"].append(rows["ours_s3"][-1])
        rows["block_file"].append(measure("async", lambda: ours(file_root, f"async{i}", True)[1]))
        rows["block_s3"].append(measure("async", lambda: ours("s3://bench", f"async{i}", True)[1]))
        if world.is_main:
            print(f"round {i}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in rows.items()), flush=True)

    # Load at world 2 what world 4 saved.
    mgr = CheckpointManager(file_root, "reshard", rank=world.rank, world_size=world.size)
    load_s = timed(lambda: trainer.load_checkpoint(mgr))
    assert trainer.step == 1, trainer.step

    # Every rank's blocked time counts: training waits for the slowest.
    med = {}
    for k, v in rows.items():
        t = torch.tensor([statistics.median(v)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med[k] = float(t)
    mb = total / 1e6
    if world.is_main:
        print(f"state: {mb:.0f} MB at world {world.size} ({mine / 1e6:.0f} MB on rank 0)")
        for k, v in med.items():
            print(f"  {k:<10} {v:6.2f} s   {mb / v:7.1f} MB/s")
        for k, runs in phases.items():
            keys = sorted({p for r in runs for p in r})
            print(f"  phases {k} (rank 0, median s): " + ", ".join(
                f"{p} {statistics.median(r.get(p, 0.0) for r in runs):.3f}" for p in keys))
        print(json.dumps({
            "bench": "checkpoint", "world": world.size, "state_mb": round(mb, 1), "rounds": args.rounds,
            "file_ratio_vs_raw": round(med["raw_file"] / med["ours_file"], 3),
            "s3_ratio_vs_raw": round(med["raw_s3"] / med["ours_s3"], 3),
            "s3_speedup_vs_dcp_fsspec": round(med["dcp_s3"] / med["ours_s3"], 3),
            "async_block_ratio": round(med["block_s3"] / med["sync_s3"], 4),
            "async_block_ratio_file": round(med["block_file"] / med["sync_file"], 4),
            "load_reshard_s": round(load_s, 3),
            "ours_file_mb_s": round(mb / med["ours_file"], 1), "raw_file_mb_s": round(mb / med["raw_file"], 1),
            "ours_s3_mb_s": round(mb / med["ours_s3"], 1), "raw_s3_mb_s": round(mb / med["raw_s3"], 1),
            "dcp_fsspec_s3_mb_s": round(mb / med["dcp_s3"], 1), "blocked_s3_s": round(med["block_s3"], 3),
        }), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--role", default="")
    ap.add_argument("--dir", default="")
    a = ap.parse_args()
    if "RANK" in os.environ:
        worker(a)
    else:
        launch(a)
