"""Pipeline stages of ``transformers`` decoders laid out as Llama's (Llama, Qwen2, Mistral and others).

    if llama_like(model):
        blocks = cut_hf_stage(model, range(4, 8), first=False, last=False)   # in place

Such a model has ``model.embed_tokens``, ``model.layers`` (an ``nn.ModuleList``), ``model.norm``,
``model.rotary_emb`` and ``lm_head``. Each stage keeps its blocks under their own names and runs them
with its own rotary positions, whichever family built the model (a Python factory may return one).
"""

from __future__ import annotations

import types

import torch
from torch import nn


def llama_like(model: nn.Module) -> bool:
    base = getattr(model, "model", None)
    return all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) and hasattr(
        model, "lm_head") and isinstance(base.layers, nn.ModuleList)


def cut_hf_stage(model: nn.Module, keep: range, first: bool, last: bool) -> list[nn.Module]:
    """Keep what one pipeline stage of a Llama-like ``transformers`` model runs, in place; its blocks.

    The kept blocks keep their names (``model.layers.5``): the layer list becomes a dict keyed by the
    original indices. The stage's ``forward`` takes token ids (first stage) or hidden states and returns
    hidden states or logits (last stage)."""
    base = model.model
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in keep})
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = None
        model.lm_head = None
    model.forward = types.MethodType(_stage_forward, model)
    return list(base.layers.values())


def _stage_forward(self, x: torch.Tensor) -> torch.Tensor:
    base = self.model
    h = base.embed_tokens(x) if base.embed_tokens is not None else x
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    rotary = base.rotary_emb(h, position_ids=positions)
    for layer in base.layers.values():
        # No mask: the attention runs causal (SDPA's is_causal), as the whole model does on unpadded input.
        h = layer(h, attention_mask=None, position_embeddings=rotary, position_ids=positions)
    if self.lm_head is not None:
        h = self.lm_head(base.norm(h))
    return h
