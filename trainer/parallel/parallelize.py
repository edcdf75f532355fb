"""The one ordered parallelize: every step over this rank's part of the model, in one order for every
model family, each step asked of the model's spec (:mod:`trainer.models`).

    dims = ParallelDims.from_config(cfg, world_size)
    mesh = dims.build_mesh("cpu")
    parts = build_model_parts(cfg, dims, mesh, rank, device)   # stages of this rank, parallelized
    loss = lm_loss(parts.modules[0](inputs), targets)

The order, and why it matters:

1. Pipeline cut (:mod:`.pipeline`) first: stages are cut from the full model, keeping parameter
   names (FQNs), so that every later step sees only this rank's stages. Float8 linears
   (:mod:`.float8`, ``mixed_precision="float8"``) replace the plain ones right after, so that every
   later step wraps the modules that will run. The end-of-document id of ``model.document_mask``
   (trainer.models.documents) is handed to each stage as it is cut: an attribute its forward reads.
2. Tensor parallelism (:mod:`.tensor`) next, because it replaces parameters with DTensors sharded
   over the ``tp`` axis, and every later step must see those.
3. Context parallelism (:mod:`.context`): it routes attention through the cp group (activations are
   split along the sequence; parameters are untouched), after TP has placed the parameters and before
   anything wraps the blocks, so activation checkpointing recomputes the routed attention and FSDP sees
   the modules as routed.
4. Expert parallelism (:mod:`.expert`): it gives every MoE layer its ep group (experts split over
   ``ep`` ranks carved from ``dp_shard``, tokens dispatched by all-to-all) and makes the expert weights
   DTensors split over ``ep``, before activation checkpointing recomputes the routed layers and FSDP
   shards the expert weights over the data-parallel ranks outside ep (their own units, wrapped first, at
   every ZeRO stage: under ZeRO 0-2 the other parameters are the stage's, trainer.zero.hybrid).
5. Activation checkpointing (:mod:`.ac`), because it only marks blocks, which FSDP then wraps
   as they are.
6. ``torch.compile`` per block (:mod:`.compile`), after TP and AC so that the graph holds the sharded
   computation and the recomputation, and before FSDP, whose hooks stay outside the compiled graph
   (torchtitan's order).
7. FSDP (:mod:`.fsdp`) last, because FSDP2 shards whatever parameters it finds (the TP DTensors
   included, as 2-D shards) and must see the final module tree to group its all-gathers per block.

The built-in model goes through all of it on the meta device; only then does each rank allocate and
fill its own shards.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .. import compat
from ..config import RunConfig
from ..data.sources import resolve_format
from ..data.tokenize import load_tokenizer
from ..models import spec_for
from ..models.documents import document_eos_id
from ..models.moe import aux_loss, keep_counters, moe_layers
from .ac import apply_ac
from .compile import apply_compile, check_compile
from .context import ContextParallel, apply_cp
from .dims import Axis, ParallelDims, resolve_precision
from .expert import apply_ep, expert_meshes, shard_experts
from .float8 import apply_float8, check_float8
from .fsdp import fsdp_policies, shard_blocks
from .pipeline import Pipeline, cut_stage
from .tensor import apply_tp, grads_as_placed, lm_loss

log = logging.getLogger("etrain")


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
    # A model's own Mixture of Experts (a transformers MoE): its weighted balancing loss after a forward.
    aux_fn: Callable[[nn.Module], torch.Tensor | None] | None = None
    # Parameters held after tensor parallelism, before ZeRO (for the memory prediction); 0 = compute it
    # from the model's shape.
    local_params: int = 0
    # Whether the forward pass draws random numbers (dropout): the step loop seeds it per sample.
    draws_random: bool = True
    # Context parallelism (.context): this rank's positions of every sample, in and out; None at cp 1.
    cp: ContextParallel | None = None
    _moe: list | None = None  # the Mixture-of-Experts layers of modules[0] (aux_loss)
    # The built-in Mixture of Experts, whether or not this rank's pipeline stages hold MoE layers (every rank
    # takes part in its reductions).
    moe_model: bool = False
    # Expert parallelism under ZeRO 0-2: the experts' own FSDP units (their optimizer is FSDP's,
    # trainer.zero.hybrid; the other parameters are the ZeRO stage's). Empty otherwise.
    expert_units: list[nn.Module] = field(default_factory=list)
    # Built without drawing the initial weights (build_model_parts(draw=False), a model that draws them): a
    # parameter's whole initial value by (FQN, shape), None where the model draws none. None: nothing undrawn.
    undrawn: Callable[[str, tuple[int, ...]], torch.Tensor | None] | None = None

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits of the (whole, unpipelined) model for token ids ``inputs`` (of this rank's positions
        under context parallelism)."""
        if self.cp is not None:
            inputs = self.cp.shard(inputs)
        if self.forward_fn is not None:
            return self.forward_fn(self.modules[0], inputs)
        return self.modules[0](inputs)

    def pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, *, backward: bool = True):
        """One pass of the pipeline schedule over a rank's batch (:meth:`Pipeline.step`), of this rank's
        positions under context parallelism."""
        if self.cp is not None:
            inputs, targets = self.cp.shard(inputs), self.cp.shard(targets)
        return self.pipeline.step(inputs, targets, backward=backward)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of one micro-batch (mean over its tokens: this rank's positions under context
        parallelism, whose equal shares average to the whole sequence's over the cp ranks)."""
        if self.cp is not None:
            targets = self.cp.shard(targets)
        loss = (self.loss_fn or lm_loss)(logits, targets)
        aux = self.aux_loss()
        return loss if aux is None else loss + aux

    @property
    def is_moe(self) -> bool:
        """Whether the model is a Mixture of Experts (built-in layers, or a model's own with a balancing loss)."""
        if self._moe is None:
            self._moe = moe_layers(self.modules[0]) if self.modules else []
        return self.moe_model or self.aux_fn is not None or bool(self._moe)

    def aux_loss(self) -> torch.Tensor | None:
        """Mixture of Experts: the load-balancing loss of the last forward (None for a dense model)."""
        if self.aux_fn is not None:
            return self.aux_fn(self.modules[0])
        if self._moe is None:  # found once: the loss asks every micro-batch
            self._moe = moe_layers(self.modules[0]) if self.modules else []
        return aux_loss(self._moe) if self._moe else None

    def pipeline_aux(self) -> torch.Tensor | None:
        """Pipelined Mixture of Experts: the aux losses this rank's stages trained in the last step (each
        micro-batch's scaled as its loss is; trainer.models.moe.AuxLossToBackward; 0 without MoE layers), the
        counters cleared; None for a dense model."""
        if not self.moe_model:
            return None
        layers = [m for module in self.modules for m in moe_layers(module)]
        total = sum((torch.as_tensor(m.aux_trained, dtype=torch.float32) for m in layers), torch.zeros(()))
        for m in layers:
            m.aux_trained = 0.0
        return total

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def train(self, mode: bool = True) -> None:
        for m in self.modules:
            m.train(mode)


def check_device_features(pcfg, device: torch.device) -> None:
    """ConfigError (exit 2) for what ``device`` cannot do: ``parallel.compile`` without a compiler for it,
    ``mixed_precision="float8"`` without float8 hardware or a working torchao."""
    check_compile(pcfg, device)
    check_float8(pcfg, device)
    if (pcfg.quantized_weights or pcfg.quantized_gradients) and pcfg.zero_stage == 3:
        compat.require_fsdp_comm_bases()  # ConfigError where this torch's FSDP2 has no custom collectives


def build_model_parts(cfg: RunConfig, dims: ParallelDims, mesh: DeviceMesh | None, rank: int,
                      device: torch.device, *, draw: bool = True) -> ModelParts:
    """Build, parallelize and initialise this rank's part of the model, in the order of the module docstring.

    No rank ever holds more of a stage than its own shards plus one whole tensor being drawn (the built-in
    model, ``Transformer.init_weights``), or than the whole model it builds on the host (a model a user
    brings, unless ``model.init_from`` fills it: then its parameters are built on the meta device). ZeRO 0-2
    shard in the optimizer (:mod:`trainer.zero`), not here; they read each gradient as its parameter's
    local shard, so TP gradients are brought to their parameters' placements (FSDP2 does that itself).
    ``draw=False``: the initial weights are not drawn (a checkpoint's are about to be loaded over them);
    ``ModelParts.undrawn`` draws them if none is (``Trainer.initial_weights``).
    """
    spec = spec_for(cfg.model)
    p = cfg.parallel
    n_stages, stage_ids = dims.stages(rank, p.pp_stages_per_rank)
    tp_mesh, dtype = dims.sub_mesh(mesh, Axis.TP), resolve_precision(p, device)
    use_fsdp = dims.uses_fsdp
    check_device_features(p, device)
    modules, local, cp, expert_units = [], 0, None, []
    experts_at = expert_meshes(dims, mesh)  # collective: once, whatever this rank's stages hold
    eos = document_eos_id(cfg, load_tokenizer, resolve_format)  # model.document_mask: the data's end of document
    for s in stage_ids:
        stage = cut_stage(spec, cfg, s, n_stages, dims, device)
        model = stage.module
        if eos is not None:  # an attribute the forward reads: before anything wraps the model
            spec.apply_document_mask(model, eos)
        apply_float8(spec, model, p, use_fsdp)
        apply_tp(spec, model, tp_mesh, p)
        local += spec.local_params(model)
        cp = apply_cp(spec, model, dims, mesh, rank, p)
        layers = spec.expert_layers(model)
        emesh = apply_ep(layers, dims, experts_at)
        apply_ac(spec, stage, p)
        apply_compile(spec, stage, p)
        if emesh is not None:  # the experts' own FSDP units, at every ZeRO stage; first: the blocks' leave them out
            shard_experts(layers, dims, emesh, dims.pp == 1, **fsdp_policies(p, device))
            if not use_fsdp:
                expert_units += [moe.experts for moe in layers]
        if use_fsdp:
            shard_blocks(model, stage.blocks, dims.fsdp_mesh(mesh), p, device, pipelined=dims.pp > 1)
        # FSDP's CPU offload keeps the sharded parameters in host memory.
        spec.materialize(stage, "cpu" if use_fsdp and p.offload == "cpu" else device, cfg.train.seed, draw=draw)
        if not use_fsdp:
            if dtype != torch.float32:
                spec.cast(model, dtype)
                for unit in expert_units:  # FSDP's own units keep fp32 shards and compute in dtype (its policy)
                    unit.float()
            if tp_mesh is not None:
                grads_as_placed(model)  # after the cast, which replaces DTensor parameters
        modules.append(model)
    pipeline = None
    if dims.pp > 1:
        moe = [m for module in modules for m in moe_layers(module)]
        pipeline = Pipeline(modules, stage_ids, n_stages, device, dims.group(mesh, Axis.PP), p.pp_schedule,
                            dims.pp_microbatches(cfg), keep_state=(lambda: keep_counters(moe)) if moe else None)
        for layer in moe:  # the aux loss reaches backward itself, scaled as each micro-batch's loss
            layer.aux_scale = 1.0 / pipeline.n_microbatches
    return ModelParts(modules, stage_ids, n_stages, pipeline, use_fsdp, forward_fn=spec.forward_fn(),
                      loss_fn=spec.loss_fn(), aux_fn=spec.aux_loss_fn(), local_params=local,
                      draws_random=spec.draws_random, cp=cp, expert_units=expert_units, moe_model=cfg.model.is_moe,
                      undrawn=functools.partial(spec.initial_weight, seed=cfg.train.seed)
                      if not draw and spec.draws_weights else None)
