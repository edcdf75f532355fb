"""The built-in Mixture of Experts as ``transformers``' ``Qwen2MoeForCausalLM``, where Mixtral cannot hold it.

    names = hf_moe_names(mcfg)   # MixtralNames when Mixtral holds the model, else QwenMoeNames
    names.added()                # {hf name: shape}: tensors Qwen2-MoE has and the built-in model not (zeros)

Qwen2-MoE holds what Mixtral does not: dense blocks between MoE ones (``decoder_sparse_step = moe_every``:
block ``i`` is sparse when ``(i + 1) % moe_every == 0``, as ``ModelConfig.is_moe_layer`` says) and a shared
expert (``shared_expert_intermediate_size = n_shared_experts x ffn_hidden``). The mapping is Mixtral's
(:mod:`.mixtral_names`: router, fused ``gate_up_proj``, ``down_proj``; attention and norms as Llama's) plus:
a dense block's ``feed_forward.w1/w2/w3`` -> ``mlp.gate_proj/down_proj/up_proj``; the shared SwiGLU's ->
``mlp.shared_expert.*``. Qwen2-MoE adds what the built-in model does not have, exported as zeros: q/k/v
biases, and ``mlp.shared_expert_gate`` (``sigmoid(gate(x)) * shared_expert(x)``: a zero gate weighs the
shared expert by 0.5, so its ``down_proj`` is written doubled, exactly, and halved when read back; without
shared experts the shared expert has no rows). ``norm_topk_prob`` renormalizes the chosen experts' scores as
the built-in router does, so the logits match. Routing biases (``router_bias_update_rate > 0``) are
refused, as for Mixtral.
"""

from __future__ import annotations

import re

import torch

from checkpointing.errors import ConfigError

from ...config import ModelConfig
from . import llama as llama_names
from . import mixtral as mixtral_names
from .mixtral import MixtralNames

_SHARED = re.compile(r"^layers\.(\d+)\.feed_forward\.shared\.(w[123])\.weight$")
_SHARED_HF = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def hf_moe_names(mcfg: ModelConfig) -> MixtralNames:
    """The transformers family the built-in MoE of ``mcfg`` exports as: Mixtral where it can hold the model,
    else Qwen2-MoE."""
    return MixtralNames(mcfg) if mixtral_names.refusal(mcfg) is None else QwenMoeNames(mcfg)


class QwenMoeNames(MixtralNames):
    """:class:`~trainer.models.spec.HFNames` of the built-in MoE of ``mcfg``'s sizes, as Qwen2-MoE."""

    def check(self) -> None:
        if self.mcfg.router_bias_update_rate > 0:
            raise ConfigError(f"--format hf writes the built-in MoE as Mixtral or Qwen2-MoE, and "
                              f"model.router_bias_update_rate={self.mcfg.router_bias_update_rate} routes by biases "
                              "neither router has; use --format safetensors or torch (etrain's names)")

    def hf_name(self, fqn: str) -> str:
        self.check()
        m = _SHARED.match(fqn)
        if m:
            return f"model.layers.{m.group(1)}.mlp.shared_expert.{_SHARED_HF[m.group(2)]}.weight"
        return super().hf_name(fqn)

    def to_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        return t * 2 if fqn.endswith("shared.w2.weight") else llama_names.to_hf(fqn, t, self.mcfg)

    def from_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        return t / 2 if fqn.endswith("shared.w2.weight") else super().from_hf(fqn, t)

    def added(self) -> dict[str, tuple[int, ...]]:
        """The tensors of the Qwen2-MoE that the built-in model lacks, by name and shape: written as zeros."""
        m = self.mcfg
        shared = m.ffn_hidden * m.n_shared_experts
        out: dict[str, tuple[int, ...]] = {}
        for i in range(m.n_layers):
            p = f"model.layers.{i}."
            out[p + "self_attn.q_proj.bias"] = (m.n_heads * m.head_dim,)
            out[p + "self_attn.k_proj.bias"] = (m.n_kv_heads * m.head_dim,)
            out[p + "self_attn.v_proj.bias"] = (m.n_kv_heads * m.head_dim,)
            if m.is_moe_layer(i):
                out[p + "mlp.shared_expert_gate.weight"] = (1, m.dim)
                if not shared:  # transformers builds the shared expert anyway: with no rows it adds zero
                    out.update({p + "mlp.shared_expert.gate_proj.weight": (0, m.dim),
                                p + "mlp.shared_expert.up_proj.weight": (0, m.dim),
                                p + "mlp.shared_expert.down_proj.weight": (m.dim, 0)})
        return out

    def config_json(self, tokenizer: str) -> dict:
        """The ``config.json`` of the built-in MoE as a Qwen2MoeForCausalLM."""
        from transformers import Qwen2MoeConfig

        self.check()
        m = self.mcfg
        cfg = Qwen2MoeConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_hidden,
                             moe_intermediate_size=m.ffn_hidden,
                             shared_expert_intermediate_size=m.ffn_hidden * m.n_shared_experts,
                             decoder_sparse_step=m.moe_every, mlp_only_layers=[], num_hidden_layers=m.n_layers,
                             num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim,
                             rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, max_position_embeddings=m.max_seq_len,
                             use_sliding_window=False, num_experts=m.n_experts, num_experts_per_tok=m.top_k,
                             norm_topk_prob=True, router_aux_loss_coef=m.aux_loss_coef, qkv_bias=True,
                             tie_word_embeddings=False, hidden_act="silu", torch_dtype="float32",
                             bos_token_id=None, eos_token_id=None, pad_token_id=None)
        cfg.architectures = ["Qwen2MoeForCausalLM"]
        out = cfg.to_dict()
        out["etrain_tokenizer"] = tokenizer
        return out
