"""Context parallelism for ``transformers`` decoders: their attention routed through etrain's.

    reason = cp_refusal(model, cfg)          # None when the model's attention can be routed, else why not
    route_attention(model, cp)               # in place: every attention layer over the cp group
    logits = model(input_ids=x, position_ids=global_positions(model, x)).logits   # hf.hf_forward does this

A model whose attention layers call their kernel through transformers' attention interface
(``ALL_ATTENTION_FUNCTIONS``, looked up by ``config._attn_implementation`` at every call; the classes that
declare ``_supports_attention_backend``: Llama, Qwen2, Mistral and others) takes etrain's context-parallel
attention (:mod:`trainer.parallel.cp_attention`: ring, allgather, ulysses) once it is registered under
:data:`IMPLEMENTATION` and set on the model's config. Such a layer hands over q as (batch, heads, seq / cp,
head_dim) and K/V unrepeated (grouped-query heads travel as they are), and gets (batch, seq / cp, heads,
head_dim) back. transformers builds no mask for an implementation it does not know; the causal mask is
applied by global positions, and the rotary embedding is computed from the global position ids
(:func:`global_positions`, the head-tail split's). Refused, with the reason: a model that does not route
its attention through the interface, or is not laid out as Llama's (embeddings, layers, rotary embedding),
attention dropout, a sliding window shorter than the sequence, logit soft-capping, attention sinks, or a
scale other than ``head_dim ** -0.5``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..llama_layout import llama_like

IMPLEMENTATION = "etrain_cp"


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "head_dim") and hasattr(m, "is_causal")]


def cp_refusal(model: nn.Module, seq_len: int) -> str | None:
    """Why ``model``'s attention cannot be routed through context parallelism at ``seq_len``, or None."""
    name, hf = type(model).__name__, getattr(model, "config", None)
    if hf is None or not getattr(model, "_supports_attention_backend", False) or not llama_like(model):
        return (f"{name} does not call its attention through transformers' attention interface in a decoder laid "
                "out as Llama's (embeddings, layers, rotary embedding), so etrain cannot route it")
    layers = _attention_layers(model)
    if not layers:
        return f"{name} has no attention layers etrain recognises (with scaling, head_dim and is_causal)"
    if float(getattr(hf, "attention_dropout", 0.0) or 0.0) > 0:
        return f"{name} has attention_dropout={hf.attention_dropout}, which is not split across the cp ranks"
    window = short_window(hf, seq_len)
    if window is not None:
        return f"{name} attends within a sliding window of {window} positions, shorter than data.seq_len={seq_len}"
    for field in ("attn_logit_softcapping", "query_pre_attn_scalar"):
        if getattr(hf, field, None):
            return f"{name} sets {field}={getattr(hf, field)}, which etrain's attention does not apply"
    for layer in layers:
        if not layer.is_causal or any("sink" in n for n, _ in layer.named_parameters(recurse=False)):
            return f"{name}'s {type(layer).__name__} is not plain causal attention (non-causal, or attention sinks)"
        if abs(float(layer.scaling) - float(layer.head_dim) ** -0.5) > 1e-9:
            return (f"{name}'s {type(layer).__name__} scales scores by {layer.scaling}, not head_dim ** -0.5 = "
                    f"{float(layer.head_dim) ** -0.5}")
    return None


def short_window(hf, seq_len: int) -> int | None:
    """The sliding window of a transformers config when it is in use and shorter than ``seq_len``, else None."""
    window = getattr(hf, "sliding_window", None)
    if isinstance(window, int) and window < seq_len and getattr(hf, "use_sliding_window", True) is not False:
        return window
    return None


def _cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  scaling=None, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over etrain's context-parallel attention."""
    out = module.etrain_cp.attention(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def route_attention(model: nn.Module, cp) -> None:
    """Register :data:`IMPLEMENTATION`, set it on ``model``'s config and give each attention layer the cp group."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _cp_attention)
    model.config._attn_implementation = IMPLEMENTATION
    for layer in _attention_layers(model):
        layer.etrain_cp = cp
    model.etrain_cp = cp


def global_positions(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
    """The global position ids of this rank's tokens (batch, seq / cp), or None when cp is not routed."""
    cp = getattr(model, "etrain_cp", None)
    if cp is None:
        return None
    return cp.positions(inputs.shape[1]).to(inputs.device).unsqueeze(0).expand(inputs.shape[0], -1)
