"""The built-in Mixture of Experts as ``transformers``' ``MixtralForCausalLM``: names, layouts, config.json.

    names = MixtralNames(mcfg)         # what DecoderSpec.hf_names() returns for model.n_experts > 0
    names.hf_name("layers.0.feed_forward.experts.w1")   # "model.layers.0.mlp.experts.gate_up_proj"
    names.from_hf(fqn, t)              # init_from a Mixtral directory: w1, w3 their halves of gate_up_proj
    names.merge(name, {fqn: t})        # w1, w3 (experts, hidden, dim) -> gate_up_proj (experts, 2 x hidden, dim)

Attention, norms and embeddings are the Llama mapping (:mod:`.llama_names`, q/k rows permuted for
``rotate_half``). Each MoE layer: ``router.weight`` -> ``mlp.gate.weight``; the stacked experts' ``w1`` (the
SiLU branch) and ``w3`` -> the fused ``mlp.experts.gate_up_proj`` (gate first: transformers splits it in two
halves, ``act(gate) * up``); ``w2`` -> ``mlp.experts.down_proj``. Mixtral routes as the built-in router does
(softmax over the experts in fp32, top-k, renormalized over the chosen), so the logits match. What Mixtral
cannot hold, dense blocks between MoE ones (``moe_every > 1``) and shared experts, exports as Qwen2-MoE
(:mod:`.qwen_moe_names`); auxiliary-loss-free routing biases (``router_bias_update_rate > 0``) are refused
with exit 2. Capacity (``capacity_factor > 0``)
only drops slots in training; transformers runs the experts dropless.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from checkpointing.errors import ConfigError

from ...config import ModelConfig
from . import llama as llama_names

_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.(router\.weight|experts\.w[123])$")
_HF = {"router.weight": "mlp.gate.weight", "experts.w1": "mlp.experts.gate_up_proj",
       "experts.w3": "mlp.experts.gate_up_proj", "experts.w2": "mlp.experts.down_proj"}


def refusal(mcfg: ModelConfig) -> str | None:
    """Why the built-in MoE of ``mcfg`` has no Mixtral layout (None: it has)."""
    if mcfg.moe_every != 1:
        return f"model.moe_every={mcfg.moe_every} puts dense blocks between MoE ones, and every Mixtral block is sparse"
    if mcfg.n_shared_experts:
        return f"model.n_shared_experts={mcfg.n_shared_experts}: Mixtral has no shared experts"
    if mcfg.router_bias_update_rate > 0:
        return (f"model.router_bias_update_rate={mcfg.router_bias_update_rate} routes by biases Mixtral's router "
                "does not have")
    return None


class MixtralNames:
    """:class:`~trainer.models.spec.HFNames` of the built-in MoE of ``mcfg``'s sizes, as Mixtral."""

    renames = True

    def __init__(self, mcfg: ModelConfig):
        self.mcfg = mcfg

    def check(self) -> None:
        why = refusal(self.mcfg)
        if why:
            raise ConfigError(f"--format hf writes the built-in MoE as Mixtral, and {why}; use --format "
                              "safetensors or torch (etrain's names)")

    def hf_name(self, fqn: str) -> str:
        self.check()
        m = _EXPERTS.match(fqn)
        return f"model.layers.{m.group(1)}.{_HF[m.group(2)]}" if m else llama_names.hf_name(fqn)

    def holds_hf_names(self, names: Iterable[str]) -> bool:
        return "model.embed_tokens.weight" in names

    def to_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        return llama_names.to_hf(fqn, t, self.mcfg)

    def from_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        if fqn.endswith(("experts.w1", "experts.w3")) and t.shape[1] == 2 * self.mcfg.ffn_hidden:
            return t[:, : self.mcfg.ffn_hidden] if fqn.endswith("w1") else t[:, self.mcfg.ffn_hidden :]
        return llama_names.from_hf(fqn, t, self.mcfg)

    def from_hf_shape(self, fqn: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of built-in ``fqn`` in the HF tensor of ``shape`` (w1, w3: their half of gate_up_proj)."""
        if fqn.endswith(("experts.w1", "experts.w3")) and len(shape) == 3 and shape[1] == 2 * self.mcfg.ffn_hidden:
            return (shape[0], self.mcfg.ffn_hidden, shape[2])
        return shape

    @staticmethod
    def merged_shape(name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The shape of HF tensor ``name`` made of several built-in ones (w1 and w3: gate_up_proj)."""
        n, hidden, dim = next(iter(shapes.values()))
        return (n, hidden * len(shapes), dim)

    @staticmethod
    def merge(name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """gate_up_proj of a layer: its w1 (gate) then its w3 (up), along the hidden dim."""
        ordered = sorted(parts.items(), key=lambda kv: not kv[0].endswith("w1"))
        return torch.cat([t for _, t in ordered], dim=1)

    def config_json(self, tokenizer: str) -> dict:
        """The ``config.json`` of the built-in MoE as a MixtralForCausalLM."""
        from transformers import MixtralConfig

        self.check()
        m = self.mcfg
        cfg = MixtralConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_hidden,
                            num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                            num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, rms_norm_eps=m.norm_eps,
                            rope_theta=m.rope_theta, max_position_embeddings=m.max_seq_len, sliding_window=None,
                            num_local_experts=m.n_experts, num_experts_per_tok=m.top_k,
                            router_aux_loss_coef=m.aux_loss_coef, tie_word_embeddings=False, hidden_act="silu",
                            torch_dtype="float32", bos_token_id=None, eos_token_id=None, pad_token_id=None)
        cfg.architectures = ["MixtralForCausalLM"]
        out = cfg.to_dict()
        out["etrain_tokenizer"] = tokenizer
        return out
