"""The parallel layout as a value, and the ordered steps that apply it.

    dims = ParallelDims.from_config(cfg, world_size)     # validates; no process group needed
    mesh = dims.build_mesh("cpu")                        # named axes: pp, dp_replicate, dp_shard, tp
    parts = build_model_parts(cfg, dims, mesh, device)   # stages of this rank, parallelized

World = pp x dp_replicate x dp_shard x tp, with tp innermost (neighbouring
ranks, the fastest links) and pp outermost. ``dp_shard`` is the elastic axis:
tp x pp is fixed for a run; resizing changes how many data-parallel replicas
(or shards) there are, and gradient accumulation keeps the global batch fixed.

The order of ``parallelize``: tensor parallelism first, because it replaces
parameters with DTensors sharded over the ``tp`` axis; activation
checkpointing next, because it only marks blocks; data parallelism last,
because FSDP2 shards whatever parameters it finds (the TP DTensors included,
as 2-D shards) and must see the final module tree to group its all-gathers
per block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from checkpointing.errors import ConfigError

from .config import ParallelConfig, RunConfig, _divisors, _fmt_list
from .model import Transformer, cut_stage

log = logging.getLogger("etrain")

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
                f"run on {_fmt_list([fixed * k for k in range(1, 5)])} processes or change the layout"
            )
        dp_shard = world_size // fixed if p.dp_shard == -1 else p.dp_shard
        if fixed * dp_shard != world_size:
            raise ConfigError(
                f"parallel.dp_replicate={p.dp_replicate} x dp_shard={dp_shard} x tp={p.tp} x pp={p.pp} "
                f"= {fixed * dp_shard}, but the world size is {world_size}; set parallel.dp_shard=-1 to fill it"
            )
        dims = cls(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, tp=p.tp)
        dims.check_batch(cfg)
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
                f"x train.micro_batch={t.micro_batch}; data-parallel sizes that work: {_fmt_list(good)} "
                f"(or change train.global_batch / train.micro_batch)"
            )
        if self.pp > 1:
            local, n_mb = self.local_batch(cfg), self.pp_microbatches(cfg)
            stages = self.pp * p.pp_stages_per_rank
            if local % n_mb:
                raise ConfigError(
                    f"parallel.pp_microbatches={n_mb} does not divide the local batch {local} "
                    f"(train.global_batch / data-parallel size); use one of {_fmt_list(_divisors(local))}"
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

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """A named mesh over the axes of size > 1 (None on a single process).

        When both data-parallel axes are > 1 the flattened ``dp`` axis is
        created too (for the loss and norm reductions and ZeRO 0/1).
        """
        names = tuple(a for a in AXES if self.size(a) > 1)
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


# --- the ordered apply -------------------------------------------------------


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism with DTensor plans.

    Attention q/k/v and the SwiGLU gate/up projections are column-wise (each
    rank owns whole heads / hidden units); the output projections are
    row-wise, so each block needs one all-reduce in forward and one in
    backward. The embedding is sharded by vocabulary rows, the output head by
    vocabulary columns with its logits gathered. Norms stay replicated.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if plan:
        parallelize_module(model, tp_mesh, plan)
    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


def apply_ac(model: Transformer, mode: str, every_k: int) -> None:
    """Activation checkpointing: recompute every block, or every k-th, in backward."""
    for i, (name, block) in enumerate(model.layers.items()):
        if mode == "full":
            block.checkpoint_activations = True
        elif mode == "every_k":
            block.checkpoint_activations = int(name) % every_k == 0


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, pcfg: ParallelConfig, device: torch.device, pipelined: bool):
    """ZeRO-3: FSDP2 ``fully_shard`` per block, then the root (embedding, norm, head).

    A 2-D ``dp_mesh`` (dp_replicate, dp_shard) gives HSDP: sharded within
    dp_shard, replicated across dp_replicate. Under pipeline parallelism the
    parameters stay unsharded between forward and backward, since every
    micro-batch would otherwise all-gather them again.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if resolve_precision(pcfg, device) == torch.bfloat16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload: OffloadPolicy = OffloadPolicy()
    if pcfg.offload == "cpu":
        if device.type == "cpu":
            log.warning('parallel.offload="cpu" has no effect when training on the CPU')
        else:
            offload = CPUOffloadPolicy()
    reshard = not pipelined
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard and i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)


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


@dataclass
class ModelParts:
    """What this rank runs: one module, or its pipeline stages, and their schedule."""

    modules: list[Transformer]
    stage_ids: list[int]
    n_stages: int
    pipeline: Pipeline | None
    uses_fsdp: bool

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def train(self, mode: bool = True) -> None:
        for m in self.modules:
            m.train(mode)


def build_model_parts(cfg: RunConfig, dims: ParallelDims, mesh: DeviceMesh | None, rank: int,
                      device: torch.device) -> ModelParts:
    """Build, initialise and parallelize this rank's part of the model.

    Weights are initialised on the host from (seed, FQN) before any sharding,
    so the result is the same for every layout.
    """
    p = cfg.parallel
    coords = dims.coords(rank)
    n_stages = dims.pp * p.pp_stages_per_rank
    stage_ids = [coords["pp"] + k * dims.pp for k in range(p.pp_stages_per_rank)] if dims.pp > 1 else [0]
    dtype = resolve_precision(p, device)
    use_fsdp = p.zero_stage == 3 and dims.dp > 1
    if p.zero_stage > 0 and dims.dp == 1:
        log.warning("parallel.zero_stage=%d has no effect with a data-parallel size of 1", p.zero_stage)
    tp_mesh = sub_mesh(mesh, dims, "tp")
    modules = []
    for s in stage_ids:
        with torch.device("meta"):
            m = Transformer(cfg.model)
        if dims.pp > 1:
            cut_stage(m, s, n_stages)
        m.to_empty(device="cpu")
        m.init_weights(cfg.train.seed)
        m.to(device)
        if tp_mesh is not None:
            apply_tp(m, tp_mesh)
        apply_ac(m, p.activation_checkpoint, p.ac_every_k)
        if use_fsdp:
            apply_fsdp(m, sub_mesh(mesh, dims, "dp_replicate", "dp_shard"), p, device, pipelined=dims.pp > 1)
        elif dtype != torch.float32:
            m.to(dtype)
        m.rope = m.rope.float()
        modules.append(m)
    pipeline = None
    if dims.pp > 1:
        pipeline = Pipeline(modules, stage_ids, n_stages, device, axis_group(mesh, dims, "pp"),
                            p.pp_schedule, dims.pp_microbatches(cfg))
    return ModelParts(modules, stage_ids, n_stages, pipeline, use_fsdp)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Pipeline:
    """A ``torch.distributed.pipelining`` schedule over this rank's stages.

    Each micro-batch's loss is divided by the micro-batch count (and the
    schedule's own gradient scaling is off), so gradients are the mean over
    the local batch, as without pipelining.
    """

    def __init__(self, modules, stage_ids, n_stages, device, group, schedule: str, n_microbatches: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.n_microbatches = n_microbatches
        self.has_first = 0 in stage_ids
        self.has_last = n_stages - 1 in stage_ids
        stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(modules, stage_ids)]
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[schedule]
        first = stages if schedule == "interleaved_1f1b" else stages[0]
        self.schedule = cls(first, n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets) / self.n_microbatches

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward over the local batch; the summed loss on the last stage."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        self.schedule.step(*args, target=targets if self.has_last else None, losses=losses)
        if not self.has_last:
            return None
        return torch.stack([x.detach().float() for x in losses]).sum()
