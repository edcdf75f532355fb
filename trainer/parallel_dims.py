"""The parallel layout as a value: degrees per mesh axis, the sizes a run may take, the device.

    dims = ParallelDims.from_config(cfg, world_size)     # validates; no process group needed
    mesh = dims.build_mesh("cpu")                        # named axes: pp, dp_replicate, dp_shard, tp
    valid_world_sizes(cfg, max_world=16)                 # what a run can be resized to

World = pp x dp_replicate x dp_shard x tp, with tp innermost (neighbouring
ranks, the fastest links) and pp outermost. ``dp_shard`` is the elastic axis:
tp x pp is fixed for a run; resizing changes how many data-parallel replicas
(or shards) there are, and gradient accumulation keeps the global batch fixed.

Pure arithmetic over the config plus the mesh accessors: it never imports the
model, so the orchestrator sizes a group without loading model code.
:mod:`trainer.parallelize` applies the layout to a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from checkpointing.errors import ConfigError

from .config import ParallelConfig, RunConfig, divisors, fmt_list, or_join

AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each mesh axis; their product is the world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def from_config(cls, cfg: RunConfig, world_size: int) -> ParallelDims:
        """Resolve ``dp_shard = -1`` and check the layout against the world and the batch."""
        p = cfg.parallel
        fixed = p.dp_replicate * p.tp * p.pp
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not a multiple of parallel.dp_replicate={p.dp_replicate} "
                f"x parallel.tp={p.tp} x parallel.pp={p.pp} = {fixed}; "
                f"run on {fmt_list([fixed * k for k in range(1, 5)])} processes or change the layout"
            )
        dp_shard = world_size // fixed if p.dp_shard == -1 else p.dp_shard
        if fixed * dp_shard != world_size:
            raise ConfigError(
                f"parallel.dp_replicate={p.dp_replicate} x dp_shard={dp_shard} x tp={p.tp} x pp={p.pp} "
                f"= {fixed * dp_shard}, but the world size is {world_size}; set parallel.dp_shard=-1 to fill it"
            )
        dims = cls(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp)
        dims.check_batch(cfg)
        dims.check_features(cfg)
        return dims

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis (row-major over AXES)."""
        out = {}
        for axis in reversed(AXES):
            rank, out[axis] = divmod(rank, self.size(axis))
        return out

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def stages(self, rank: int, per_rank: int) -> tuple[int, list[int]]:
        """(pipeline stages in all, the stages ``rank`` runs) with ``per_rank`` stages per pp rank
        (interleaved: pp rank r holds stages r, r + pp, ...)."""
        n_stages = self.pp * per_rank
        if self.pp == 1:
            return n_stages, [0]
        return n_stages, [self.coords(rank)["pp"] + k * self.pp for k in range(per_rank)]

    def local_batch(self, cfg: RunConfig) -> int:
        return cfg.train.global_batch // self.dp

    def pp_microbatches(self, cfg: RunConfig) -> int:
        local = self.local_batch(cfg)
        return cfg.parallel.pp_microbatches or max(1, local // cfg.train.micro_batch)

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
            stages = self.pp * p.pp_stages_per_rank
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
            del stages

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
        if p.offload == "cpu" and self.dp == 1:
            fixed = p.dp_replicate * p.tp * p.pp
            raise ConfigError(
                f'parallel.offload="cpu" offloads what FSDP2 shards across data-parallel ranks, and this layout '
                f"has a data-parallel size of 1 at world size {self.world_size} (tp={self.tp} x pp={self.pp}); "
                f"run on {2 * fixed} processes with parallel.dp_shard=-1, or set parallel.offload=\"none\""
            )

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """A named mesh over the axes of size > 1 (None on a single process), and ``dp_shard`` of size 1
        beside a ``dp_replicate`` > 1 (:func:`fsdp_mesh`: HSDP replicates across it, shards within 1).

        When both data-parallel axes are > 1 the flattened ``dp`` axis is
        created too (for the loss and norm reductions and ZeRO 0/1).
        """
        names = tuple(a for a in AXES if self.size(a) > 1 or (a == "dp_shard" and self.dp_replicate > 1))
        if not names:
            return None
        mesh = init_device_mesh(device_type, tuple(self.size(a) for a in names), mesh_dim_names=names)
        if self.dp_replicate > 1 and self.dp_shard > 1:
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh


def valid_dp_sizes(cfg: RunConfig, max_dp: int) -> list[int]:
    """Data-parallel sizes the fixed global batch allows (micro-batch and pipeline rules)."""
    t = cfg.train
    return [d for d in range(1, max_dp + 1) if t.global_batch % (d * t.micro_batch) == 0]


def valid_world_sizes(cfg: RunConfig, max_world: int) -> list[int]:
    """World sizes a run can be resized to: multiples of dp_replicate x tp x pp that fit the batch."""
    p = cfg.parallel
    fixed = p.dp_replicate * p.tp * p.pp
    out = []
    for world in range(fixed, max_world + 1, fixed):
        if p.dp_shard not in (-1, world // fixed):
            continue
        try:
            ParallelDims.from_config(cfg, world)
        except ConfigError:
            continue
        out.append(world)
    return out


def sub_mesh(mesh: DeviceMesh | None, dims: ParallelDims, *axes: str) -> DeviceMesh | None:
    """The sub-mesh over ``axes`` that have size > 1, or None."""
    keep = tuple(a for a in axes if dims.size(a) > 1)
    if mesh is None or not keep:
        return None
    return mesh[keep if len(keep) > 1 else keep[0]]


def fsdp_mesh(mesh: DeviceMesh | None, dims: ParallelDims) -> DeviceMesh | None:
    """The mesh ZeRO-3 (FSDP2) shards over: 2-D (dp_replicate, dp_shard) whenever dp_replicate > 1, so
    that parameters are replicated across ``dp_replicate`` and sharded within ``dp_shard``, even when
    ``dp_shard`` is 1 (without that axis FSDP2 would shard across the replicas instead)."""
    if mesh is not None and dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return sub_mesh(mesh, dims, "dp_shard")


def axis_group(mesh: DeviceMesh | None, dims: ParallelDims, axis: str):
    """Process group of one axis (or "dp", the flattened data-parallel axis); None if size 1."""
    if mesh is None:
        return None
    if axis == "dp":
        if dims.dp_replicate > 1 and dims.dp_shard > 1:
            return mesh["dp"].get_group()
        if dims.dp_replicate > 1:
            return mesh["dp_replicate"].get_group()
        if dims.dp_shard > 1:
            return mesh["dp_shard"].get_group()
        return None
    return mesh[axis].get_group() if dims.size(axis) > 1 else None


def resolve_precision(pcfg: ParallelConfig, device: torch.device) -> torch.dtype:
    """Compute dtype: bf16 on GPUs by default, fp32 on CPU by default."""
    if pcfg.mixed_precision == "bf16":
        return torch.bfloat16
    if pcfg.mixed_precision == "fp32":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(pcfg: ParallelConfig, local_rank: int) -> torch.device:
    want = pcfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError('parallel.device="cuda" but no CUDA device is visible; use "cpu" or "auto"')
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
