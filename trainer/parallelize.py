"""The ordered steps that parallelize this rank's part of the model.

    dims = ParallelDims.from_config(cfg, world_size)
    mesh = dims.build_mesh("cpu")
    parts = build_model_parts(cfg, dims, mesh, rank, device)   # stages of this rank, parallelized
    loss = lm_loss(parts.modules[0](inputs), targets)

The order of :func:`parallelize`: tensor parallelism first, because it replaces
parameters with DTensors sharded over the ``tp`` axis; activation
checkpointing next, because it only marks blocks; data parallelism last,
because FSDP2 shards whatever parameters it finds (the TP DTensors included,
as 2-D shards) and must see the final module tree to group its all-gathers
per block. Pipeline stages are cut from the full model before any of it,
keeping parameter names (FQNs). All of it happens on the meta device; only then
does each rank allocate and fill its own shards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .config import ParallelConfig, RunConfig
from .model import Transformer, cut_stage
from .parallel_dims import ParallelDims, axis_group, fsdp_mesh, resolve_precision, sub_mesh
from .tensor_parallel import apply_tp, grads_as_placed, lm_loss

log = logging.getLogger("etrain")


def apply_ac(model: Transformer, mode: str, every_k: int) -> None:
    """Activation checkpointing: recompute every block, or every k-th, in backward."""
    for i, (name, block) in enumerate(model.layers.items()):
        if mode == "full":
            block.checkpoint_activations = True
        elif mode == "every_k":
            block.checkpoint_activations = int(name) % every_k == 0


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, pcfg: ParallelConfig, device: torch.device, pipelined: bool):
    """ZeRO-3 of the built-in decoder: :func:`shard_blocks` over its ``layers``."""
    shard_blocks(model, list(model.layers.values()), dp_mesh, pcfg, device, pipelined)


def shard_blocks(model: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, pcfg: ParallelConfig,
                 device: torch.device, pipelined: bool) -> None:
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
        # On a CPU device the "host" copies are the same memory, but FSDP2 runs its offload path all the
        # same (copies in and out around each use), so the path is exercised without a GPU.
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    reshard = not pipelined
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard and i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)


def parallelize(model: Transformer, pcfg: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh | None,
                device: torch.device, *, use_fsdp: bool, seed: int) -> None:
    """Apply the layout to one stage built on the meta device, in place: TP, then AC, then FSDP
    (ZeRO-3); then allocate and initialise only this rank's shards; then the compute dtype (ZeRO 0-2).

    The order matters (module docstring): TP turns parameters into DTensors, AC only marks blocks,
    and FSDP2 must see the final module tree and the TP-sharded parameters. No rank ever holds more
    of the stage than its own shards plus one whole tensor being drawn (``Transformer.init_weights``).
    ZeRO 0-2 shard in the optimizer (:mod:`trainer.optim`), not here; they read each gradient as its
    parameter's local shard, so TP gradients are brought to their parameters' placements (FSDP2 does
    that itself). Rotary tables stay fp32 in every case.
    """
    tp_mesh, dtype = sub_mesh(mesh, dims, "tp"), resolve_precision(pcfg, device)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=pcfg.sequence_parallel, loss_parallel=pcfg.loss_parallel)
    apply_ac(model, pcfg.activation_checkpoint, pcfg.ac_every_k)
    if use_fsdp:
        apply_fsdp(model, fsdp_mesh(mesh, dims), pcfg, device, pipelined=dims.pp > 1)
    # FSDP's CPU offload keeps the sharded parameters in host memory.
    model.to_empty(device="cpu" if use_fsdp and pcfg.offload == "cpu" else device)
    model.init_weights(seed)
    if not use_fsdp:
        if dtype != torch.float32:
            model.to(dtype)
        if tp_mesh is not None:
            grads_as_placed(model)  # after the cast, which replaces DTensor parameters
    model.rope = model.rope.float()


@dataclass
class ModelParts:
    """What this rank runs: one module, or its pipeline stages, and their schedule."""

    modules: list[nn.Module]
    stage_ids: list[int]
    n_stages: int
    pipeline: Pipeline | None
    uses_fsdp: bool
    # Models of other sources (trainer.models): how to get logits, and the loss; None = the built-in's.
    forward_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Parameters held after tensor parallelism, before ZeRO (for the memory prediction); 0 = compute it
    # from the built-in model's sizes.
    local_params: int = 0

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits of the (whole, unpipelined) model for token ids ``inputs``."""
        if self.forward_fn is not None:
            return self.forward_fn(self.modules[0], inputs)
        return self.modules[0](inputs)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of one micro-batch (mean over its tokens)."""
        return (self.loss_fn or lm_loss)(logits, targets)

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def train(self, mode: bool = True) -> None:
        for m in self.modules:
            m.train(mode)


def build_model_parts(cfg: RunConfig, dims: ParallelDims, mesh: DeviceMesh | None, rank: int,
                      device: torch.device) -> ModelParts:
    """Build, parallelize and initialise this rank's part of the model.

    The built-in model is built on the meta device and parallelized there; only this rank's shards
    are then allocated, each filled from its whole tensor drawn from (seed, FQN), so the result is
    the same for every layout.
    """
    if cfg.model.source != "builtin":
        return build_custom_parts(cfg, dims, mesh, rank, device)
    p = cfg.parallel
    n_stages, stage_ids = dims.stages(rank, p.pp_stages_per_rank)
    use_fsdp = p.zero_stage == 3 and dims.dp > 1
    modules = []
    for s in stage_ids:
        with torch.device("meta"):
            m = Transformer(cfg.model)
        if dims.pp > 1:
            cut_stage(m, s, n_stages)
        parallelize(m, p, dims, mesh, device, use_fsdp=use_fsdp, seed=cfg.train.seed)
        modules.append(m)
    pipeline = None
    if dims.pp > 1:
        pipeline = Pipeline(modules, stage_ids, n_stages, device, axis_group(mesh, dims, "pp"),
                            p.pp_schedule, dims.pp_microbatches(cfg))
    return ModelParts(modules, stage_ids, n_stages, pipeline, use_fsdp)


def build_custom_parts(cfg: RunConfig, dims: ParallelDims, mesh: DeviceMesh | None, rank: int,
                       device: torch.device) -> ModelParts:
    """A hf/python model (:mod:`trainer.models`): built whole on the host from the seed, cut to this rank's
    pipeline stages, then TP from its plan, activation checkpointing and FSDP per block, or the compute
    dtype for ZeRO 0-2. With ``model.init_from`` its weights are loaded later, so its parameters are
    built on the meta device and only this rank's shards are allocated, once parallelized."""
    from . import models

    p = cfg.parallel
    n_stages, stage_ids = dims.stages(rank, p.pp_stages_per_rank)
    tp_mesh, dtype = sub_mesh(mesh, dims, "tp"), resolve_precision(p, device)
    use_fsdp = p.zero_stage == 3 and dims.dp > 1
    on_meta = bool(cfg.model.init_from)  # init_from (or a checkpoint on resume) fills every weight
    modules, local = [], 0
    for s in stage_ids:
        model = models.build_model(cfg, "cpu", params_on_meta=on_meta)
        if on_meta and models.shares_parameters(model):  # tied weights: built whole, as without init_from
            on_meta, model = False, models.build_model(cfg, "cpu")
        named = models.find_blocks(model, cfg.model)
        blocks = [m for _, m in named]
        if dims.pp > 1:
            keep = models.stage_ranges([n for n, _ in named], n_stages, cfg.model.pp_split_points)[s]
            blocks = models.cut_hf_stage(model, keep, first=s == 0, last=s == n_stages - 1)
        if not on_meta:
            model.to(device)
        if tp_mesh is not None:
            models.apply_tp_plan(model, cfg, tp_mesh)
        local += models.local_param_count(model)
        models.apply_block_ac(blocks, p.activation_checkpoint, p.ac_every_k)
        if use_fsdp:
            shard_blocks(model, blocks, fsdp_mesh(mesh, dims), p, device,
                         pipelined=dims.pp > 1)
        if on_meta:
            models.materialize(model, "cpu" if use_fsdp and p.offload == "cpu" else device)
        if not use_fsdp:
            if dtype != torch.float32:
                models.cast_parameters(model, dtype)
            if tp_mesh is not None:
                grads_as_placed(model)  # ZeRO 0-2 read gradients as the parameters' local shards
        modules.append(model)
    pipeline = None
    if dims.pp > 1:
        pipeline = Pipeline(modules, stage_ids, n_stages, device, axis_group(mesh, dims, "pp"),
                            p.pp_schedule, dims.pp_microbatches(cfg))
    loss_fn = models.resolve_ref(cfg.model.loss, "model.loss") if cfg.model.loss else None
    forward = models.hf_forward if cfg.model.source == "hf" else models.plain_forward
    return ModelParts(modules, stage_ids, n_stages, pipeline, use_fsdp, forward_fn=forward, loss_fn=loss_fn,
                      local_params=local)


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

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, backward: bool = True) -> torch.Tensor | None:
        """Forward and backward (or, with ``backward=False``, forward only) over the local batch; the
        summed loss on the last stage."""
        losses: list[torch.Tensor] = []
        # Contiguous: torch 2.11's stages check the input's strides against the ones they inferred
        # (the tokens are a view of rows one token longer).
        args = (inputs.contiguous(),) if self.has_first else ()
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, target=targets if self.has_last else None, losses=losses)
        if not self.has_last:
            return None
        return torch.stack([x.detach().float() for x in losses]).sum()
