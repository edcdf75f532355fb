"""``etrain plan CONFIG``: does it fit, which layout, what it costs, at every size the run can take.

    etrain plan examples/tiny.toml --workers 2..8 --device cpu
    etrain plan run.toml --workers 64 --device h100 --explain --json
    etrain plan run.toml --device custom --device-memory 40GiB --tflops 300 --intra-node-bw 300GB/s \\
        --inter-node-bw 25GB/s --gpus-per-node 4
    etrain plan run.toml --device cpu --calibrate        # fit this machine's rates first, store, reuse

Sizes: ``--workers N`` or ``MIN..MAX``; without it, ``[elastic]`` min_workers..max_workers. Every size
in range is checked as a run is (the batch arithmetic, dp_replicate x cp x tp x pp); a size the config
cannot take is listed with the reason. At the largest valid size the whole layout space is searched
(:mod:`trainer.plan.search`); at every valid size the config's own layout and the best one with its
tp, pp and cp (what an elastic resize keeps) are costed, with the bytes a resize moves.

Exit status: 0, also when nothing fits (the output says so); 2 for bad input, naming the flag or
field. Torch is imported only after the arguments are parsed, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from collections.abc import Callable

from checkpointing.cli_args import ArgumentParser
from checkpointing.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str, per_second: bool = False) -> float:
    """``80GiB``, ``40GB``, ``450GB/s``, ``1.5e9``: a positive number of bytes (or bytes per second)."""
    t = text.strip().lower().replace(" ", "")
    if per_second:
        t = t.removesuffix("/s").removesuffix("ps")
    mt = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([a-z]*)", t)
    if not mt or mt.group(2) not in _UNITS or not 0 < float(mt.group(1)) < math.inf:
        what = "a bandwidth such as 450GB/s" if per_second else "a size such as 80GiB or 40GB"
        raise ConfigError(f"{flag} {text!r} is not {what}")
    return float(mt.group(1)) * _UNITS[mt.group(2)]


def parse_workers(text: str) -> tuple[int, int]:
    mt = re.fullmatch(r"\s*(\d+)\s*(?:(?:\.\.|-|:)\s*(\d+)\s*)?", text or "")
    if not mt:
        raise ConfigError(f"--workers {text!r} must be a size N or a range MIN..MAX, e.g. --workers 8..64")
    lo = int(mt.group(1))
    hi = int(mt.group(2)) if mt.group(2) else lo
    if lo < 1 or hi < lo:
        raise ConfigError(f"--workers {text!r}: sizes must be >= 1 and MIN <= MAX, e.g. --workers 8..64")
    if hi > 65536:
        raise ConfigError(f"--workers {text!r}: at most 65536 devices")
    return lo, hi


def build_parser(prog: str = "etrain plan") -> argparse.ArgumentParser:
    ap = ArgumentParser(prog=prog, description="Plan a run: per-rank memory, communication and step time "
                                 "of the best layouts at every size the run can take (docs/planning.md).")
    ap.add_argument("config", metavar="CONFIG", help="run config (TOML)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    ap.add_argument("--workers", metavar="N|MIN..MAX", help="sizes to plan (default [elastic] min..max workers)")
    ap.add_argument("--device", default="h100", choices=("h100", "a100", "cpu", "custom"),
                    help="device profile (default h100; custom: h100's figures with the flags below replacing them)")
    ap.add_argument("--device-memory", metavar="SIZE", help="memory per device, e.g. 80GiB")
    ap.add_argument("--tflops", type=float, metavar="T", help="achieved TFLOP/s per device (replaces peak x efficiency)")
    ap.add_argument("--intra-node-bw", metavar="BW", help="bus bandwidth inside a node per device, e.g. 360GB/s")
    ap.add_argument("--inter-node-bw", metavar="BW", help="bus bandwidth between nodes per device, e.g. 40GB/s")
    ap.add_argument("--gpus-per-node", type=int, metavar="N", help="devices per node (default 8; cpu 1)")
    ap.add_argument("--nvme-bw", metavar="BW", help='with parallel.offload="nvme": the drive\'s bandwidth per rank, '
                    "e.g. 3GB/s (the time its swap adds to a step)")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of text")
    ap.add_argument("--explain", action="store_true", help="when DP, ZeRO-2, ZeRO-3, TP and AC win, in this "
                                                             "model's numbers")
    ap.add_argument("--calibrate", action="store_true", help="first measure this machine (two steps of the "
                                                               "model, timed all-reduces), store the fit, use it")
    ap.add_argument("--budget-s", type=float, default=6.0, help="seconds the random search may take per size")
    return ap


def _no_elastic(raw: dict) -> tuple[int, int]:
    raise ConfigError("give --workers N or MIN..MAX: the run's [elastic] range is read by `etrain plan`, "
                      "not by the trainer alone")


def main(argv: list[str] | None = None, prog: str = "etrain plan",
         elastic: Callable[[dict], tuple[int, int]] | None = None) -> int:
    """``elastic(raw) -> (min_workers, max_workers)``: the orchestrator's reading of [elastic] (validated), the
    sizes planned without ``--workers``; without it (the trainer alone) ``--workers`` is needed."""
    args = build_parser(prog).parse_args(argv)
    try:
        return _run(args, elastic or _no_elastic)
    except ConfigError as e:
        print(f"etrain plan: {e}", file=sys.stderr)
        return 2


def _device(args):
    from .calibrate import apply, load
    from .cost import DEVICES, custom

    base = DEVICES["h100" if args.device == "custom" else args.device]
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node} must be >= 1")
    if args.tflops is not None and not 0 < args.tflops < math.inf:  # nan fails both comparisons
        raise ConfigError(f"--tflops {args.tflops} must be a finite number > 0 (achieved TFLOP/s per device)")
    dev = custom(base, name=args.device,
                 memory=int(parse_bytes(args.device_memory, "--device-memory")) if args.device_memory else None,
                 intra_bw=parse_bytes(args.intra_node_bw, "--intra-node-bw", True) if args.intra_node_bw else None,
                 inter_bw=parse_bytes(args.inter_node_bw, "--inter-node-bw", True) if args.inter_node_bw else None,
                 gpus_per_node=args.gpus_per_node)
    if args.device == "cpu" and not args.device_memory:
        import os

        dev = custom(dev, memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // dev.gpus_per_node)
    dev = apply(dev, load(args.device))
    if args.tflops is not None:
        dev = custom(dev, peak_flops=args.tflops * 1e12, efficiency=1.0)
    return dev


def _run(args, elastic: Callable) -> int:
    from trainer.config.load import config_from_dict, load_raw

    if not 0 < args.budget_s < math.inf:
        raise ConfigError(f"--budget-s {args.budget_s} must be > 0 (seconds the random search may take per size)")
    for flag in ("device_memory", "intra_node_bw", "inter_node_bw", "nvme_bw"):  # bad flags before any work
        value = getattr(args, flag)
        if value:
            parse_bytes(value, "--" + flag.replace("_", "-"), flag != "device_memory")
    raw = load_raw(args.config, args.set)
    cfg = config_from_dict(raw)
    lo, hi = parse_workers(args.workers) if args.workers else elastic(raw)
    import torch

    if args.calibrate:
        from .calibrate import calibrate

        if args.device in ("h100", "a100") and not torch.cuda.is_available():
            raise ConfigError(f"--calibrate measures this machine, which has no GPU: use --device cpu (or custom), "
                              f"not --device {args.device}")
        fit = calibrate(cfg, args.device, "cuda" if torch.cuda.is_available() else "cpu")
    else:
        fit = None
    dev = _device(args)
    doc = build_plan(cfg, lo, hi, dev, explain_too=args.explain, budget_s=args.budget_s)
    if fit:
        doc["calibration"] = fit
    if doc["plan"]:  # offload="nvme": what the swap moves per step, and the bandwidth that hides it
        from .offload import nvme_doc

        bw = parse_bytes(args.nvme_bw, "--nvme-bw", True) if args.nvme_bw else None
        doc["plan"]["nvme"] = nvme_doc(doc["plan"]["best"] or doc["plan"]["config_layout"], bw)
    if args.json:
        print(json.dumps(doc, default=str))
    else:
        print_plan(doc)
    return 0


def build_plan(cfg, lo: int, hi: int, dev, *, explain_too: bool = False, budget_s: float = 6.0) -> dict:
    """The whole plan as one JSON-able document (see docs/planning.md for its keys)."""
    from .explain import explain
    from .search import evaluate, plan_elastic, plan_size
    from .shape import model_shape, planning_config

    shape = model_shape(cfg)
    plan_cfg = planning_config(cfg, shape)
    el = plan_elastic(plan_cfg, lo, hi, dev, budget_s=budget_s if lo != hi else 0.5)
    doc: dict = {
        "model": {"name": shape.name, "params": shape.n_params, "counted": shape.how, "block_params": shape.block_params,
                  "layers": shape.model.n_layers, "dim": shape.model.dim, "seq_len": cfg.data.seq_len,
                  "global_batch": cfg.train.global_batch, "model_state_bytes_16p": 16 * shape.n_params},
        "device": dev.to_dict(), "workers": [lo, hi],
        "sizes": [_size_doc(s) for s in el["sizes"]], "resizes": el["resizes"], "plan": None}
    if el["valid"]:
        world = el["valid"][-1]
        from .accounting import Layout

        res = plan_size(plan_cfg, world, dev, budget_s=budget_s)
        doc["plan"] = {"world": world, "method": res["method"], "searched": res["searched"], "space": res["space"],
                       "seconds": round(res["seconds"], 3),
                       "best": res["best"].to_dict() if res["best"] else None,
                       "runner_up": res["runner_up"].to_dict() if res["runner_up"] else None,
                       "closest": res["closest"].to_dict() if res.get("closest") else None,
                       "losers": [c.to_dict(brief=True) for c in res["losers"]],
                       "config_layout": evaluate(plan_cfg, Layout.of(plan_cfg, world), dev).to_dict()}
        doc["plan"]["zeropp"] = _zeropp_doc(plan_cfg, world, dev)
        if res["best"]:  # the config lines that select the best layout (none: it is the config's own)
            layout = res["best"].layout
            doc["plan"]["select"] = {"set": [f"{s}.{n}={v}" for s, n, v in layout.changes(plan_cfg, world)],
                                     "toml": layout.toml(plan_cfg, world)}
        if explain_too:
            doc["explain"] = explain(plan_cfg, shape, world, dev)
    elif explain_too:
        doc["explain"] = []
    return doc


def _zeropp_doc(cfg, world: int, dev) -> dict:
    """The config layout's ZeRO++ settings: bytes each saves per step, hpZ's secondary shard's memory."""
    from ..parallel.dims import ParallelDims
    from .accounting import hpz_secondary_bytes
    from .comm import zeropp_savings

    try:
        dims = ParallelDims.from_config(cfg, world)
    except ConfigError:
        return {}
    out = zeropp_savings(cfg, dims, 0, dev.mixed)
    if "hpZ" in out:
        out["hpZ"]["memory_bytes"] = hpz_secondary_bytes(cfg, dims, 0, dev.mixed)
    return out


def _size_doc(s: dict) -> dict:
    if not s["valid"]:
        return s
    own, best = s["config_layout"], s["best"]
    return {"world": s["world"], "valid": True, "config_layout": own.to_dict(brief=True),
            "best": best.to_dict(brief=True) if best else None}


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _human_bytes(n: float) -> str:
    for div, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def moe_line(mem: dict) -> str:
    """A Mixture of Experts' parameters, expert and dense, each with its sharding (trainer.plan.experts)."""
    ep = mem["moe_ep"]
    return (f"experts {mem['moe_experts'] / 1e6:,.2f}M params, split ep {ep} x sharded "
            f"{mem['moe_expert_shards'] // ep}: {mem['moe_expert_held'] / 1e6:,.3f}M per rank, gathering "
            f"{mem['moe_n_experts'] // ep} of {mem['moe_n_experts']} experts per layer; dense "
            f"{mem['moe_dense'] / 1e6:,.2f}M, sharded {mem['moe_dense_shards']}: "
            f"{mem['moe_dense_held'] / 1e6:,.3f}M per rank")


def _describe(c: dict) -> str:
    mem, t = c["memory_bytes"], c["time"]
    return (f"{c['describe']}: {_gib(mem['total'])}/rank, step {t['step_s'] * 1e3:.1f} ms "
            f"(compute {t['compute_s'] * 1e3:.1f} ms, bubble {t['bubble'] * 100:.0f}%, exposed comm "
            f"{t['exposed_s'] * 1e3:.1f} ms)")


# What a layout's description (Layout.describe) says, printed under a plan.
LEGEND = ("layout: dp RxS = parallel.dp_replicate R x dp_shard S: the batch is split R*S ways; model states are "
          "replicated R times and sharded over the S ranks (x cp) as the ZeRO stage says (ZeRO-0: not sharded, "
          "ZeRO-3: parameters too, FSDP), so under ZeRO 1-3 dp 1xS is ZeRO/FSDP, dp Rx1 plain replication (DDP) and "
          "dp RxS with both > 1 HSDP; tp, pp, cp, ep: the tensor, pipeline, context and expert-parallel degrees; "
          "ZeRO-N: the stage asked; SP: sequence parallelism; AC: activation checkpointing; mb: micro-batch per rank")


def select_lines(select: dict | None) -> list[str]:
    """How to run the best layout: its ``--set`` flags and the TOML lines that select it, or that the config
    already does."""
    if not select:
        return []
    if not select["set"]:
        return ["  select:    the config's own layout (nothing to change)"]
    return ["  select:    " + " ".join(f"--set {s}" for s in select["set"]), "             or in the config:",
            *(f"               {line}" for line in select["toml"])]


def print_plan(doc: dict) -> None:
    m, d = doc["model"], doc["device"]
    print(f"etrain plan: {m['name']}, {m['params'] / 1e6:,.1f}M parameters (counted from the {m['counted']}), "
          f"{m['layers']} blocks, seq {m['seq_len']}, global batch {m['global_batch']}; 16P = "
          f"{_human_bytes(m['model_state_bytes_16p'])} of model states")
    cal = f", calibrated {d['calibrated']}" if d["calibrated"] else ""
    print(f"device {d['name']}: {_gib(d['memory'])}, {d['peak_flops'] * d['efficiency'] / 1e12:.3g} TFLOP/s achieved, "
          f"links {_human_bytes(d['intra_bw'])}/s in a node, {_human_bytes(d['inter_bw'])}/s across, "
          f"{d['gpus_per_node']} per node{cal}")
    for line in doc.get("explain") or []:
        print("  * " + line)
    plan = doc["plan"]
    if plan is None:
        print(f"no size in {doc['workers'][0]}..{doc['workers'][1]} is valid for this config:")
    else:
        print(f"\nsize {plan['world']}: {plan['method']}, {plan['searched']} layouts costed in {plan['seconds']:.1f} s")
        if plan["best"]:
            b = plan["best"]
            print(f"  plan:      {_describe(b)}")
            mem = b["memory_bytes"]
            parts = ", ".join(f"{k} {_gib(mem[k])}" for k in ("params", "grads", "optimizer", "activations",
                                                              "logits", "workspace", "optimizer_step", "transient",
                                                              "recovery_tier"))
            print(f"             {parts}; host memory: checkpoint staging {_gib(mem['host_staging'])}, "
                  f"memory tier up to {_gib(mem['host_recovery_tier'])}")
            if "moe_experts" in mem:
                print("             " + moe_line(mem))
            if plan.get("nvme"):
                from .offload import nvme_line

                print(f"             {nvme_line(plan['nvme'])}")
            comm = ", ".join(f"{c['kind']} {c['axis']} {_human_bytes(c['bytes'])} ({c['link']})" for c in b["comm"])
            print(f"             per step: {comm or 'no communication'}")
            for line in select_lines(plan.get("select")):
                print(line)
            if plan["runner_up"]:
                print(f"  runner-up: {_describe(plan['runner_up'])} - {plan['runner_up']['reason']}")
            for c in plan["losers"]:
                print(f"  lost:      {c['describe']} - {c['reason']}")
        else:
            c = plan["closest"]
            print("  no layout fits" + (f"; the smallest is {c['describe']} at {_gib(c['memory_bytes']['total'])}/rank"
                                        if c else ""))
        own = plan["config_layout"]
        if own["valid"]:
            print(f"  config:    {_describe(own)}{'' if own['fits'] else ' - DOES NOT FIT'}")
        for name, z in plan.get("zeropp", {}).items():
            mem = f", costs {_gib(z['memory_bytes'])}/rank (secondary shard)" if "memory_bytes" in z else ""
            signed = lambda n: ("-" if n >= 0 else "+") + _human_bytes(abs(n))
            print(f"  ZeRO++ {name}: {signed(z['shard_axis_bytes_saved'])}/step across the shard group, "
                  f"{signed(z['bytes_saved'])} in all (per rank){mem}")
    if len(doc["sizes"]) > 1 or not doc["sizes"][0]["valid"]:
        print("\nsizes (the config's layout; the best with its tp, pp and cp):")
        sizes = doc["sizes"]
        # The config's ep at each size (parallel.ep=0 chooses it per size: ParallelDims.expert_degree).
        show_ep = {s["config_layout"]["layout"]["ep"] for s in sizes if s["valid"]} - {1}
        for i, s in enumerate(sizes):
            if not s["valid"]:  # a run of invalid sizes: one line, its first reason
                if i and not sizes[i - 1]["valid"]:
                    continue
                j = i
                while j + 1 < len(sizes) and not sizes[j + 1]["valid"]:
                    j += 1
                span = f"{s['world']}" if j == i else f"{s['world']}-{sizes[j]['world']}"
                print(f"  {span:>5}  invalid: {s['reason']}")
                continue
            own, best = s["config_layout"], s["best"]
            fit = "fits" if own["fits"] else "DOES NOT FIT"
            b = f"; best {best['describe']} {best['time']['step_s'] * 1e3:.1f} ms" if best else "; nothing fits"
            ep = f"ep {own['layout']['ep']}, " if show_ep else ""
            print(f"  {s['world']:>5}  {ep}{_gib(own['memory_bytes']['total'])}/rank {fit}, "
                  f"{own['time']['step_s'] * 1e3:.1f} ms{b}")
    if plan is not None:
        print("\n" + textwrap.fill(LEGEND, 118, subsequent_indent="  "))
    if doc["resizes"]:
        print("resize cost (bytes moved between ranks): " + ", ".join(
            f"{r['from']}->{r['to']} {_human_bytes(r['bytes'])}" for r in doc["resizes"]))


if __name__ == "__main__":
    sys.exit(main())
