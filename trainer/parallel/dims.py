"""The parallel layout as a value: degrees per mesh axis, what they imply, the sizes a run may take.

    dims = ParallelDims.from_config(cfg, world_size)     # validates; no process group needed
    mesh = dims.build_mesh("cpu")                        # named axes: pp, dp_replicate, dp_shard, (cp,) tp
    dims.zero_stage, dims.dp, dims.uses_fsdp             # derived here, asked everywhere else
    dims.shard_ranks, dims.zero_shards, dims.grad_ranks  # ZeRO's shard group, its shards, the loss group's size
    dims.group(mesh, Mesh.DP)                            # a named (derived) mesh's process group
    valid_world_sizes(cfg, max_world=16)                 # what a run can be resized to (O(the batch's divisors))
    size_refusal(cfg, 6), why_no_size(cfg, 1, 16)        # why a size, or every size in a range, is refused

World = pp x dp_replicate x dp_shard x cp x tp, with tp innermost (neighbouring
ranks, the fastest links) and pp outermost. ``dp_shard`` is the elastic axis:
dp_replicate x cp x tp x pp is fixed for a run; resizing changes how many data-parallel
shards there are, and gradient accumulation keeps the global batch fixed.

Context parallelism (``cp``, :mod:`trainer.parallel.context`) multiplies into the world size as
``tp`` does: it splits each sequence, so it is not a data-parallel axis (every cp rank reads the same
samples), but the cp ranks hold the same parameters, so ZeRO shards over ``dp_shard x cp``
(:attr:`Mesh.DP_SHARD_CP`) and gradients and the loss are averaged over ``dp x cp`` (:attr:`Mesh.DP_CP`).
Expert parallelism (``ep``, :mod:`trainer.parallel.expert`) is carved from ``dp_shard`` (it must divide
it, at every size the run takes) and adds no ranks: groups of ``ep`` data-parallel ranks along ``dp_shard`` split
the experts of a Mixture of Experts; gradients and the loss are still averaged over ``dp``. With
``parallel.ep = 0`` each size takes its own ep (:meth:`ParallelDims.expert_degree`), so a resize may change it.

Every quantity the degrees imply (the data-parallel size, the world size, ZeRO's shard group and the
loss group, their axes, the ranks a group spans, the micro-batches of a step, the sizes a run may take) is a
property or method here, asked by the trainer, its ZeRO optimizers and the planner (whose layout,
:class:`trainer.plan.accounting.Layout`, is these degrees plus what only the planner chooses). The rules of cp
and ep are :mod:`trainer.config.parallel`'s, asked here at each size.

Pure arithmetic over the config plus the mesh accessors: it never imports the
model, so the orchestrator sizes a group without loading model code.
:mod:`trainer.parallel.parallelize` applies the layout to a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from checkpointing.errors import ConfigError

from ..config import ParallelConfig, RunConfig, divisors, fmt_list, or_join
from ..config.parallel import check_cp, check_ep_carved, expert_degree

if TYPE_CHECKING:  # torch is imported where a mesh or a device is made: the size rules (valid_world_sizes, which
    import torch  # `etrain resize` and the controller's scheduling ask) need none of it
    from torch.distributed.device_mesh import DeviceMesh


class Axis(StrEnum):
    """A dimension of the device mesh; its value is the mesh dimension's name."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"  # context parallelism: each sequence split over cp ranks
    TP = "tp"
    EP = "ep"  # expert parallelism, carved from dp_shard: a dimension of the expert mesh only (expert_mesh)


# The mesh's dimensions, outermost first (ranks are numbered row-major over them).
AXES = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)
DATA_AXES = (Axis.DP_REPLICATE, Axis.DP_SHARD)
DATA_NAMES = tuple(a.value for a in DATA_AXES)  # as mesh[...] takes them
# The expert mesh (ParallelDims.expert_mesh) splits dp_shard into these two dimensions, ep innermost: the ranks
# outside ep (over which FSDP shards the experts) and the ranks of one ep group (over which the experts are split).
EXPERT_SPLIT = ("dp_shard_mod_ep", Axis.EP.value)
# Under context parallelism the experts also shard over the cp ranks (which route different tokens through the
# same experts): the expert mesh's dp_shard_mod_ep and cp flattened (ParallelDims.expert_fsdp_mesh).
EXPERT_SHARD_CP = "dp_shard_mod_ep_cp"


class Mesh(StrEnum):
    """A derived mesh: axes flattened into one group (torchtitan's naming)."""

    DP = "dp"  # dp_replicate x dp_shard: the batch split, the loss and gradient reductions, ZeRO 0
    DP_SHARD_CP = "dp_shard_cp"  # dp_shard x cp: what ZeRO 1-3 shard over (dp_shard while cp is 1)
    DP_CP = "dp_cp"  # dp x cp: the loss group once cp splits sequences (dp while cp is 1)


DERIVED: dict[Mesh, tuple[Axis, ...]] = {
    Mesh.DP: DATA_AXES,
    Mesh.DP_SHARD_CP: (Axis.DP_SHARD, Axis.CP),
    Mesh.DP_CP: (*DATA_AXES, Axis.CP),
}


def fixed_degree(dp_replicate: int, tp: int, pp: int, cp: int = 1) -> int:
    """The ranks of one data-parallel shard: dp_replicate x cp x tp x pp, which must divide the world."""
    return dp_replicate * cp * tp * pp


def config_dp_shard(p: ParallelConfig, world: int) -> int:
    """``parallel.dp_shard`` at ``world``: as configured, or (-1) what the world leaves after the fixed degree."""
    return world // fixed_degree(p.dp_replicate, p.tp, p.pp, p.cp) if p.dp_shard == -1 else p.dp_shard


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each mesh axis (their product is the world size) and the ZeRO stage asked for."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1
    ep: int = 1
    # parallel.zero_stage as configured; :attr:`zero_stage` is the one in effect.
    zero_requested: int = 0

    @classmethod
    def from_config(cls, cfg: RunConfig, world_size: int) -> ParallelDims:
        """Resolve ``dp_shard = -1`` and check the layout against the world and the batch."""
        p = cfg.parallel
        fixed = fixed_degree(p.dp_replicate, p.tp, p.pp, p.cp)
        cp = f" x parallel.cp={p.cp}" if p.cp > 1 else ""
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not a multiple of parallel.dp_replicate={p.dp_replicate}{cp} "
                f"x parallel.tp={p.tp} x parallel.pp={p.pp} = {fixed}; "
                f"run on {fmt_list([fixed * k for k in range(1, 5)])} processes or change the layout"
            )
        dp_shard = config_dp_shard(p, world_size)
        if fixed * dp_shard != world_size:
            raise ConfigError(
                f"parallel.dp_replicate={p.dp_replicate} x dp_shard={dp_shard}{cp.replace(' parallel.', ' ')} "
                f"x tp={p.tp} x pp={p.pp} = {fixed * dp_shard}, but the world size is {world_size}; "
                "set parallel.dp_shard=-1 to fill it"
            )
        dims = cls(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp, cp=p.cp,
                   ep=cls.expert_degree(cfg, dp_shard), zero_requested=p.zero_stage)
        dims.check_features(cfg)  # first: cp's and sequence parallelism's rules refuse every size, not only this one
        dims.check_batch(cfg)
        return dims

    @staticmethod
    def expert_degree(cfg: RunConfig, dp_shard: int) -> int:
        """The ep of a run whose dp_shard is ``dp_shard``: ``parallel.ep`` as configured, or with ``parallel.ep
        = 0`` (automatic) the largest ep that divides both model.n_experts and dp_shard (1 without experts).
        The one rule the trainer, the orchestrator's valid sizes and the planner ask
        (:func:`trainer.config.parallel.expert_degree`)."""
        return expert_degree(cfg.parallel.ep, cfg.model.n_experts, dp_shard)

    def __post_init__(self) -> None:
        check_ep_carved(self.ep, self.dp_shard)

    # --- derived quantities: asked here, never re-derived ----------------------------------

    @property
    def dp(self) -> int:
        """The data-parallel size: how many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in effect: the one configured, or 0 without data or context parallelism (no copies
        of the parameters to shard)."""
        return self.zero_requested if self.grad_ranks > 1 else 0

    @property
    def grad_ranks(self) -> int:
        """The size of :attr:`loss_mesh` (dp x cp): what summed gradients and losses are divided by."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """The ranks of one ZeRO shard group, whatever the stage: dp_shard x cp (:attr:`Mesh.DP_SHARD_CP`; the cp
        ranks hold the same parameters). ZeRO-3's (and under ep the experts') resident shard is 1 / this."""
        return self.dp_shard * self.cp

    @property
    def zero_shards(self) -> int:
        """Ways ZeRO 1-3 split the optimizer state (and more): :attr:`shard_ranks`, or 1 at stage 0."""
        return self.shard_ranks if self.zero_stage > 0 else 1

    @property
    def shard_axis(self) -> str:
        """The axis ZeRO 1-3's collectives run over: ``dp_shard``, or ``dp_shard_cp`` under cp."""
        return Mesh.DP_SHARD_CP if self.cp > 1 else Axis.DP_SHARD

    @property
    def expert_shard_ranks(self) -> int:
        """The ranks the experts' own FSDP units shard over under ep: dp_shard / ep, x cp."""
        return self.dp_shard // self.ep * self.cp

    @property
    def expert_shard_axis(self) -> str:
        """Their axis: ``dp_shard_mod_ep`` (:data:`EXPERT_SPLIT`), or ``dp_shard_mod_ep_cp`` under cp."""
        return EXPERT_SHARD_CP if self.cp > 1 else EXPERT_SPLIT[0]

    @property
    def uses_fsdp(self) -> bool:
        """ZeRO-3 is FSDP2 (:mod:`trainer.parallel.fsdp`)."""
        return self.zero_stage == 3

    @property
    def loss_mesh(self) -> Mesh:
        """The group the loss and the gradients are averaged over: the data-parallel ranks, and the cp ranks
        (each saw its share of every sequence)."""
        return Mesh.DP_CP if self.cp > 1 else Mesh.DP

    def size(self, axis: str) -> int:
        """Degree of an axis or of a derived mesh (the product of its axes)."""
        if axis in DERIVED:
            out = 1
            for a in DERIVED[Mesh(axis)]:
                out *= self.size(a)
            return out
        return getattr(self, Axis(axis).value)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh axis (row-major over AXES; cp only where it is used)."""
        out = {}
        for axis in reversed(AXES):
            if axis == Axis.CP and self.cp == 1:
                continue
            rank, out[axis.value] = divmod(rank, self.size(axis))
        return out

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c[Axis.DP_REPLICATE] * self.dp_shard + c[Axis.DP_SHARD]

    def stages(self, rank: int, per_rank: int) -> tuple[int, list[int]]:
        """(pipeline stages in all, the stages ``rank`` runs) with ``per_rank`` stages per pp rank
        (interleaved: pp rank r holds stages r, r + pp, ...)."""
        n_stages = self.pp * per_rank
        if self.pp == 1:
            return n_stages, [0]
        return n_stages, [self.coords(rank)[Axis.PP] + k * self.pp for k in range(per_rank)]

    def span(self, axis: str) -> int:
        """Consecutive ranks one group of ``axis`` spans (row-major over :data:`AXES`, tp innermost): an axis of
        the mesh, a derived mesh (its outermost axis's), or one of the expert mesh's (ep innermost in dp_shard)."""
        if axis == Axis.EP:
            return self.span(Axis.CP) * self.ep
        outer = {Mesh.DP: Axis.DP_REPLICATE, Mesh.DP_CP: Axis.DP_REPLICATE, Mesh.DP_SHARD_CP: Axis.DP_SHARD,
                 EXPERT_SPLIT[0]: Axis.DP_SHARD, EXPERT_SHARD_CP: Axis.DP_SHARD}.get(axis, axis)
        out = 1
        for a in AXES[AXES.index(Axis(outer)):]:
            out *= self.size(a)
        return out

    def local_batch(self, cfg: RunConfig) -> int:
        return cfg.train.global_batch // self.dp

    def pp_microbatches(self, cfg: RunConfig) -> int:
        local = self.local_batch(cfg)
        return cfg.parallel.pp_microbatches or max(1, local // cfg.train.micro_batch)

    def microbatches(self, cfg: RunConfig) -> int:
        """Micro-batches a rank runs per step: the pipeline's, or (at least one) local batch / train.micro_batch."""
        return self.pp_microbatches(cfg) if self.pp > 1 else max(1, self.local_batch(cfg) // cfg.train.micro_batch)

    # --- checks --------------------------------------------------------------------------

    def check_batch(self, cfg: RunConfig) -> None:
        t, p = cfg.train, cfg.parallel
        if t.global_batch % (self.dp * t.micro_batch):
            good = valid_dp_sizes(cfg, max_dp=max(64, self.dp))
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by data-parallel size {self.dp} "
                f"x train.micro_batch={t.micro_batch}; data-parallel sizes that work: {fmt_list(good)} "
                f"(or change train.global_batch / train.micro_batch)"
            )
        if self.pp > 1:
            local, n_mb = self.local_batch(cfg), self.pp_microbatches(cfg)
            if local % n_mb:
                raise ConfigError(
                    f"parallel.pp_microbatches={n_mb} does not divide the local batch {local} "
                    f"(train.global_batch / data-parallel size); use one of {fmt_list(divisors(local))}"
                )
            if p.pp_schedule != "gpipe" and n_mb < self.pp:
                raise ConfigError(
                    f"parallel.pp_schedule={p.pp_schedule!r} needs at least pp={self.pp} micro-batches, "
                    f"got {n_mb}; raise train.global_batch or lower train.micro_batch"
                )
            if p.pp_schedule == "interleaved_1f1b" and n_mb % self.pp:
                raise ConfigError(
                    f"parallel.pp_schedule='interleaved_1f1b' needs the micro-batch count ({n_mb}) "
                    f"to be a multiple of pp={self.pp}"
                )

    def check_features(self, cfg: RunConfig) -> None:
        """Options that need something of the layout: refused here, before any process group starts."""
        p, seq = cfg.parallel, cfg.data.seq_len
        if p.sequence_parallel and seq % self.tp:
            near = [v for v in (seq - seq % self.tp, seq - seq % self.tp + self.tp) if v >= max(2, self.tp)]
            if cfg.model.seq_len_limit is not None:
                near = [v for v in near if v <= cfg.model.seq_len_limit] or near
            raise ConfigError(
                f"parallel.sequence_parallel=true splits every sample's data.seq_len={seq} positions evenly "
                f"across parallel.tp={self.tp} ranks; use data.seq_len={or_join(near)}, or sequence_parallel=false"
            )
        if self.cp > 1:
            check_cp(p, cfg.model, seq, self.tp)
        if p.offload == "cpu" and self.dp == 1:
            fixed = fixed_degree(self.dp_replicate, self.tp, self.pp, self.cp)
            raise ConfigError(
                f'parallel.offload="cpu" offloads what FSDP2 shards across data-parallel ranks, and this layout '
                f"has a data-parallel size of 1 at world size {self.world_size} (tp={self.tp} x pp={self.pp}); "
                f"run on {2 * fixed} processes with parallel.dp_shard=-1, or set parallel.offload=\"none\""
            )

        if p.hpz_partition_size:
            self.check_hpz(p.hpz_partition_size)

    def check_hpz(self, hpz: int) -> None:
        """ZeRO++'s hpZ: the secondary shard's groups must tile the ZeRO-3 shard group."""
        shard = self.shard_ranks
        if shard % hpz or hpz > shard:
            good = [d for d in divisors(shard) if d > 1]
            axes = "dp_shard x cp" if self.cp > 1 else "dp_shard"
            use = f"use hpz_partition_size={or_join(good)}, or 0 to turn hpZ off" if good else \
                "turn hpZ off with hpz_partition_size=0, or run on more data-parallel ranks"
            raise ConfigError(
                f"parallel.hpz_partition_size={hpz} must divide the ZeRO-3 shard group ({axes} = {shard} ranks "
                f"at world size {self.world_size}); {use}")
        if self.pp > 1:
            raise ConfigError(f"parallel.hpz_partition_size={hpz} has no effect with parallel.pp={self.pp}: pipeline "
                              "stages keep their parameters whole between forward and backward; set "
                              "hpz_partition_size=0")

    # --- meshes --------------------------------------------------------------------------

    def expert_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The mesh of the experts' weights under expert parallelism (None at ep 1): ``mesh`` with ``dp_shard``
        split into (dp_shard / ep, ep) (:data:`EXPERT_SPLIT`), ep innermost so that an ep group is consecutive
        data-parallel ranks. Collective: every rank builds it, in the same order."""
        if self.ep == 1 or mesh is None:
            return None
        # The dim by index: torch 2.11's _unflatten refuses a dim given by its name (an inverted check).
        dim = mesh.mesh_dim_names.index(Axis.DP_SHARD.value)
        return mesh._unflatten(dim, (self.dp_shard // self.ep, self.ep), EXPERT_SPLIT)

    def expert_fsdp_mesh(self, emesh: DeviceMesh) -> DeviceMesh:
        """What ZeRO-3 shards the (ep-split) expert weights over: the data-parallel ranks outside ep, x the cp
        ranks (:data:`EXPERT_SHARD_CP`, flattened), 2-D (dp_replicate, that) under HSDP as :meth:`fsdp_mesh` is.
        Collective under cp (the flattened mesh's group is made)."""
        if self.cp > 1:
            flat = emesh[(EXPERT_SPLIT[0], Axis.CP.value)]._flatten(EXPERT_SHARD_CP)
            if self.dp_replicate == 1:
                return flat
            from torch.distributed.device_mesh import DeviceMesh
            return DeviceMesh._concatenate([emesh[Axis.DP_REPLICATE.value], flat])
        if self.dp_replicate > 1:
            return emesh[(Axis.DP_REPLICATE.value, EXPERT_SPLIT[0])]
        return emesh[EXPERT_SPLIT[0]]

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """A named mesh over the axes of size > 1 (None on a single process), and ``dp_shard`` of size 1
        beside a ``dp_replicate`` > 1 (:meth:`fsdp_mesh`: HSDP replicates across it, shards within 1).

        Each derived mesh (:class:`Mesh`) over two or more axes of size > 1 is created too, flattened: ``dp``
        (for the loss and norm reductions and ZeRO 0/1), ``dp_shard_cp`` and ``dp_cp`` under context parallelism.
        """
        names = tuple(a.value for a in AXES
                      if self.size(a) > 1 or (a == Axis.DP_SHARD and self.dp_replicate > 1))
        if not names:
            return None
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type, tuple(self.size(a) for a in names), mesh_dim_names=names)
        for derived, axes in DERIVED.items():  # each derived mesh of two or more live axes, flattened
            live = tuple(a.value for a in axes if self.size(a) > 1)
            if len(live) > 1:
                mesh[live]._flatten(derived.value)
        return mesh

    def sub_mesh(self, mesh: DeviceMesh | None, *axes: str) -> DeviceMesh | None:
        """The sub-mesh over those of ``axes`` that have size > 1, or None."""
        keep = tuple(str(a) for a in axes if self.size(a) > 1)
        if mesh is None or not keep:
            return None
        return mesh[keep if len(keep) > 1 else keep[0]]

    def fsdp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The mesh ZeRO-3 (FSDP2) shards over: ``dp_shard`` (x ``cp``: :attr:`Mesh.DP_SHARD_CP`), and 2-D
        (dp_replicate, that) whenever dp_replicate > 1, so that parameters are replicated across
        ``dp_replicate`` and sharded within ``dp_shard``, even when ``dp_shard`` is 1 (without that axis FSDP2
        would shard across the replicas instead)."""
        shard = Mesh.DP_SHARD_CP if self.cp > 1 and self.dp_shard > 1 else Axis.CP if self.cp > 1 else Axis.DP_SHARD
        if mesh is not None and self.dp_replicate > 1:
            return mesh[(Axis.DP_REPLICATE.value, shard.value)]
        if shard == Mesh.DP_SHARD_CP:
            return mesh[shard.value]
        return self.sub_mesh(mesh, shard)

    def group(self, mesh: DeviceMesh | None, name: str):
        """Process group of one axis or derived mesh (:class:`Mesh`); None where it has size 1."""
        if mesh is None:
            return None
        if name in DERIVED:
            live = [a for a in DERIVED[Mesh(name)] if self.size(a) > 1]
            if len(live) > 1:
                return mesh[str(name)].get_group()
            return mesh[live[0].value].get_group() if live else None
        return mesh[str(name)].get_group() if self.size(name) > 1 else None


def valid_dp_sizes(cfg: RunConfig, max_dp: int) -> list[int]:
    """Data-parallel sizes up to ``max_dp`` that the fixed global batch allows: d with d x train.micro_batch
    dividing train.global_batch, so the divisors of global_batch / micro_batch (O(sqrt global_batch))."""
    t = cfg.train
    if t.global_batch % t.micro_batch:
        return []
    return [d for d in divisors(t.global_batch // t.micro_batch) if d <= max_dp]


def batch_world_sizes(cfg: RunConfig, max_world: int) -> list[int]:
    """The sizes up to ``max_world`` that the first rules allow, smallest first: multiples of the fixed degree whose
    dp_shard is ``parallel.dp_shard`` (when it is not -1) and whose data-parallel size fits the global batch.

    Every size :func:`valid_world_sizes` returns is one of these, and the batch bounds how many there are: the
    data-parallel size dp_replicate x dp_shard must divide global_batch / micro_batch, so dp_shard is a divisor of
    global_batch / (micro_batch x dp_replicate). Never a loop up to ``max_world``."""
    p, t = cfg.parallel, cfg.train
    fixed = fixed_degree(p.dp_replicate, p.tp, p.pp, p.cp)
    per_shard = p.dp_replicate * t.micro_batch
    if t.global_batch % per_shard:
        return []
    shards = divisors(t.global_batch // per_shard)
    if p.dp_shard != -1:
        shards = [k for k in shards if k == p.dp_shard]
    return [fixed * k for k in shards if fixed * k <= max_world]


def size_refusal(cfg: RunConfig, world: int) -> str | None:
    """Why a group of ``world`` ranks cannot run ``cfg`` (the first rule it breaks, in
    :meth:`ParallelDims.from_config`'s words), or None where it can."""
    try:
        ParallelDims.from_config(cfg, world)
    except ConfigError as e:
        return str(e)
    return None


def valid_world_sizes(cfg: RunConfig, max_world: int) -> list[int]:
    """World sizes a run can be resized to: multiples of dp_replicate x cp x tp x pp that fit the batch (and every
    other rule of :meth:`ParallelDims.from_config`); in O(the batch's divisors), whatever ``max_world``."""
    return [world for world in batch_world_sizes(cfg, max_world) if size_refusal(cfg, world) is None]


def why_no_size(cfg: RunConfig, lo: int, hi: int) -> str:
    """Why no size in [lo, hi] works, for the message that says so: the first refusal of a size the batch allows
    (parallel.cp against data.seq_len, Ulysses against the heads, hpZ against the shard group, ep against
    dp_shard...), or, when the batch allows none in the range, the batch rule itself."""
    for world in batch_world_sizes(cfg, hi):
        if world >= lo:
            refusal = size_refusal(cfg, world)
            if refusal:
                return f"at size {world}, {refusal}"
    t, p = cfg.train, cfg.parallel
    fixed = "" if p.dp_shard == -1 else \
        f" (parallel.dp_shard={p.dp_shard} allows only {fixed_degree(p.dp_replicate, p.tp, p.pp, p.cp) * p.dp_shard})"
    return (f"sizes must be {size_rule(cfg)}{fixed}, whose data-parallel size divides train.global_batch="
            f"{t.global_batch} in train.micro_batch={t.micro_batch} units")


def size_rule(cfg: RunConfig) -> str:
    """:func:`valid_world_sizes`'s first rule in words, for error messages: the degrees that must divide the world."""
    p = cfg.parallel
    ep = f", with dp_shard a multiple of parallel.ep={p.ep} (or parallel.ep=0 to choose it at each size)" \
        if p.ep > 1 else ""
    cp = p.cp > 1
    names = ("dp_replicate", "cp", "tp", "pp") if cp else ("dp_replicate", "tp", "pp")
    here = " x ".join(str(getattr(p, n)) for n in names)
    keys = ", ".join(f"parallel.{n}" for n in names[:-1]) + f" and parallel.{names[-1]}"
    return (f"multiples of {' x '.join(names)} (here {here} = {fixed_degree(p.dp_replicate, p.tp, p.pp, p.cp)}), "
            f"the degrees {keys}{ep}")


def resolve_precision(pcfg: ParallelConfig, device: torch.device) -> torch.dtype:
    """Compute dtype: bf16 on GPUs by default, fp32 on CPU by default."""
    import torch
    if pcfg.mixed_precision in ("bf16", "float8"):  # float8: the linears' matmuls only (trainer.parallel.float8)
        return torch.bfloat16
    if pcfg.mixed_precision == "fp32":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(pcfg: ParallelConfig, local_rank: int) -> torch.device:
    import torch
    want = pcfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError('parallel.device="cuda" but no CUDA device is visible; use "cpu" or "auto"')
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
