"""``etrain plan --explain``: the usual rules of thumb, in this model's numbers at this size.

    for line in explain(cfg, world, dev): print(line)

When plain data parallelism wins (everything fits replicated: no sharding traffic beyond one
all-reduce), when ZeRO-2 is enough (gradients and optimizer state sharded, parameters whole),
when ZeRO-3 or tensor parallelism is forced (the model states, or the activations, do not fit
otherwise), when context parallelism is forced (one sample's activations do not fit a rank under any
layout without it: micro-batch 1, ZeRO-3, full checkpointing, tp with SP, pp), and what activation
checkpointing buys (memory) and costs (recomputation). Each line
is computed with the planner's own accounting for layouts at ``world`` ranks.
"""

from __future__ import annotations

from ..config import RunConfig
from ..observe.device_memory import paper_bytes_per_param
from .accounting import Layout
from .cost import Device
from .search import HEADROOM, cp_degrees, cp_styles, evaluate, meshes
from .shape import Shape

GiB = 2**30


def _gib(n: float) -> str:
    for div, unit in ((GiB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:,.1f} {unit}"
    return f"{n:.0f} B"


def explain(cfg: RunConfig, shape: Shape, world: int, dev: Device) -> list[str]:
    p = shape.n_params
    usable = HEADROOM * dev.memory
    mb = cfg.train.micro_batch
    lines = [(f"Model states: {p / 1e6:,.1f}M parameters x 16 bytes (bf16 weights and gradients, fp32 master, "
              f"Adam m and v: the ZeRO paper's 16P) = {_gib(16 * p)} before activations; "
              f"{_gib(usable)} usable per {dev.name} device.")]
    per_stage = {z: paper_bytes_per_param(z, world, True) * p for z in range(4)}
    stages = ", ".join(f"ZeRO-{z} {_gib(b)}" for z, b in per_stage.items())
    lines.append(f"Per device at N = {world}: {stages} (16P, 4P + 12P/N, 2P + 14P/N, 16P/N).")

    def best_of(layouts: list[Layout]):
        cands = [evaluate(cfg, lay, dev) for lay in layouts]
        valid = [c for c in cands if c.valid]
        fit = sorted((c for c in valid if c.fits), key=lambda c: c.step_s)
        return fit[0] if fit else min(valid, key=lambda c: c.memory["total"], default=None)

    dp = {z: best_of([Layout(1, world, 1, 1, z, False, ac, mb, reduce_every=every) for ac in ("none", "full")
                      for every in ((False, True) if z == 3 else (False,))]) for z in range(4)}
    if dp[0] is not None and dp[0].fits:
        lines.append(f"Plain DP (ZeRO-0) fits ({_gib(dp[0].memory['total'])}): it wins when its one all-reduce "
                     "costs less than ZeRO-3's gathers; the search below compares them.")
    elif dp[0] is not None:
        lines.append(f"Plain DP does not fit: {_gib(dp[0].memory['total'])} per rank even with the cheapest "
                     "activation setting.")
    for z, name in ((1, "ZeRO-1"), (2, "ZeRO-2")):
        c = dp[z]
        if c is not None and c.fits:
            lines.append(f"{name} is enough at {world} ranks: {_gib(c.memory['total'])} per rank "
                         f"({c.layout.describe()}); parameters stay whole, so no gathers in forward.")
            break
    else:
        lines.append("ZeRO-1 and ZeRO-2 do not fit: the whole bf16 parameters (2P = "
                     f"{_gib(2 * p)}) and the activations leave no room.")
    if dp[3] is not None and not dp[3].fits:
        lines.append(f"Even ZeRO-3 over all {world} ranks needs {_gib(dp[3].memory['total'])} per rank "
                     f"(activations {_gib(dp[3].memory['activations'])}): tensor, pipeline or context parallelism is "
                     "forced, to shard the activations and the parameters further.")
    elif dp[3] is not None and not any(dp[z] is not None and dp[z].fits for z in range(3)):
        lines.append(f"ZeRO-3 is forced: only sharding the parameters too fits ({_gib(dp[3].memory['total'])}).")
    cp_line = context_parallel_line(cfg, world, dev)
    if cp_line:
        lines.append(cp_line)
    base = dp[3] or dp[0]
    if base is not None:
        lay = base.layout
        none, full = (evaluate(cfg, Layout(lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.zero_stage,
                                           lay.sequence_parallel, ac, mb), dev) for ac in ("none", "full"))
        if none.valid and full.valid:
            lines.append(f"Activation checkpointing (micro-batch {mb}): activations {_gib(none.memory['activations'])}"
                         f" -> {_gib(full.memory['activations'])} per rank, for "
                         f"{(full.time['compute_s'] / none.time['compute_s'] - 1) * 100:.0f}% more compute "
                         "(the forward again in backward).")
    return lines


def context_parallel_line(cfg: RunConfig, world: int, dev: Device) -> str | None:
    """Whether context parallelism is forced at ``world``: the leanest layout of every mesh without it (one
    sample per micro-batch, ZeRO-3, full checkpointing, SP) against the fastest that fits with it; None when
    the model or the sequence cannot take cp > 1."""
    degrees = [c for c in cp_degrees(cfg, world) if c > 1]
    if not degrees:
        return None
    lean = [evaluate(cfg, Layout(d.dp_replicate, d.dp_shard, d.tp, d.pp, 3 if d.dp > 1 else 0, d.tp > 1, "full", 1),
                     dev) for d in meshes(cfg, world) if d.cp == 1 and (d.dp_replicate == 1 or d.dp > 1)]
    lean = [c for c in lean if c.valid]
    least = min(lean, key=lambda c: c.memory["total"], default=None)
    if least is None or least.fits:
        return None if least is None else (
            f"Context parallelism is not forced: one sample of seq {cfg.data.seq_len} fits without it "
            f"({least.layout.describe()}: {_gib(least.memory['total'])} per rank); cp trades its attention traffic "
            "for activation memory / cp when a larger micro-batch or less recomputation pays.")
    with_cp = [evaluate(cfg, Layout(1, world // c, 1, 1, 3, False, ac, 1, cp=c, cp_style=st), dev)
               for c in degrees for st in cp_styles(cfg, c) for ac in ("none", "full")]
    fits = sorted((c for c in with_cp if c.valid and c.fits), key=lambda c: c.step_s)
    head = (f"Context parallelism is forced: one sample of seq {cfg.data.seq_len} needs "
            f"{_gib(least.memory['total'])} per rank even at {least.layout.describe()} (activations "
            f"{_gib(least.memory['activations'])}, logits {_gib(least.memory['logits'])})")
    if not fits:
        return head + f", and no cp up to {max(degrees)} fits either: add devices or shorten data.seq_len."
    b = fits[0]
    return (head + f"; {b.layout.describe()} fits ({_gib(b.memory['total'])}: each rank holds seq / "
            f"{b.layout.cp} positions), set parallel.cp={b.layout.cp} parallel.cp_style=\"{b.layout.cp_style}\".")
