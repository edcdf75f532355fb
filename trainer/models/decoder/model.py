"""A small Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, causal SDPA.

    model = Transformer(cfg.model)             # on any device, meta included
    model.init_weights(seed)                   # deterministic, layout-free (after to_empty on meta)
    logits = model(tokens)                     # (batch, seq, vocab)
    model.document_eos = eos_id                # model.document_mask: attention inside each document

Parameter names (FQNs) never depend on the parallel layout: blocks live in a
``ModuleDict`` keyed "0".."n-1", so a pipeline stage that keeps blocks 4..7
still calls them ``layers.4`` .. ``layers.7``; activation checkpointing is a
flag on the block, not a wrapper module. Initial values come from a generator
seeded by (seed, FQN), so every layout starts from the same weights.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...config import ModelConfig
from ..blocks import selective_context
from ..documents import document_causal_mask
from ..moe import MoE
from ..shape import ModelShape, layer_split
from ..spec import fill_local


def rope_table(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """(max_seq_len, head_dim // 2, 2) table of cos and sin for rotary embeddings."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    ang = torch.outer(pos, inv)
    return torch.stack([ang.cos(), ang.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by position; pairs are interleaved as in Llama."""
    seq = x.shape[1]
    xf = x.float().unflatten(-1, (-1, 2))
    cos = table[:seq, None, :, 0]
    sin = table[:seq, None, :, 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Set by DecoderSpec.apply_cp (trainer.parallel.context.ContextParallel): x holds this rank's positions
        # of the sequence, and attention over the whole of it goes through the cp group.
        self.cp = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: (batch, 1, seq, seq) bool, True where a query may attend a key (a document mask, already
        causal); None: causal attention over the whole sample (SDPA's ``is_causal``, its fastest kernels)."""
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = apply_rope(self.wq(x).view(b, s, -1, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(self.wk(x).view(b, s, -1, self.head_dim), rope).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.cp is not None:  # grouped-query K/V as they are (fewer bytes between the cp ranks)
            return self.wo(self.cp.attention(q, k, v).transpose(1, 2).reshape(b, s, -1))
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        p = self.dropout if self.training else 0.0
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.is_moe_layer(index) else FeedForward(cfg)
        self.dropout = cfg.dropout
        # Set by DecoderSpec.apply_ac (trainer.models.decoder.spec); recomputes this block in backward.
        self.checkpoint_activations = False
        # With it, "selective": save only the matmuls' outputs (trainer.models.blocks.selective_context).
        self.checkpoint_selective = False
        # Set by trainer.models.decoder.tp.apply_tp under sequence parallelism: (tp rank, tp size); the
        # residual stream then holds this rank's tp-th of the sequence.
        self.seq_shard: tuple[int, int] | None = None

    def _dropout(self, h: torch.Tensor) -> torch.Tensor:
        """Dropout; a sequence shard takes its slice of the mask drawn for the whole sequence, so the
        result does not depend on the tensor-parallel degree (on the CPU, where this is F.dropout's draw)."""
        if not (self.dropout and self.training):
            return h
        if self.seq_shard is None:
            return F.dropout(h, self.dropout)
        rank, n = self.seq_shard
        b, s, d = h.shape
        keep = torch.empty((b, s * n, d), dtype=h.dtype, device=h.device).bernoulli_(1 - self.dropout)
        return h * keep[:, rank * s : (rank + 1) * s].div_(1 - self.dropout)

    def _forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # The mask is passed even when None: the tensor-parallel plan prepares the attention's three inputs (.tp).
        x = x + self._dropout(self.attention(self.attention_norm(x), rope, mask))
        return x + self._dropout(self.feed_forward(self.ffn_norm(x)))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.checkpoint_activations and self.training and torch.is_grad_enabled():
            if self.checkpoint_selective:
                return checkpoint(self._forward, x, rope, mask, use_reentrant=False, context_fn=selective_context)
            return checkpoint(self._forward, x, rope, mask, use_reentrant=False)
        return self._forward(x, rope, mask)


class Transformer(nn.Module):
    """The decoder. A pipeline stage is this class with some parts set to None."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        self.cp = None  # context parallelism (Attention.cp): the rotary table's rows of this rank's positions
        # model.document_mask: the end-of-document id (DecoderSpec.apply_document_mask); None: causal attention
        # over the whole sample.
        self.document_eos: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states (later stages) in; logits or hidden states out."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        rope = self.rope if self.cp is None else self.rope[self.cp.positions(x.shape[1]).to(self.rope.device)]
        # Found from the token ids, once for every block (only the first stage has them: no pipeline with a mask).
        mask = document_causal_mask(x, self.document_eos) if self.document_eos is not None else None
        for block in self.layers.values():
            h = block(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from a generator seeded by (seed, FQN) (:func:`initial_weight`), so that every
        layout, pipeline stage and world size starts identical, and set the buffers (:meth:`init_buffers`).

        Parameters may be plain tensors or, once parallelized (TP, FSDP), DTensors: each whole tensor
        is drawn on the host, one at a time, and this rank keeps its own block of it (:func:`fill_local`).
        """
        self.init_buffers()
        for fqn, p in self.named_parameters():
            fill_local(p, initial_weight(self.cfg, fqn, tuple(p.shape), seed))

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The buffers, which no checkpoint holds: the rotary table, and the MoE layers' routing biases and
        counts at zero (a checkpoint's biases come with its trainer state)."""
        self.rope = rope_table(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=self.rope.device)
        for m in self.modules():
            if isinstance(m, MoE):
                m.expert_bias.zero_()
                m.tokens_per_expert.zero_()


def initial_weight(cfg: ModelConfig, fqn: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The whole fp32 initial value of parameter ``fqn``, drawn on the host from a generator seeded by (seed,
    FQN): the same in every layout, and whether drawn at build or later (``Trainer.initial_weights``)."""
    g = torch.Generator(device="cpu").manual_seed(param_seed(seed, fqn))
    t = torch.empty(shape, dtype=torch.float32)
    leaf = fqn.rsplit(".", 2)
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    if fqn.endswith("norm.weight"):
        t.fill_(1.0)
    elif fqn == "tok_embeddings.weight":
        nn.init.normal_(t, std=1.0, generator=g)
    elif fqn == "output.weight":
        std = cfg.dim**-0.5
        nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)
    elif leaf[-2] in ("wo", "w2") or fqn.endswith("experts.w2"):
        nn.init.trunc_normal_(t, std=out_std, a=-3 * out_std, b=3 * out_std, generator=g)
    else:
        nn.init.trunc_normal_(t, std=0.02, a=-0.06, b=0.06, generator=g)
    return t


def param_seed(seed: int, fqn: str) -> int:
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def cut_stage(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """Keep only what pipeline stage ``stage`` of ``n_stages`` runs, in place.

    Kept blocks keep their FQNs (``layers.5`` stays ``layers.5``).
    """
    keep = layer_split(len(model.layers), n_stages)[stage]
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = None
        model.output = None
    return model


def count_params(cfg: ModelConfig) -> int:
    """Parameters of the whole model, computed from its sizes (:class:`~trainer.models.shape.ModelShape`)."""
    return ModelShape.of(cfg).n_params
