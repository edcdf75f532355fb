"""The ordered steps that parallelize this rank's part of the model.

    dims = ParallelDims.from_config(cfg, world_size)
    mesh = dims.build_mesh("cpu")
    parts = build_model_parts(cfg, dims, mesh, rank, device)   # stages of this rank, parallelized
    loss = lm_loss(parts.modules[0](inputs), targets)

One order for every model family, each step asked of its spec (:mod:`trainer.models`): pipeline
stages are cut from the full model first, keeping parameter names (FQNs); tensor parallelism
next, because it replaces parameters with DTensors sharded over the ``tp`` axis; activation
checkpointing next, because it only marks blocks; data parallelism last, because FSDP2 shards
whatever parameters it finds (the TP DTensors included, as 2-D shards) and must see the final
module tree to group its all-gathers per block. The built-in model goes through all of it on the
meta device; only then does each rank allocate and fill its own shards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .config import ParallelConfig, RunConfig
from .models import spec_for
from .parallel.dims import Axis, ParallelDims, resolve_precision
from .tensor_parallel import grads_as_placed, lm_loss

log = logging.getLogger("etrain")


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


@dataclass
class ModelParts:
    """What this rank runs: one module, or its pipeline stages, and their schedule."""

    modules: list[nn.Module]
    stage_ids: list[int]
    n_stages: int
    pipeline: Pipeline | None
    uses_fsdp: bool
    # How to get logits, and the loss (the model's spec, trainer.models); None: call the module, lm_loss.
    forward_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Parameters held after tensor parallelism, before ZeRO (for the memory prediction); 0 = compute it
    # from the model's shape.
    local_params: int = 0
    # Whether the forward pass draws random numbers (dropout): the step loop seeds it per sample.
    draws_random: bool = True

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
    """Build, parallelize and initialise this rank's part of the model, in the order of the module docstring.

    No rank ever holds more of a stage than its own shards plus one whole tensor being drawn (the built-in
    model, ``Transformer.init_weights``), or than the whole model it builds on the host (a model a user
    brings, unless ``model.init_from`` fills it: then its parameters are built on the meta device). ZeRO 0-2
    shard in the optimizer (:mod:`trainer.zero`), not here; they read each gradient as its parameter's
    local shard, so TP gradients are brought to their parameters' placements (FSDP2 does that itself).
    """
    spec = spec_for(cfg.model)
    p = cfg.parallel
    n_stages, stage_ids = dims.stages(rank, p.pp_stages_per_rank)
    tp_mesh, dtype = dims.sub_mesh(mesh, Axis.TP), resolve_precision(p, device)
    use_fsdp = dims.uses_fsdp
    modules, local = [], 0
    for s in stage_ids:
        stage = spec.build_stage(cfg, s, n_stages if dims.pp > 1 else 1, device)
        model = stage.module
        if tp_mesh is not None:
            spec.apply_tp(model, tp_mesh, p)
        local += spec.local_params(model)
        spec.apply_ac(stage, p.activation_checkpoint, p.ac_every_k)
        if use_fsdp:
            shard_blocks(model, stage.blocks, dims.fsdp_mesh(mesh), p, device, pipelined=dims.pp > 1)
        # FSDP's CPU offload keeps the sharded parameters in host memory.
        spec.materialize(stage, "cpu" if use_fsdp and p.offload == "cpu" else device, cfg.train.seed)
        if not use_fsdp:
            if dtype != torch.float32:
                spec.cast(model, dtype)
            if tp_mesh is not None:
                grads_as_placed(model)  # after the cast, which replaces DTensor parameters
        modules.append(model)
    pipeline = None
    if dims.pp > 1:
        pipeline = Pipeline(modules, stage_ids, n_stages, device, dims.group(mesh, Axis.PP),
                            p.pp_schedule, dims.pp_microbatches(cfg))
    return ModelParts(modules, stage_ids, n_stages, pipeline, use_fsdp, forward_fn=spec.forward_fn(),
                      loss_fn=spec.loss_fn(), local_params=local, draws_random=spec.draws_random)


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
