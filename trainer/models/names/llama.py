"""The built-in decoder as ``transformers``' ``LlamaForCausalLM``: names, rotary layout, config.json.

    names = LlamaNames(mcfg)          # what DecoderSpec.hf_names() returns
    names.hf_name("layers.0.attention.wq.weight")   # "model.layers.0.self_attn.q_proj.weight"
    names.to_hf(fqn, t), names.from_hf(fqn, t)      # q/k rows permuted per head

The rows of ``wq`` and ``wk`` are permuted per head from interleaved rotary pairs
(:func:`trainer.models.decoder.model.apply_rope`) to the halves that ``transformers``' ``rotate_half``
pairs, so the logits match. Used by ``etrain ckpt export --format hf`` and by ``model.init_from``
reading a Llama directory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from checkpointing.errors import ConfigError

from ...config import ModelConfig

# built-in name -> LlamaForCausalLM name (per block: the part after "layers.<i>.")
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")


def hf_name(fqn: str) -> str:
    """The LlamaForCausalLM name of a built-in parameter."""
    if fqn in _TOP:
        return _TOP[fqn]
    m = _LAYER.match(fqn)
    if m is None or m.group(3) not in _BLOCK:
        raise ConfigError(f"{fqn!r} is not a parameter of the built-in decoder")
    return f"model.layers.{m.group(2)}.{_BLOCK[m.group(3)]}"


def builtin_name(name: str) -> str:
    """The built-in name of a LlamaForCausalLM parameter (the inverse of :func:`hf_name`)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = _LAYER.match(name)
    if m is None or not m.group(1) or m.group(3) not in _BLOCK_BACK:
        raise ConfigError(f"{name!r} is not a parameter of a Llama model that the built-in decoder has")
    return f"layers.{m.group(2)}.{_BLOCK_BACK[m.group(3)]}"


def _rope_permute(t: torch.Tensor, head_dim: int, to_hf: bool) -> torch.Tensor:
    """Rows of a q/k projection per head: interleaved pairs (2j, 2j+1) <-> halves (j, j + head_dim/2)."""
    rows, cols = t.shape
    if to_hf:
        return t.reshape(rows // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    return t.reshape(rows // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(fqn: str, t: torch.Tensor, mcfg: ModelConfig) -> torch.Tensor:
    """A built-in tensor in LlamaForCausalLM's layout (q/k rows permuted; everything else as is)."""
    if fqn.endswith(("attention.wq.weight", "attention.wk.weight")):
        return _rope_permute(t, mcfg.head_dim, to_hf=True)
    return t


def from_hf(fqn: str, t: torch.Tensor, mcfg: ModelConfig) -> torch.Tensor:
    """The inverse of :func:`to_hf` (``fqn`` is the built-in name)."""
    if fqn.endswith(("attention.wq.weight", "attention.wk.weight")) and t.dim() == 2 and t.shape[0] % mcfg.head_dim == 0:
        return _rope_permute(t, mcfg.head_dim, to_hf=False)
    return t


def llama_config(mcfg: ModelConfig, tokenizer: str = "bytes") -> dict:
    """The ``config.json`` of the built-in decoder as a LlamaForCausalLM."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=mcfg.vocab_size, hidden_size=mcfg.dim, intermediate_size=mcfg.ffn_hidden,
                      num_hidden_layers=mcfg.n_layers, num_attention_heads=mcfg.n_heads,
                      num_key_value_heads=mcfg.n_kv_heads, head_dim=mcfg.head_dim, rms_norm_eps=mcfg.norm_eps,
                      rope_theta=mcfg.rope_theta, max_position_embeddings=mcfg.max_seq_len,
                      tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
                      torch_dtype="float32", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.architectures = ["LlamaForCausalLM"]
    out = cfg.to_dict()
    out["etrain_tokenizer"] = tokenizer  # what `etrain generate` encodes with when no tokenizer files are here
    return out


class LlamaNames:
    """:class:`~trainer.models.spec.HFNames` of the built-in decoder of ``mcfg``'s sizes."""

    renames = True

    def __init__(self, mcfg: ModelConfig):
        self.mcfg = mcfg

    def hf_name(self, fqn: str) -> str:
        return hf_name(fqn)

    def holds_hf_names(self, names: Iterable[str]) -> bool:
        return "model.embed_tokens.weight" in names

    def to_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        return to_hf(fqn, t, self.mcfg)

    def from_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        return from_hf(fqn, t, self.mcfg)

    def config_json(self, tokenizer: str) -> dict:
        return llama_config(self.mcfg, tokenizer)
