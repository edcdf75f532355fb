"""Document masking (``model.document_mask``) for ``transformers`` decoders: a 4D mask as their attention_mask.

    reason = document_mask_refusal(model, seq_len)     # None when the model can take the mask, else why not
    model.etrain_document_eos = eos_id                  # HFSpec.apply_document_mask
    logits = model(input_ids=x, attention_mask=attention_mask(model, x)).logits   # hf_forward, moe_forward

transformers takes an ``attention_mask`` of shape (batch, 1, query, key) as given, in place of the causal
mask it would build (``masking_utils``: a 4D mask is returned as it is, for every attention layer). Its
form is the attention implementation's: SDPA takes a boolean mask (True: attend), the eager implementation
adds the mask to the scores (0 or the most negative float). The mask is causal and within each document
(:func:`trainer.models.documents.document_causal_mask`). Refused, with the reason: a model not laid out as
Llama's (embeddings, layers, rotary embedding) or whose forward takes no attention_mask, another attention
implementation (flash attention takes no 4D mask, flex attention a block mask), a sliding window shorter
than the sequence or chunked attention (transformers' own mask carries them, and the 4D mask replaces it),
and layers other than attention (a linear-attention or state-space layer the mask does not reach).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..documents import document_causal_mask
from ..llama_layout import llama_like
from .cp import short_window

ATTRIBUTE = "etrain_document_eos"  # set on the model: its end-of-document id
IMPLEMENTATIONS = ("sdpa", "eager")
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def document_mask_refusal(model: nn.Module, seq_len: int) -> str | None:
    """Why ``model`` cannot take a document mask at ``seq_len``, or None."""
    name, hf = type(model).__name__, getattr(model, "config", None)
    if hf is None or not llama_like(model) or "attention_mask" not in inspect.signature(model.forward).parameters:
        return (f"{name} is not a transformers decoder laid out as Llama's (embeddings, layers, rotary embedding) "
                "that takes an attention_mask, so etrain cannot hand it one")
    impl = getattr(hf, "_attn_implementation", None)
    if impl not in IMPLEMENTATIONS:
        return (f"{name} runs the {impl!r} attention implementation, which takes no 4D boolean or additive mask; "
                "use \"sdpa\" (etrain's default) or \"eager\"")
    window = short_window(hf, seq_len)
    if window is not None or getattr(hf, "attention_chunk_size", None):
        what = f"a sliding window of {window}" if window is not None else f"chunks of {hf.attention_chunk_size}"
        return (f"{name} attends within {what} positions, shorter than data.seq_len={seq_len}, which "
                "transformers' own mask carries and a document mask replaces")
    others = sorted(set(getattr(hf, "layer_types", None) or ()) - ATTENTION_LAYERS)
    if others:
        return f"{name} has layers of kind {', '.join(others)}, which an attention mask does not reach"
    return None


def attention_mask(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
    """The document mask of token ids ``inputs`` in the form ``model``'s attention takes (module docstring);
    None when the model has no end-of-document id (document masking off: transformers' causal mask)."""
    eos = getattr(model, ATTRIBUTE, None)
    if eos is None:
        return None
    mask = document_causal_mask(inputs, eos)
    if model.config._attn_implementation == "eager":  # added to the scores; fp32, whatever the compute dtype
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return mask
