"""ZeRO++ (qwZ, qgZ, hpZ): step time and bytes per step at world 4 behind an emulated slow inter-node link.

    python bench/zeropp.py [--quick] [--world 4] [--node-size 2] [--inter-mbps 50] [--intra-mbps 2000]

The ranks (torchrun on 127.0.0.1, gloo) are cut into "nodes" of ``--node-size`` consecutive ranks. The
link is emulated in the transport: every collective (all-gather, reduce-scatter, all-to-all, all-reduce)
runs for real, then waits out its bus bytes (the nccl-tests definition: (n-1)/n of the size for the
first three, twice that for the all-reduce) at ``--inter-mbps`` MB/s when its group spans two nodes or
more, at ``--intra-mbps`` when it stays inside one. Nothing overlaps the wait (no prefetch hides it):
an upper bound on the step time communication costs. ``tc`` on network namespaces was not used: it
needs root, and a namespace per rank for gloo's loopback rendezvous.

ZeRO-3 (and ZeRO-2) train the tiny preset in bf16 with each of: nothing, qwZ, qgZ, hpZ, all three;
rounds alternate the layouts so that noise on this shared machine hits them alike. For each: the
median step time (slowest rank), the comm meter's bytes per step by kind (rank 0), and the bytes that
crossed the node boundary; then ratios against the plain layout beside DeepSpeed's published figures
(ZeRO++, arXiv 2306.10209: 4x less cross-node communication with all three; +28-36% throughput at
384 V100s, up to 2.16x at low bandwidth). Last line: one JSON object.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import main, parse_args, slowest_rank_medians, time_steps  # noqa: E402

QW, QG, HPZ = "parallel.quantized_weights=true", "parallel.quantized_gradients=true", "parallel.hpz_partition_size"
DEEPSPEED = {"comm_reduction": 4.0, "throughput_gain_384_v100": [1.28, 1.36], "low_bandwidth_speedup_max": 2.16}


class Link:
    """The emulated links: wraps torch.distributed's collectives (outside the comm meter's wrappers)."""

    NAMES = {"all_gather_single": ("output_tensor", 0, 1.0), "all_gather_into_tensor": ("output_tensor", 0, 1.0),
             "reduce_scatter_single": ("input", 1, 1.0), "reduce_scatter_tensor": ("input", 1, 1.0),
             "all_to_all_single": ("input", 1, 1.0), "all_reduce": ("tensor", 0, 2.0)}

    def __init__(self, node_size: int, inter_bps: float, intra_bps: float):
        import torch.distributed as dist

        self.dist, self.node_size, self.inter, self.intra = dist, node_size, inter_bps, intra_bps
        self.cross_bytes = 0.0  # bus bytes that crossed a node boundary, this rank
        for name, spec in self.NAMES.items():
            orig = getattr(dist, name, None)
            if orig is not None:
                setattr(dist, name, self._wrap(orig, *spec))

    def _wrap(self, orig, arg: str, index: int, factor: float):
        @functools.wraps(orig)
        def throttled(*args, **kwargs):
            work = orig(*args, **kwargs)
            t = args[index] if len(args) > index else kwargs.get(arg)
            group = kwargs.get("group")
            ranks = self.dist.get_process_group_ranks(group) if group is not None else list(
                range(self.dist.get_world_size()))
            n = len(ranks)
            if n > 1 and t is not None:
                if work is not None and kwargs.get("async_op"):
                    work.wait()
                bus = factor * (n - 1) / n * t.numel() * t.element_size()
                across = len({r // self.node_size for r in ranks}) > 1
                if across:
                    self.cross_bytes += bus
                time.sleep(bus / (self.inter if across else self.intra))
            return work

        return throttled


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from tests.jobs import comm_per_step
    from trainer.config.load import load_config
    from trainer.data.corpus import load_corpus
    from trainer.loop import Trainer
    from trainer.observe.telemetry import comm_meter
    from trainer.world import World, forget_meshes, init_distributed, shutdown_distributed

    world = World.from_env()
    device = torch.device("cpu")
    meter = comm_meter()
    init_distributed(world, device)
    link = Link(args.node_size, args.inter_mbps * 1e6, args.intra_mbps * 1e6)
    hpz = f"{HPZ}={args.node_size}"
    layouts = {"zero3": [], "zero3_qwz": [QW], "zero3_qgz": [QG], "zero3_hpz": [hpz], "zero3_all": [QW, QG, hpz]}
    layouts = {k: ["parallel.zero_stage=3", *v] for k, v in layouts.items()}
    layouts.update({"zero2": ["parallel.zero_stage=2"], "zero2_qwz_qgz": ["parallel.zero_stage=2", QW, QG]})
    if args.quick:
        layouts = {k: v for k, v in layouts.items() if k in ("zero3", "zero3_all", "zero2", "zero2_qwz_qgz")}
    base = [f'model.preset="{args.preset}"', "data.max_bytes=2000000", "data.seq_len=64", "train.global_batch=8",
            "train.micro_batch=2", "train.warmup_steps=0", f'parallel.mixed_precision="{args.precision}"',
            f"train.steps={10**6}"]
    corpus = load_corpus(load_config(None, base).data)
    trainers = {}
    for name, over in layouts.items():
        forget_meshes()
        trainers[name] = Trainer(load_config(None, base + over), world, corpus=corpus, device=device)
        trainers[name].train_step()  # warm-up (lazy init)
    rounds = args.rounds or (2 if args.quick else 4)
    per_round = args.steps_per_round or (2 if args.quick else 4)
    times = {k: [] for k in layouts}
    comm = {k: {} for k in layouts}
    cross = {k: 0.0 for k in layouts}
    for r in range(rounds):
        order = list(layouts) if r % 2 == 0 else list(reversed(layouts))
        for name in order:
            t = trainers[name]
            meter.name_axes(t.mesh)
            before, c0 = meter.snapshot(), link.cross_bytes
            times[name] += time_steps(t.train_step, per_round)
            cross[name] += link.cross_bytes - c0
            for key, v in comm_per_step(meter, before, per_round).items():
                comm[name][key] = comm[name].get(key, 0.0) + v["bytes"] / rounds
    medians = dict(zip(layouts, slowest_rank_medians(*times.values())))
    steps = rounds * per_round
    out = {}
    for name in layouts:
        ref = name.split("_")[0]
        by_kind: dict[str, float] = {}
        for key, v in comm[name].items():
            by_kind[key.split("/")[0]] = by_kind.get(key.split("/")[0], 0.0) + v
        out[name] = {"step_s": round(medians[name], 4), "bytes_per_step": {k: round(v) for k, v in by_kind.items()},
                     "cross_node_bytes_per_step": round(cross[name] / steps),
                     "speedup": round(medians[ref] / medians[name], 3),
                     "cross_node_reduction": round(cross[ref] / max(1.0, cross[name]), 3)}
    dist.barrier()
    if world.is_main:
        print(f"world {world.size}, nodes of {args.node_size}, {args.precision}, {args.preset}; link "
              f"{args.inter_mbps:g} MB/s across nodes, {args.intra_mbps:g} MB/s inside (emulated in the transport)")
        print(f"{'layout':<16}{'step ms':>9}{'speedup':>9}{'cross-node MB/step':>20}{'reduction':>11}  "
              "bytes/step by kind")
        for name, o in out.items():
            kinds = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(o["bytes_per_step"].items()))
            cross_mb = o["cross_node_bytes_per_step"] / 1e6
            print(f"{name:<16}{o['step_s'] * 1e3:>9.1f}{o['speedup']:>9.2f}{cross_mb:>20.2f}"
                  f"{o['cross_node_reduction']:>10.2f}x  {kinds}")
        print(f"DeepSpeed (arXiv 2306.10209): {DEEPSPEED['comm_reduction']:g}x less cross-node communication, "
              f"+28-36% throughput on 384 V100s, up to {DEEPSPEED['low_bandwidth_speedup_max']}x at low bandwidth")
        print(json.dumps({"bench": "zeropp", "world": world.size, "node_size": args.node_size,
                          "inter_mbps": args.inter_mbps, "intra_mbps": args.intra_mbps, "precision": args.precision,
                          "preset": args.preset, "steps_measured": steps, "link": "transport throttle",
                          "layouts": out, "deepspeed": DEEPSPEED}), flush=True)
    shutdown_distributed()


def extra(ap) -> None:
    ap.add_argument("--node-size", type=int, default=2, help="consecutive ranks per emulated node (hpZ's group)")
    ap.add_argument("--inter-mbps", type=float, default=50.0, help="MB/s of the link between nodes")
    ap.add_argument("--intra-mbps", type=float, default=2000.0, help="MB/s inside a node")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))


if __name__ == "__main__":
    a = parse_args("four layouts, fewer steps (about a minute here)", extra)
    if "RANK" not in os.environ and "--world" not in sys.argv:
        sys.argv += ["--world", "4"]
        a.world = 4
    main(__file__, worker, a)
