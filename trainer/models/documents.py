"""Document masking (``[model] document_mask = true``): attention kept inside each document of a packed sample.

    check_document_run(cfg, spec.document_mask_refusal)  # ConfigError for a run the mask cannot go with
    eos = document_eos_id(cfg, load_tokenizer, resolve_format)   # the data's end-of-document id (at build)
    mask = document_causal_mask(tokens, eos)            # (batch, 1, seq, seq) bool: causal and same document

A sample is a window of the token stream, in which documents lie back to back, each followed by the
tokenizer's end-of-document token (trainer.data: the token cache appends it; the default corpus ends each
file with byte 0, the bytes tokenizer's). A token's document is the number of end-of-document tokens before
it in the sample, so the end-of-document token belongs to the document it ends, and the first document of a
window may be the tail of one begun in the previous window. A query attends a key when the key is not later
and lies in the same document; every query attends at least itself. The model finds this from the token ids
in its own forward (the built-in decoder, a transformers decoder's ``attention_mask``), so the step loop
and the loss are unchanged: each token's target is still the next token of the stream.

Rotary positions are not restarted at a document's start: attention scores under rotary embeddings depend
only on the distance between the query and the key, so a document's logits inside a packed sample equal
the document's alone to float rounding (tests/trainer/test_document_mask.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from checkpointing.errors import ConfigError

if TYPE_CHECKING:
    from ..config import ModelConfig, RunConfig

# The layouts a document mask cannot reach: a later pipeline stage receives hidden states, not token ids;
# context parallelism's attention (trainer.parallel.cp_attention) masks by global position only.
REFUSED_LAYOUTS = {
    "pp": "a later pipeline stage receives hidden states, not the token ids the mask is found from; set "
          "parallel.pp=1",
    "cp": "context parallelism's attention masks by position only, not by document; set parallel.cp=1",
}


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) int32: each token's document within its sample, counted by the end-of-document tokens
    before it (the end-of-document token is its own document's last)."""
    ends = (tokens == eos_id).to(torch.int32)
    return ends.cumsum(1, dtype=torch.int32) - ends


def document_causal_mask(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where a query (row) may attend a key (column): the key is not later
    and lies in the same document. One head axis, broadcast over every head (and every tp rank's heads)."""
    doc = document_ids(tokens, eos_id)
    seq = tokens.shape[1]
    causal = torch.ones((seq, seq), dtype=torch.bool, device=tokens.device).tril()
    return (doc[:, :, None] == doc[:, None, :]).logical_and_(causal).unsqueeze(1)


def masked_layouts(mcfg: ModelConfig, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``allowed`` (a spec's :meth:`~trainer.models.spec.ModelSpec.allows`) without the layouts a document mask
    cannot reach, when ``model.document_mask`` is on (so that ``etrain plan`` never offers them)."""
    return tuple(a for a in allowed if not (mcfg.document_mask and a in REFUSED_LAYOUTS))


def check_document_run(cfg: RunConfig, model_refusal: Callable[[int], str | None]) -> None:
    """ConfigError naming ``model.document_mask`` when the run cannot mask documents: a model that cannot take
    the mask (``model_refusal(seq_len)``: its spec's :meth:`~trainer.models.spec.ModelSpec.document_mask_refusal`),
    a layout the mask cannot reach, data without end-of-document tokens between its documents."""
    if not cfg.model.document_mask:
        return
    refusal = model_refusal(cfg.data.seq_len)
    if refusal:
        raise ConfigError(f"model.document_mask=true: {refusal}; set model.document_mask=false")
    for axis, why in REFUSED_LAYOUTS.items():
        degree = getattr(cfg.parallel, axis)
        if degree > 1:
            raise ConfigError(f"model.document_mask=true with parallel.{axis}={degree}: {why}, or "
                              "model.document_mask=false")
    d = cfg.data
    if d.source == "python":
        raise ConfigError('model.document_mask=true finds documents by the end-of-document token after each, and '
                          'data.source="python" packs its documents back to back without one; set '
                          "model.document_mask=false")


def document_eos_id(cfg: RunConfig, load_tokenizer: Callable[[str], object],
                    resolve_format: Callable[[object], str]) -> int | None:
    """The id that ends every document of the run's data: ``data.tokenizer``'s end-of-document token (what the
    token cache appends after each document; token files hold their own tokenizer's); None when
    ``model.document_mask`` is off. ConfigError when there is none to go by. ``load_tokenizer`` and
    ``resolve_format``: trainer.data's, handed in by the caller (the data room stands above the models)."""
    if not cfg.model.document_mask:
        return None
    d = cfg.data
    if d.tokenizer == "bytes" and resolve_format(d) == "tokens":
        raise ConfigError("model.document_mask=true with token files and data.tokenizer=\"bytes\": the files' "
                          "end-of-document id is their own tokenizer's; set data.tokenizer to the tokenizer that "
                          "wrote them (its eos token separates the documents), or model.document_mask=false")
    eos = getattr(load_tokenizer(d.tokenizer), "eos_id", None)
    if eos is None:
        raise ConfigError(f"model.document_mask=true: data.tokenizer={cfg.data.tokenizer!r} names no end-of-document "
                          "token, so its documents are packed without a separator; give it an eos_token "
                          "(tokenizer_config.json), or set model.document_mask=false")
    return int(eos)
