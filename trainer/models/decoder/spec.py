"""The built-in Llama-style decoder as a model family (``[model] source = "builtin"``).

    spec = DecoderSpec(cfg.model)
    spec.shape()                 # its sizes, from the config alone (nothing built)

Built on the meta device and parallelized there; each rank then allocates only its own shards and
fills them from whole tensors drawn from (seed, FQN) (:meth:`Transformer.init_weights`), so every
layout starts from the same weights. Pipeline stages keep their blocks' names (``layers.5``);
activation checkpointing is a flag on the block; its tensor-parallel plan, with sequence and loss
parallelism, is :mod:`.decoder_tp`; its transformers names are ``LlamaForCausalLM``'s
(:mod:`.llama_names`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...config import ParallelConfig, RunConfig
from ..documents import masked_layouts
from ..moe import MoE, moe_layers
from ..names.llama import LlamaNames
from ..names.mixtral import MixtralNames
from ..names.qwen_moe import hf_moe_names
from ..shape import ModelShape
from ..spec import ModelSpec, Stage, to_empty, zero_parameters
from .model import Transformer, cut_stage, initial_weight


class DecoderSpec(ModelSpec):
    family = "builtin"
    cached = True  # a Mixture of Experts is counted on the meta device: once per config (trainer.models.spec_for)
    _moe_shape: ModelShape | None = None

    def shape(self) -> ModelShape:
        shape = ModelShape.of(self.mcfg)
        if not self.mcfg.is_moe:
            return shape
        if self._moe_shape is None:
            self._moe_shape = self._count_moe(shape)
        return self._moe_shape

    def _count_moe(self, shape: ModelShape) -> ModelShape:
        # Experts make blocks differ: the counts of the model built on the meta device win over the formulas.
        model = self.build()
        params = list(model.parameters())
        block = max(sum(p.numel() for p in b.parameters()) for b in model.layers.values())
        m = self.mcfg
        return dataclasses.replace(shape, name=f"built-in MoE decoder ({m.n_experts} experts, "
                                   f"top {m.top_k})", counted="meta device",
                                   params=sum(p.numel() for p in params), block=block,
                                   weights=sum(p.numel() for p in params if p.ndim >= 2),
                                   experts=sum(p.numel() for n, p in model.named_parameters() if ".experts." in n),
                                   expert_share=m.top_k / m.n_experts,
                                   moe_layers=sum(1 for i in range(m.n_layers) if m.is_moe_layer(i)),
                                   moe_ffn=max(sum(p.numel() for p in moe.parameters()) for moe in moe_layers(model)),
                                   moe_every=m.moe_every)

    @property
    def draws_random(self) -> bool:
        return self.mcfg.dropout > 0

    @property
    def compile_fullgraph(self) -> bool:
        return True

    def build(self, device: str | torch.device = "meta", seed: int = 0) -> Transformer:
        with torch.device(device):
            model = Transformer(self.mcfg)
        if torch.device(device).type != "meta":
            model.init_weights(seed)
        return model

    def build_stage(self, cfg: RunConfig, stage: int, n_stages: int, device: torch.device) -> Stage:
        with torch.device("meta"):
            model = Transformer(self.mcfg)
        if n_stages > 1:
            cut_stage(model, stage, n_stages)
        return Stage(model, list(model.layers.values()), params_on_meta=True)

    def apply_tp(self, module: nn.Module, tp_mesh, pcfg: ParallelConfig) -> None:
        from .tp import apply_tp

        apply_tp(module, tp_mesh, sequence_parallel=pcfg.sequence_parallel, loss_parallel=pcfg.loss_parallel)

    def allows(self) -> tuple[str, ...]:
        return masked_layouts(self.mcfg, ("tp", "pp", "sp", "cp"))

    def document_mask_refusal(self, seq_len: int) -> str | None:
        return None

    def apply_document_mask(self, module: nn.Module, eos_id: int) -> None:
        """Every block's attention causal and within each document: a boolean mask given to SDPA, found from
        the token ids in the forward (:class:`Transformer`)."""
        module.document_eos = eos_id

    def apply_cp(self, module: nn.Module, cp) -> None:
        """Every block's attention over the cp group; rotary positions the global ones; a Mixture of Experts'
        routing counts over the cp group (trainer.models.moe)."""
        module.cp = cp
        for block in module.layers.values():
            block.attention.cp = cp
            if isinstance(block.feed_forward, MoE):
                block.feed_forward.cp_group = cp.group

    def apply_ac(self, stage: Stage, mode: str, every_k: int) -> None:
        """Recompute every block in backward, or every k-th (by its index in the whole model), or in every
        block all but the matmuls ("selective")."""
        for name, block in stage.module.layers.items():
            if mode in ("full", "selective"):
                block.checkpoint_activations = True
                block.checkpoint_selective = mode == "selective"
            elif mode == "every_k":
                block.checkpoint_activations = int(name) % every_k == 0

    def materialize(self, stage: Stage, device: str | torch.device, seed: int, draw: bool = True) -> None:
        to_empty(stage.module, device)
        if draw:
            stage.module.init_weights(seed)
            return
        stage.module.init_buffers()
        zero_parameters(stage.module)

    @property
    def draws_weights(self) -> bool:
        return True

    def initial_weight(self, fqn: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        return initial_weight(self.mcfg, fqn, shape, seed)

    def cast(self, module: nn.Module, dtype: torch.dtype) -> None:
        module.to(dtype)
        module.rope = module.rope.float()  # rotary tables stay fp32

    def inference_model(self, state: dict[str, torch.Tensor]) -> tuple[nn.Module, int]:
        model = Transformer(self.mcfg)
        model.load_state_dict(state)
        return model, self.mcfg.max_seq_len

    def hf_names(self) -> LlamaNames | MixtralNames:
        # A Mixture of Experts exports as Mixtral where Mixtral holds it, else as Qwen2-MoE
        # (trainer.models.names.qwen_moe); the dense decoder as Llama.
        return hf_moe_names(self.mcfg) if self.mcfg.is_moe else LlamaNames(self.mcfg)

