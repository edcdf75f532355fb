"""The layout search and the elastic plan: the fastest layout that fits, at every size a run can take.

    res = plan_size(cfg, 64, DEVICES["h100"])     # {"best", "runner_up", "losers", "searched", "method", ...}
    el = plan_elastic(cfg, 16, 64, dev)           # every size in [16, 64]: valid or why not, and resize costs

Every candidate is checked by the config's own validation (:meth:`Layout.apply`: the config
sections and :class:`trainer.parallel.dims.ParallelDims`, the checks that refuse a run), then
costed by the simulator (:mod:`.accounting`, :mod:`.cost`). Small spaces are enumerated; large
ones are searched as FlexFlow does (Jia et al., "Beyond Data and Model Parallelism for Deep
Neural Networks", MLSys 2019, section 5): a Markov chain over layouts whose proposals change one
choice (move a prime factor between two mesh axes, or change the ZeRO stage, SP, AC, micro-batch or
schedule) and whose moves are accepted by the Metropolis rule on the simulated step time, with
restarts from the config's layout and from the usual seeds (FSDP alone, TP in a node).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, replace

from checkpointing.errors import ConfigError

from ..config import RunConfig, divisors
from ..config.parallel import cp_refuses_dropout, cp_splits, ep_carves, ulysses_splits
from ..config.parallel import ep_degrees as carved_ep_degrees
from ..parallel.dims import Axis, ParallelDims, fixed_degree
from .accounting import Layout, peak_memory, peak_ranks
from .cost import Device, step_time

EXHAUSTIVE_LIMIT = 12000  # candidates; beyond this the search samples
HEADROOM = 0.95  # share of the device's memory a plan may fill (allocator fragmentation, runtime)


@dataclass
class Candidate:
    layout: Layout
    valid: bool
    reason: str = ""  # why it is invalid, or why it lost
    memory: dict | None = None
    time: dict | None = None
    fits: bool = False

    @property
    def step_s(self) -> float:
        return self.time["step_s"] if self.time else math.inf

    def to_dict(self, brief: bool = False) -> dict:
        out = {"layout": self.layout.to_dict(), "describe": self.layout.describe(), "valid": self.valid,
               "fits": self.fits, "reason": self.reason}
        if self.memory is not None:
            out["memory_bytes"] = self.memory if not brief else {"total": self.memory["total"]}
        if self.time is not None:
            keep = ("compute_s", "bubble", "comm_s", "exposed_s", "step_s")
            out["time"] = {k: self.time[k] for k in keep}
            if not brief:
                out["time"]["comm_by_axis"] = self.time["comm_by_axis"]
                out["comm"] = self.time["comm"]
        return out


def evaluate(cfg: RunConfig, layout: Layout, dev: Device) -> Candidate:
    """One layout, checked and costed."""
    try:
        new, dims = layout.apply(cfg)
    except ConfigError as e:
        return Candidate(layout, False, str(e))
    mem = peak_memory(new, dims, dev.mixed)
    t = max((step_time(new, dims, r, dev) for r in peak_ranks(dims)), key=lambda x: x["step_s"])
    return Candidate(layout, True, "", mem, t, mem["total"] <= HEADROOM * dev.memory)


def _allowed(cfg: RunConfig) -> dict:
    """What the model allows (its spec's preflight refuses the rest; trainer.models)."""
    allows = getattr(cfg, "plan_allows", ("tp", "pp", "sp", "cp"))  # trainer.plan.shape.planning_config sets it
    return {k: k in allows for k in ("tp", "pp", "sp", "cp")}


def cp_styles(cfg: RunConfig, cp: int, tp: int = 1) -> list[str]:
    """The attention styles a cp of ``cp`` can take (ulysses: a tp rank's heads divisible by cp)."""
    if cp == 1:
        return ["ring"]
    return ["ring", "allgather"] + (["ulysses"] if ulysses_splits(cfg.model.n_heads, tp, cp) else [])


def ep_degrees(cfg: RunConfig, dp_shard: int) -> list[int]:
    """Expert-parallel degrees: 1, and for a Mixture of Experts the divisors of dp_shard that divide n_experts."""
    return carved_ep_degrees(cfg.model.n_experts, dp_shard)


def _choices(cfg: RunConfig, dims: ParallelDims) -> dict:
    """What may vary on the mesh ``dims``."""
    ok = _allowed(cfg)
    local = dims.local_batch(cfg) if cfg.train.global_batch % dims.dp == 0 else 0
    mbs = sorted({d for d in divisors(local) if d & (d - 1) == 0 or d == cfg.train.micro_batch}) if local else [1]
    scheds = [("1f1b", 1)] if dims.pp == 1 else [("1f1b", 1), ("gpipe", 1)] + (
        [("interleaved_1f1b", 2)] if cfg.model.n_layers >= 2 * dims.pp else [])
    # Context parallelism's ranks hold copies of the parameters: every stage shards over dp_shard x cp.
    zero = [0, 1, 2, 3] if dims.grad_ranks > 1 else [0]
    return {"zero": zero, "sp": [False, True] if dims.tp > 1 and ok["sp"] else [False],
            "ac": ["none", "every_k", "full"], "mb": mbs[-6:], "sched": scheds,
            "cp_style": cp_styles(cfg, dims.cp, dims.tp), "ep": ep_degrees(cfg, dims.dp_shard)}


def cp_degrees(cfg: RunConfig, world: int) -> list[int]:
    """The context-parallel degrees the model and the sequence allow at ``world`` (seq_len splits into 2 x cp)."""
    if not _allowed(cfg)["cp"] or cp_refuses_dropout(cfg.model):
        return [1]
    return [c for c in divisors(world) if cp_splits(cfg.data.seq_len, c)] or [1]


def meshes(cfg: RunConfig, world: int) -> list[ParallelDims]:
    """The meshes (dp_replicate, dp_shard, tp, pp, cp) of ``world`` ranks that the model could take."""
    ok, m = _allowed(cfg), cfg.model
    out = []
    for cp in cp_degrees(cfg, world):
        for tp in divisors(world // cp):
            if tp > 1 and (not ok["tp"] or m.n_heads % tp or m.n_kv_heads % tp):
                continue
            for pp in divisors(world // (cp * tp)):
                if pp > 1 and (not ok["pp"] or pp > m.n_layers):
                    continue
                dp = world // (cp * tp * pp)  # what is left for dp_replicate x dp_shard
                for rep in divisors(dp):
                    out.append(ParallelDims(pp=pp, dp_replicate=rep, dp_shard=dp // rep, tp=tp, cp=cp))
    return out


def enumerate_layouts(cfg: RunConfig, world: int) -> list[Layout]:
    out = []
    for d in meshes(cfg, world):
        c = _choices(cfg, d)
        for z, sp, ac, mb, (sched, v), style, ep in itertools.product(c["zero"], c["sp"], c["ac"], c["mb"],
                                                                      c["sched"], c["cp_style"], c["ep"]):
            if d.dp_replicate > 1 and z != 3:
                continue  # dp_replicate only differs from one flat dp axis as HSDP
            # Sharded accumulation matters at ZeRO-3 with several micro-batches and no pipeline.
            many = z == 3 and d.pp == 1 and d.local_batch(cfg) > mb
            for every in (False, True) if many else (False,):
                out.append(Layout(d.dp_replicate, d.dp_shard, d.tp, d.pp, z, sp, ac, mb, sched, v, every, cp=d.cp,
                                  cp_style=style, ep=ep))
    return out


def _cost(c: Candidate, dev: Device) -> float:
    if not c.valid:
        return math.inf
    over = max(0.0, c.memory["total"] / (HEADROOM * dev.memory) - 1)
    return c.step_s * (1 + 10 * over) + (1e6 if over else 0)


def _propose(cfg: RunConfig, cur: Layout, rng: random.Random) -> Layout:
    what = rng.choice(("mesh", "mesh", "mesh", "zero", "sp", "ac", "mb", "sched", "every", "cp_style", "ep"))
    if what == "mesh":
        axes = [str(a) for a in (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.TP, Axis.PP, Axis.CP)]  # Layout's fields
        src, dst = rng.sample(axes, 2)
        n = getattr(cur, src)
        if n == 1:
            return cur
        f = next(p for p in range(2, n + 1) if n % p == 0)
        return replace(cur, **{src: n // f, dst: getattr(cur, dst) * f})
    c = _choices(cfg, cur.dims)
    if what == "ep":
        return replace(cur, ep=rng.choice(c["ep"]))
    if what == "cp_style":
        return replace(cur, cp_style=rng.choice(c["cp_style"]))
    if what == "zero":
        return replace(cur, zero_stage=rng.choice(c["zero"]))
    if what == "sp":
        return replace(cur, sequence_parallel=rng.choice(c["sp"]))
    if what == "ac":
        return replace(cur, ac=rng.choice(c["ac"]))
    if what == "every":
        return replace(cur, reduce_every=not cur.reduce_every)
    if what == "mb":
        return replace(cur, micro_batch=rng.choice(c["mb"]))
    sched, v = rng.choice(c["sched"])
    return replace(cur, pp_schedule=sched, stages_per_rank=v)


def _normalize(cfg: RunConfig, lay: Layout) -> Layout:
    """Degenerate choices made canonical (no schedule without pp, no SP without tp, ZeRO 0 at dp 1, one flat
    dp axis below ZeRO-3), as :func:`enumerate_layouts` makes them."""
    if lay.dp_replicate > 1 and lay.zero_stage != 3:  # dp_replicate only differs from one flat dp axis as HSDP
        lay = replace(lay, dp_replicate=1, dp_shard=lay.dp_replicate * lay.dp_shard)  # the two axes merged
    if not ep_carves(lay.ep, lay.dp_shard):  # first: the layout's dims refuse such an ep
        lay = replace(lay, ep=1)
    if lay.pp == 1:
        lay = replace(lay, pp_schedule="1f1b", stages_per_rank=1)
    if lay.tp == 1:
        lay = replace(lay, sequence_parallel=False)
    if lay.cp == 1:
        lay = replace(lay, cp_style="ring")
    if lay.dims.grad_ranks == 1:
        lay = replace(lay, zero_stage=0)
    if lay.zero_stage != 3 or lay.pp > 1 or lay.dims.local_batch(cfg) <= lay.micro_batch:
        lay = replace(lay, reduce_every=False)
    return lay


def _anneal(cfg: RunConfig, world: int, dev: Device, seen: dict, budget_s: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    gpn = min(dev.gpus_per_node, world)
    tp0 = max(d for d in divisors(gpn) if world % d == 0 and cfg.model.n_heads % d == 0
              and cfg.model.n_kv_heads % d == 0) if _allowed(cfg)["tp"] else 1
    # The config's layout as a start, its pipeline micro-batches automatic like every candidate's.
    own = replace(Layout.of(cfg, world), pp_microbatches=0)
    p = cfg.parallel
    starts = [own if world % fixed_degree(p.dp_replicate, p.tp, p.pp, p.cp) == 0 else Layout(1, world, 1, 1),
              Layout(1, world, 1, 1, 3), Layout(1, world // tp0, tp0, 1, 3, tp0 > 1, "full")]
    deadline = time.monotonic() + budget_s

    def get(lay: Layout) -> Candidate:
        lay = _normalize(cfg, lay)
        if lay not in seen:
            seen[lay] = evaluate(cfg, lay, dev)
        return seen[lay]

    steps = 0
    while time.monotonic() < deadline:
        cur = get(starts[steps % len(starts)] if steps < len(starts) else rng.choice(list(seen)))
        temp = 0.05
        for _ in range(200):  # every layout visited stays in ``seen``, where the caller picks the best
            nxt = get(_propose(cfg, cur.layout, rng))
            a, b = _cost(cur, dev), _cost(nxt, dev)
            if b < a or (math.isfinite(b) and rng.random() < math.exp(-(b - a) / (temp * max(a, 1e-12)))):
                cur = nxt
            temp *= 0.98
        steps += 1


def why_lost(c: Candidate, best: Candidate, dev: Device) -> str:
    """The main reason ``c`` is not the plan (module docstring of :mod:`trainer.plan.cost` for the parts)."""
    if not c.valid:
        return c.reason
    gib = 2**30
    if not c.fits:
        return (f"does not fit: {c.memory['total'] / gib:.1f} GiB per rank > {HEADROOM * dev.memory / gib:.1f} "
                "GiB usable")
    t, b = c.time, best.time
    slower = f"{(c.step_s / best.step_s - 1) * 100:.0f}% slower"
    tp_link = next((x["link"] for x in t["comm"] if x["axis"] == "tp"), "intra")
    if c.layout.tp > 1 and tp_link == "inter":
        return f"{slower}: TP across nodes (tp={c.layout.tp} > {dev.gpus_per_node} GPUs per node)"
    if t["bubble"] > b["bubble"] + 0.02:
        return f"{slower}: pipeline bubble {t['bubble'] * 100:.0f}%"
    if t["exposed_s"] - b["exposed_s"] > 0.5 * (c.step_s - best.step_s):
        axis = max(t["comm_by_axis"], key=t["comm_by_axis"].get) if t["comm_by_axis"] else "-"
        return f"{slower}: exposed communication {t['exposed_s'] * 1e3:.1f} ms (most on {axis})"
    if t["compute_s"] > b["compute_s"] * 1.02:
        return f"{slower}: more compute ({'recomputation under AC' if c.layout.ac != 'none' else 'per rank'})"
    return slower


def plan_size(cfg: RunConfig, world: int, dev: Device, *, budget_s: float = 6.0, fixed_mp: bool = False,
              losers: int = 12) -> dict:
    """The search at one world size (module docstring). ``fixed_mp``: keep the config's tp and pp (an
    elastic run resizes only its data-parallel axes)."""
    t0 = time.monotonic()
    layouts = enumerate_layouts(cfg, world)
    if fixed_mp:
        mp = (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, Layout.of(cfg, world).ep)  # ep: this size's
        layouts = [x for x in layouts if (x.tp, x.pp, x.cp, x.ep) == mp]
    seen: dict[Layout, Candidate] = {}
    if len(layouts) <= EXHAUSTIVE_LIMIT:
        method = "exhaustive"
        for lay in layouts:
            seen[lay] = evaluate(cfg, lay, dev)
    else:
        method = "simulator-guided random search (Metropolis)"
        _anneal(cfg, world, dev, seen, budget_s)
        if fixed_mp:
            seen = {k: v for k, v in seen.items() if (k.tp, k.pp, k.cp, k.ep) == mp}
    fitting = sorted((c for c in seen.values() if c.valid and c.fits), key=lambda c: c.step_s)
    if not fitting:
        least = min((c for c in seen.values() if c.valid), key=lambda c: c.memory["total"], default=None)
        return {"world": world, "best": None, "runner_up": None, "closest": least, "losers": [],
                "searched": len(seen), "space": len(layouts), "method": method,
                "seconds": time.monotonic() - t0}
    best = fitting[0]
    runner = next((c for c in fitting[1:] if c.layout.zero_stage != best.layout.zero_stage
                   or c.layout.tp != best.layout.tp
                   or c.layout.pp != best.layout.pp or c.layout.dp_replicate != best.layout.dp_replicate
                   or c.layout.cp != best.layout.cp or c.layout.ep != best.layout.ep),
                  fitting[1] if len(fitting) > 1 else None)
    # One loser per family (mesh, ZeRO stage): its best member, and why it lost to the plan.
    fam: dict = {}
    for c in sorted(seen.values(), key=lambda c: _cost(c, dev)):
        key = (c.layout.dp_replicate, c.layout.tp, c.layout.pp, c.layout.cp, c.layout.cp_style,
               c.layout.zero_stage, c.layout.ep)
        if c is not best and c is not runner and key not in fam and c.valid:
            fam[key] = c
    # The closest families first, then (a third of the list) families that do not fit, so both reasons show.
    nofit = [c for c in fam.values() if not c.fits]
    lost = [c for c in fam.values() if c.fits][:losers - min(len(nofit), losers // 3)]
    lost += nofit[:losers - len(lost)]
    for c in lost + ([runner] if runner else []):
        c.reason = why_lost(c, best, dev)
    return {"world": world, "best": best, "runner_up": runner, "losers": lost, "searched": len(seen),
            "space": len(layouts), "method": method, "seconds": time.monotonic() - t0}


def shard_overlap(n1: int, n2: int) -> float:
    """Share of an evenly sharded state that stays on its rank when ``n1`` shards become ``n2``."""
    return sum(max(0.0, min((i + 1) / n1, (i + 1) / n2) - max(i / n1, i / n2)) for i in range(min(n1, n2)))


def resize_bytes(cfg: RunConfig, a: int, b: int, dev: Device) -> int:
    """Bytes moved between ranks when a run of ``cfg``'s layout goes from world ``a`` to ``b``: the sharded
    state (optimizer state from ZeRO-1, parameters too at ZeRO-3) re-cut from one shard count to the other,
    and a whole copy of the replicated state to each new rank."""
    from ..observe.device_memory import predict

    ca, da = Layout.of(cfg, a).apply(cfg, a)
    _, db = Layout.of(cfg, b).apply(cfg, b)
    n1, n2 = da.shard_ranks, db.shard_ranks  # the cp ranks are part of the sharding axis
    slices = da.world_size // n1  # shard groups: tp x pp x dp_replicate
    sa = predict(ca, da, 0, dev.mixed)
    sharded_rank = sa["optimizer"] * (da.zero_stage >= 1) + sa["params"] * da.uses_fsdp
    replicated_rank = sa["optimizer"] + sa["params"] - sharded_rank
    moved = sharded_rank * n1 * (1 - shard_overlap(n1, n2)) * slices
    if db.dp > da.dp:
        moved += replicated_rank * (db.world_size - da.world_size)
    return round(moved)


def plan_elastic(cfg: RunConfig, lo: int, hi: int, dev: Device, budget_s: float = 6.0) -> dict:
    """Every size in [lo, hi]: invalid with the config's reason, or the config's layout costed and the best
    layout with the same tp x pp; resize costs between neighbouring valid sizes and from ``lo`` to ``hi``."""
    from ..parallel.dims import ParallelDims

    sizes, valid = [], []
    per = max(0.5, budget_s / max(1, hi - lo + 1))
    for n in range(lo, hi + 1):
        try:
            ParallelDims.from_config(cfg, n)
        except ConfigError as e:
            sizes.append({"world": n, "valid": False, "reason": str(e)})
            continue
        own = evaluate(cfg, Layout.of(cfg, n), dev)
        best = plan_size(cfg, n, dev, budget_s=per, fixed_mp=True, losers=0)
        sizes.append({"world": n, "valid": True, "config_layout": own, "best": best["best"]})
        valid.append(n)
    moves = [{"from": x, "to": y, "bytes": resize_bytes(cfg, x, y, dev)} for x, y in itertools.pairwise(valid)]
    if len(valid) > 2:
        moves += [{"from": valid[-1], "to": valid[0], "bytes": resize_bytes(cfg, valid[-1], valid[0], dev)},
                  {"from": valid[0], "to": valid[-1], "bytes": resize_bytes(cfg, valid[0], valid[-1], dev)}]
    return {"sizes": sizes, "valid": valid, "resizes": moves}
