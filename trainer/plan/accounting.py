"""Per-rank memory of one layout: model states, activations, buffers, checkpoint staging, recovery tier.

    layout = Layout(dp_replicate=1, dp_shard=8, tp=1, pp=1, zero_stage=3)
    layout.dims.world_size, layout.dims.shard_ranks  # the degrees' ParallelDims: every derived quantity
    cfg8, dims = layout.apply(cfg, world=8)        # the real config checks: ConfigError names the field
    mem = rank_memory(cfg8, dims, rank=0, mixed=True)
    mem["total"]                                    # device bytes at the step's peak, this rank

Model states (parameters, gradients, optimizer state) and the step's transient buffers are
:mod:`trainer.observe.device_memory`'s accounting (:func:`~trainer.observe.device_memory.predict`,
:func:`~trainer.observe.device_memory.transient_bytes`): the ZeRO paper's table as this trainer holds it.

Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (MLSys 2023), section 4: per layer, the tensors a block saves for backward, sharded by
tensor parallelism inside the tensor-parallel regions and, with sequence parallelism, outside them
too; full recomputation keeps a block's input alone, plus one block's worth while it is recomputed
(``recompute``, when the loss's logits are already freed).
:func:`korthikanti_bytes` is the paper's own formula (GPT blocks, 16-bit, dropout);
:func:`block_activation_elems` is the same count for this trainer's Llama block (RMSNorm, rotary
SDPA with no materialized scores, SwiGLU, no dropout). A pipeline stage holds several micro-batches
at once (1F1B: pp - stage index; GPipe: all; interleaved: Narayanan et al. 2021's factor
1 + (p - 1) / (p v)). Context parallelism (``cp``) divides every activation by ``cp`` (each rank holds
``seq_len / cp`` positions end to end) and adds the other ranks' K/V while a block attends: two blocks
(ring), all of them (allgather), or q, k, v of the whole sequence for ``n_heads / cp`` heads (ulysses).

Checkpoint staging is host memory (the async save's blocking copy), and so is the memory tier of
recovery (:mod:`checkpointing.recovery.tier`: the host buffers a snapshot is copied into, at most two
own snapshots and two of a peer's, ``host_recovery_tier``); its device bytes are a hook, :data:`RECOVERY_TIER`, 0 today.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from ..config import RunConfig
from ..models import spec_for
from ..observe.device_memory import predict, transient_bytes
from ..parallel.dims import Axis, ParallelDims, config_dp_shard
from .experts import expert_counts
from .offload import nvme_memory

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
AC_MODES = ("none", "every_k", "full")


@dataclass(frozen=True)
class Layout:
    """One point of the search space: the degrees of :class:`ParallelDims` (:attr:`dims`, which answers every
    quantity they imply), the ZeRO stage asked for, SP and the pipeline schedule, each named as ``[parallel]``
    names it, plus the planner's own fields (:data:`PLANNER_FIELDS`; the pipeline's micro-batches and the cp
    attention style keep their config names too). ``etrain plan --json`` prints the short names it always has
    (:meth:`to_dict`)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    zero_stage: int = 3  # parallel.zero_stage as asked (dims.zero_stage: the one in effect)
    sequence_parallel: bool = False
    ac: str = "none"
    micro_batch: int = 1
    pp_schedule: str = "1f1b"
    stages_per_rank: int = 1
    reduce_every: bool = False  # ZeRO-3 with several micro-batches: reduce-scatter after each (sharded accumulation)
    pp_microbatches: int = 0  # parallel.pp_microbatches (0: automatic, what the search proposes)
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    cp_style: str = "ring"
    ep: int = 1  # expert parallelism (a Mixture of Experts): experts split over ep of the dp_shard ranks

    @cached_property
    def dims(self) -> ParallelDims:
        """The mesh value of these degrees (ConfigError where ep does not divide dp_shard)."""
        return ParallelDims(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp,
                            cp=self.cp, ep=self.ep, zero_requested=self.zero_stage)

    @classmethod
    def of(cls, cfg: RunConfig, world: int) -> Layout:
        """The layout ``cfg`` asks for at ``world`` (dp_shard = -1 resolved)."""
        values = {f: getattr(getattr(cfg, section), name) for f, (section, name) in CONFIG_FIELDS.items()}
        values["dp_shard"] = config_dp_shard(cfg.parallel, world)
        values["ep"] = ParallelDims.expert_degree(cfg, values["dp_shard"])  # parallel.ep=0: this size's own
        return cls(**values)

    def apply(self, cfg: RunConfig, world: int | None = None) -> tuple[RunConfig, ParallelDims]:
        """``cfg`` with this layout, checked by the config and :class:`ParallelDims` exactly as a run is."""
        changes: dict[str, dict] = {"parallel": {}, "train": {}}
        for f, (section, name) in CONFIG_FIELDS.items():
            changes[section][name] = getattr(self, f)
        changes["parallel"].update(self.zeropp(cfg))
        new = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **changes["parallel"]),
                                  train=dataclasses.replace(cfg.train, **changes["train"]))
        return new, ParallelDims.from_config(new, world or self.dims.world_size)

    def zeropp(self, cfg: RunConfig) -> dict:
        """The config's ZeRO++ keys (docs/parallelism.md) where this layout can hold them, off where not."""
        p, hpz = cfg.parallel, cfg.parallel.hpz_partition_size
        return {"quantized_weights": p.quantized_weights and self.zero_stage > 0,
                "quantized_gradients": p.quantized_gradients and self.zero_stage > 0,
                "hpz_partition_size": hpz if hpz and self.zero_stage == 3 and self.pp == 1
                and not self.dims.shard_ranks % hpz else 0}

    def changes(self, cfg: RunConfig, world: int) -> list[tuple[str, str, str]]:
        """The config fields to set for this layout, ``(section, name, TOML value)``: those that differ from what
        ``cfg`` asks for at ``world`` (``dp_shard`` left out when the config fills the world with -1)."""
        own = Layout.of(cfg, world)
        out = []
        for f, (section, name) in CONFIG_FIELDS.items():
            value = getattr(self, f)
            if value == getattr(own, f) or (f == "dp_shard" and cfg.parallel.dp_shard == -1) or (
                    f == "cp_style" and self.cp == 1):
                continue
            text = str(value).lower() if isinstance(value, bool) else f'"{value}"' if isinstance(value, str) else value
            out.append((section, name, str(text)))
        return out

    def settings(self, cfg: RunConfig, world: int) -> str:
        """:meth:`changes` as ``--set`` would take them: ``parallel.tp=2 train.micro_batch=4``."""
        return " ".join(f"{section}.{name}={text}" for section, name, text in self.changes(cfg, world))

    def toml(self, cfg: RunConfig, world: int) -> list[str]:
        """:meth:`changes` as the lines of a run config's TOML, under their section headers."""
        out: list[str] = []
        for section in ("parallel", "train"):
            lines = [f"{name} = {text}" for s, name, text in self.changes(cfg, world) if s == section]
            out += [f"[{section}]", *lines] if lines else []
        return out

    def describe(self) -> str:
        mesh = f"dp {self.dp_replicate}x{self.dp_shard} tp {self.tp} pp {self.pp}"
        if self.cp > 1:
            mesh += f" cp {self.cp} {self.cp_style}"
        if self.ep > 1:
            mesh += f" ep {self.ep}"
        extra = [f"ZeRO-{self.zero_stage}"] + (["SP"] if self.sequence_parallel else []) + (
            [f"AC {self.ac}"] if self.ac != "none" else [])
        extra.append(f"mb {self.micro_batch}")
        if self.reduce_every:
            extra.append("reduce every mb")
        if self.pp > 1:
            extra.append(self.pp_schedule + (f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""))
        return f"{mesh}, {', '.join(extra)}"

    def to_dict(self) -> dict:
        """The fields as ``etrain plan --json`` has always named them (:data:`JSON_KEYS`), in field order."""
        return {JSON_KEYS.get(k, k): v for k, v in dataclasses.asdict(self).items()}


# The planner's own fields and the config field (section, name) that holds each; every other Layout field is
# [parallel]'s field of the same name.
PLANNER_FIELDS = {"ac": ("parallel", "activation_checkpoint"), "micro_batch": ("train", "micro_batch"),
                  "stages_per_rank": ("parallel", "pp_stages_per_rank"),
                  "reduce_every": ("parallel", "reduce_every_microbatch")}
# Each Layout field and the config field that holds it, in field order (the order settings() names them).
CONFIG_FIELDS = {f.name: PLANNER_FIELDS.get(f.name, ("parallel", f.name)) for f in dataclasses.fields(Layout)}
# The keys `etrain plan --json` prints for the fields named after the config's (docs/planning.md): kept for the
# tools that read them.
JSON_KEYS = {"zero_stage": "zero", "sequence_parallel": "sp", "pp_schedule": "schedule"}


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: bool = False) -> float:
    """Activation bytes of one GPT layer, 16-bit, from Korthikanti et al. 2023 (eq. 1-4, Table 2):
    ``sbh(34 + 5as/h)`` alone; ``sbh(10 + 24/t + 5as/(ht))`` with tensor parallelism; ``sbh/t (34 + 5as/h)``
    with sequence parallelism too; ``2sbh`` (``2sbh/t`` with SP) under full recomputation."""
    if recompute:
        return 2 * s * b * h / (t if sp else 1)
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def block_activation_elems(cfg: RunConfig, tp: int, sp: bool) -> float:
    """Elements per token one block saves for backward (module docstring): the model's shape asked."""
    return spec_for(cfg.model).shape().block_activation_elems(tp, sp)


def _in_flight(dims: ParallelDims, cfg: RunConfig, stage: int) -> float:
    """Micro-batches whose activations a pipeline stage holds at once."""
    if dims.pp == 1:
        return 1
    m, p = dims.pp_microbatches(cfg), cfg.parallel
    if p.pp_schedule == "gpipe":
        return m
    held = min(m, dims.pp - stage)
    if p.pp_schedule == "interleaved_1f1b":
        v = p.pp_stages_per_rank
        return min(m * v, dims.pp * (1 + (dims.pp - 1) / (dims.pp * v))) / v
    return held


def activation_bytes(cfg: RunConfig, dims: ParallelDims, rank: int, act_bytes: int) -> dict[str, float]:
    """``activations`` (blocks, all micro-batches in flight), ``logits`` (the last stage's loss),
    ``workspace`` (backward's largest temporaries) and ``recompute`` (a checkpointed block's
    activations while backward recomputes it) of ``rank``, in bytes."""
    p, m = cfg.parallel, spec_for(cfg.model).shape()
    tokens = cfg.train.micro_batch * cfg.data.seq_len / dims.cp  # context parallelism: seq_len / cp positions
    n_stages, stages = dims.stages(rank, p.pp_stages_per_rank)
    split = m.stage_layers(n_stages)
    layers = sum(len(split[s]) for s in stages)
    full = m.block_activation_elems(dims.tp, p.sequence_parallel) * tokens * act_bytes
    kept = m.dim * tokens * act_bytes / (dims.tp if p.sequence_parallel else 1)
    recompute = 0.0  # one checkpointed block's activations, again, while backward recomputes it
    if p.activation_checkpoint == "full":
        per_mb, recompute = layers * kept, full
    elif p.activation_checkpoint == "every_k":
        ck = sum(1 for s in stages for i in split[s] if i % p.ac_every_k == 0)
        per_mb, recompute = ck * kept + (layers - ck) * full, (full if ck else 0.0)
    elif p.activation_checkpoint == "selective":
        saved = kept + m.block_matmul_elems(dims.tp) * tokens * act_bytes
        per_mb, recompute = layers * min(saved, full), max(0.0, full - saved)
    else:
        per_mb = layers * full
    pp_coord = dims.coords(rank)[Axis.PP]
    acts = per_mb * _in_flight(dims, cfg, pp_coord)
    last = (n_stages - 1) in stages
    logits = tokens * m.vocab_size / (dims.tp if p.loss_parallel else 1) * (act_bytes + 8) if last else 0
    final = 2 * m.dim * tokens * act_bytes if last else 0
    workspace = tokens * (2 * m.ffn_hidden / dims.tp + 2 * m.dim) * act_bytes
    if dims.cp > 1:  # attention's K/V from the other cp ranks while a block attends (cp_attention)
        local_dim = m.dim / dims.tp  # a tp rank's heads
        kv = 2 * tokens * local_dim * m.n_kv_heads // m.n_heads * act_bytes
        workspace += {"ring": 2 * kv, "allgather": dims.cp * kv, "ulysses": 3 * tokens * local_dim * act_bytes}[
            p.cp_style]
    return {"activations": acts + final, "logits": logits, "workspace": workspace, "recompute": recompute}


def bucket_bytes(cfg: RunConfig, dims: ParallelDims, local_params: int) -> int:
    """The ZeRO 1-2 optimizer's bucket scratch (:mod:`trainer.zero`): ``4 (n + 1)`` times the widest
    bucket's row, a row being ``bucket_mb / (4 n)`` elements or the largest parameter's chunk."""
    stage = dims.zero_stage
    if stage not in (1, 2):
        return 0
    n, m = dims.dp_shard, spec_for(cfg.model).shape()
    largest = max(m.vocab_size * m.dim, m.dim * m.ffn_hidden) // dims.tp
    row = max(cfg.parallel.bucket_mb * 2**20 / (4 * n), largest / n)
    return int(4 * (n + 1) * min(row, local_params / n + 1))


# Device bytes the recovery tiers hold on a rank (cfg, dims, rank) -> bytes. The peer-memory and local
# tiers keep their copies in host memory, so 0 today; a tier that stages on the device sets this.
def _no_device_tier(cfg: RunConfig, dims: ParallelDims, rank: int) -> int:
    return 0


RECOVERY_TIER: Callable[[RunConfig, ParallelDims, int], int] = _no_device_tier


def _alongside_activations(cfg: RunConfig, dims: ParallelDims, rank: int, mixed: bool, transient: int,
                           recomputing: bool = False) -> int:
    """What the model-state buffers hold while backward's activations peak (its start).

    ZeRO-2: a bucket. ZeRO-3 (FSDP2): the gathered root (embedding, head) and the last block (kept
    gathered after forward), or every gathered parameter under a pipeline; with several micro-batches
    and no ``reduce_every_microbatch``, also the whole unsharded gradients it accumulates into.
    ``recomputing``: while backward recomputes a checkpointed block, which is gathered, with that
    block's unsharded gradients and their fp32 reduce-scatter copy beside it."""
    from ..observe.device_memory import local_counts

    stage = dims.zero_stage
    if stage == 2:
        return transient
    if stage != 3:
        return 0
    block, total = local_counts(cfg, dims, rank)
    if dims.ep > 1:  # a rank gathers (and accumulates the gradients of) only its n_experts / ep experts
        ex = expert_counts(cfg, dims, rank)
        total -= ex["experts"] - ex["gathered"]
        block -= (ex["experts"] - ex["gathered"]) // max(1, ex["moe_layers"])
    n_stages, stages = dims.stages(rank, cfg.parallel.pp_stages_per_rank)
    split = spec_for(cfg.model).shape().stage_layers(n_stages)
    blocks = sum(len(split[s]) for s in stages)
    p = 2 if mixed else 4
    gathered = p * total if dims.pp > 1 else p * (total - blocks * block + block)
    accumulated = p * total if dims.microbatches(cfg) > 1 and not cfg.parallel.reduce_every_microbatch else 0
    if recomputing:  # a block recomputed in backward: gathered with its unsharded and fp32 reduced gradients
        gathered += (p + 4) * block
    return gathered + accumulated


# Host copies of a rank's state the memory tier holds at most: the buffers each snapshot is copied into, two
# own snapshots, two of a peer's (one replica, the default of [recovery] replicas).
MEMORY_TIER_COPIES = 5


def hpz_secondary_bytes(cfg: RunConfig, dims: ParallelDims, rank: int, mixed: bool) -> int:
    """ZeRO++'s hpZ: from forward to backward every block but the last (kept whole anyway) holds a shard of
    1 / hpz_partition_size of its parameters (compute dtype) instead of 1 / dp_shard: the extra bytes at
    backward's start."""
    hpz = cfg.parallel.hpz_partition_size
    shard = dims.shard_ranks
    if not hpz or not dims.uses_fsdp or dims.pp > 1 or hpz >= shard:
        return 0
    from ..observe.device_memory import local_counts

    block, total = local_counts(cfg, dims, rank)
    return round((2 if mixed else 4) * max(0, total - block) * (1 / hpz - 1 / shard))


def rank_memory(cfg: RunConfig, dims: ParallelDims, rank: int, mixed: bool) -> dict[str, int]:
    """Device bytes of ``rank`` at the step's peak, by part, and ``total``; ``host_staging`` (the async
    checkpoint's host copy of this rank's state) and ``host_recovery_tier`` (the memory tier's copies,
    at most) are host memory, outside ``total``.

    The peak is the model states and the recovery tier, plus the largest of three moments: the
    model-state buffers' own peak (``transient``, :func:`trainer.observe.device_memory.transient_bytes`),
    backward's start (activations, logits, workspace and what the buffers hold then,
    ``with_activations``), a checkpointed block's recomputation (the activations kept, that block's
    again, the workspace, the buffers with that block gathered and its gradients), and the optimizer step, whose foreach AdamW makes one fp32 temporary the
    size of what this rank updates (``optimizer_step``; for the small preset at micro-batch 2 it is
    the step that peaks)."""
    from ..observe.device_memory import local_param_count

    states = predict(cfg, dims, rank, mixed)
    count = local_param_count(cfg, dims, rank)
    act = activation_bytes(cfg, dims, rank, 2 if mixed else 4)
    shard = dims.zero_shards
    nvme = nvme_memory(cfg, dims, count, mixed)  # offload="nvme": AdamW's m and v in a file, updated a unit at a time
    staged = states["optimizer"]  # a checkpoint copies the offloaded state all the same
    if nvme:
        states["optimizer"] -= nvme["nvme_state"]
    out = {**states, "transient": transient_bytes(cfg, dims, rank, mixed, bucket_bytes(cfg, dims, count)),
           **{k: round(v) for k, v in act.items()}, "optimizer_step": 4 * count // shard,
           "recovery_tier": RECOVERY_TIER(cfg, dims, rank)}
    if nvme:
        out.update(nvme, optimizer_step=4 * nvme["offload_unit_params"])
    out["with_activations"] = _alongside_activations(cfg, dims, rank, mixed, out["transient"])
    out["hpz_secondary"] = hpz_secondary_bytes(cfg, dims, rank, mixed)
    backward = (out["activations"] + out["logits"] + out["workspace"] + out["with_activations"]
                + out["hpz_secondary"])
    recompute = 0
    if out["recompute"]:  # the loss and its logits are gone by then
        recompute = out["activations"] + out["recompute"] + out["workspace"] + _alongside_activations(
            cfg, dims, rank, mixed, out["transient"], recomputing=True)
    out["total"] = sum(states.values()) + out["recovery_tier"] + max(out["transient"], backward, recompute,
                                                                      out["optimizer_step"])
    out["host_staging"] = round(count * 4 / (shard if dims.uses_fsdp else 1)) + staged
    # The memory tier (checkpointing.recovery.tier), in host memory: the host buffers, at most two own snapshots
    # and, with one replica, the copies of a peer's at those steps: five times the state at most.
    out["host_recovery_tier"] = MEMORY_TIER_COPIES * out["host_staging"]
    out["param_count"] = count
    ex = expert_counts(cfg, dims, rank)
    if ex["experts"]:  # a Mixture of Experts: each kind of parameter with its own sharding (trainer.plan.experts)
        out.update({f"moe_{k}": v for k, v in ex.items()})
    return out


def peak_ranks(dims: ParallelDims) -> list[int]:
    """Ranks that can peak highest: the first and the last pipeline stage (embedding, most micro-batches
    in flight; head and logits), at the first data- and tensor-parallel coordinate."""
    per_stage = dims.world_size // dims.pp
    return sorted({0, (dims.pp - 1) * per_stage})


def peak_memory(cfg: RunConfig, dims: ParallelDims, mixed: bool) -> dict[str, int]:
    """:func:`rank_memory` of the rank that peaks highest, with its ``rank``."""
    best = None
    for r in peak_ranks(dims):
        mem = rank_memory(cfg, dims, r, mixed)
        if best is None or mem["total"] > best["total"]:
            best = {**mem, "rank": r}
    return best
