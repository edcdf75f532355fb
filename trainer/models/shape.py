"""A model's shape: the sizes of a decoder and every count derived from them, in one place.

    shape = spec_for(cfg.model).shape()
    shape.n_params, shape.block_params(tp=2)               # parameters: the whole model, one block's tp-th
    shape.local_counts(tp, stages, n_stages)              # (one block, this rank's) after TP and PP
    shape.flops_per_token(seq_len)                        # training FLOPs per token (MFU)
    shape.block_activation_elems(tp, sp)                  # what one block saves for backward (the planner)

A Mixture of Experts' layers are replicated across tp (trainer.models.decoder.tp): their parameters count whole
on every tp rank (:meth:`ModelShape.layer_params`), their feed-forward activations too.

The formulas are those of a Llama-style decoder block (the built-in one): attention with
``n_heads`` query and ``n_kv_heads`` key/value heads of ``dim / n_heads``, a SwiGLU feed-forward of
``ffn_hidden``, two RMSNorms; an embedding and an untied head of ``vocab_size x dim``, a final norm.
A model of another family reports the shape of its built-in equivalent (same width, depth, heads
and vocabulary, the feed-forward width that gives one block its parameter count) and the counts it
measured itself (``params``, ``block``, ``weights``: counted on the meta device), which then win over
the formulas where a count of the whole model is asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import ModelConfig


def layer_split(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous block ranges per pipeline stage, as even as possible."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class ModelShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    max_seq_len: int
    name: str = ""
    counted: str = "config"  # "config" (the formulas) or "meta device" (the model built there, counted)
    params: int = 0  # parameters counted (0: from the formulas)
    block: int = 0  # parameters of one block, counted (0: from the formulas)
    weights: int = 0  # parameters of two or more dims (weight matrices, embeddings), counted (0: the formulas)
    # Mixture of Experts: the routed experts' parameters (all MoE layers, counted; 0: a dense model), the share
    # of them one token computes with (top_k / n_experts), and the layers that have experts.
    experts: int = 0
    expert_share: float = 1.0
    moe_layers: int = 0
    # One MoE layer's feed-forward (router, routed and shared experts: replicated across tp, counted), and the
    # blocks that have one: the last of every ``moe_every`` (0: not known).
    moe_ffn: int = 0
    moe_every: int = 0

    @classmethod
    def of(cls, m: ModelConfig) -> ModelShape:
        """The built-in decoder of these ``[model]`` sizes."""
        return cls(m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.vocab_size, m.max_seq_len,
                   f"built-in decoder (dim {m.dim}, {m.n_layers} layers)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    # --- parameters: the one formula ---------------------------------------------------------

    def attention_params(self, tp: int = 1) -> int:
        d, hd = self.dim, self.head_dim
        return (d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2) // tp

    def ffn_params(self, tp: int = 1) -> int:
        return 3 * self.dim * self.ffn_hidden // tp

    def block_params(self, tp: int = 1) -> int:
        """One block's parameters on a rank of ``tp``: attention and feed-forward split, the norms whole."""
        return self.attention_params(tp) + self.ffn_params(tp) + 2 * self.dim

    def embedding_params(self, tp: int = 1) -> int:
        return self.vocab_size * self.dim // tp

    def head_params(self, tp: int = 1) -> int:
        """The output head (split by vocabulary) and the final norm."""
        return self.vocab_size * self.dim // tp + self.dim

    @property
    def n_params(self) -> int:
        """Parameters of the whole model."""
        return self.params or self.embedding_params() + self.head_params() + self.n_layers * self.block_params()

    @property
    def one_block_params(self) -> int:
        return self.block or self.block_params()

    @property
    def weight_params(self) -> int:
        """Parameters that multiply (two or more dims: weight matrices and embeddings; not norms, not biases)."""
        return self.weights or self.n_layers * (self.attention_params() + self.ffn_params()) + 2 * self.vocab_size * self.dim

    @property
    def dense_params(self) -> int:
        """Parameters outside the routed experts (all of them in a dense model)."""
        return self.n_params - self.experts

    @property
    def active_weight_params(self) -> float:
        """The weight parameters one token computes with: a Mixture of Experts' top_k of its n_experts."""
        return self.weight_params - self.experts * (1 - self.expert_share)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the parameters that multiply (the experts a token is routed to) + 12 x
        layers x dim x sequence (attention)."""
        return 6.0 * self.active_weight_params + 12.0 * self.n_layers * self.dim * seq_len

    # --- the layout ----------------------------------------------------------------------------

    def stage_layers(self, n_stages: int) -> list[range]:
        """The blocks of each pipeline stage."""
        return layer_split(self.n_layers, n_stages)

    def is_moe_layer(self, index: int) -> bool:
        return self.moe_every > 0 and self.moe_layers > 0 and index % self.moe_every == self.moe_every - 1

    def layer_params(self, index: int, tp: int = 1) -> int:
        """Block ``index``'s parameters on a rank of ``tp``: a Mixture-of-Experts feed-forward is whole on every
        tp rank (trainer.models.decoder.tp), a dense one split."""
        if self.is_moe_layer(index) and self.moe_ffn:
            return self.attention_params(tp) + 2 * self.dim + self.moe_ffn
        return self.block_params(tp)

    def stage_experts(self, stages: list[int], n_stages: int) -> int:
        """The routed experts' parameters in pipeline ``stages`` of ``n_stages`` (all of them unpipelined)."""
        if n_stages == 1 or not self.moe_every:
            return self.experts
        split = self.stage_layers(n_stages)
        return self.experts // self.moe_layers * sum(1 for s in stages for i in split[s] if self.is_moe_layer(i))

    def local_counts(self, tp: int, stages: list[int], n_stages: int) -> tuple[int, int]:
        """(parameters of one block, parameters a rank holds) on a rank of ``tp`` running pipeline ``stages``
        (a Mixture of Experts: its counts at tp 1 without stages; its largest block)."""
        if self.experts and tp == 1 and n_stages == 1:
            return self.one_block_params, self.n_params
        block = max(self.layer_params(i, tp) for i in range(self.n_layers))
        split = self.stage_layers(n_stages)
        total = 0
        for s in stages:
            total += sum(self.layer_params(i, tp) for i in split[s])
            if s == 0:
                total += self.embedding_params(tp)
            if s == n_stages - 1:
                total += self.head_params(tp)
        return block, total

    def block_activation_elems(self, tp: int, sp: bool) -> float:
        """Elements per token one block saves for backward (:mod:`trainer.plan.accounting`): RMSNorm inputs,
        the normed inputs of the first linears, q/k/v and SDPA's output and statistics (no materialized
        scores), the output projection's input, SwiGLU's four; sequence parallelism splits the norms' too."""
        h, f, kvd = self.dim, self.ffn_hidden, self.n_kv_heads * self.head_dim
        norms = 2 * h  # the two RMSNorms' inputs (the residual stream)
        gathered = 2 * h  # the normed inputs of the first linears of attention and feed-forward
        inside = (h + 2 * kvd) + (h + kvd) + (2 * h if self.n_kv_heads < self.n_heads else 0) + 2 * h + 4 * f
        return (norms / tp if sp else norms) + gathered + inside / tp + 4 * f * self.whole_ffn_share(tp)

    def whole_ffn_share(self, tp: int) -> float:
        """What tp does not split of the blocks' feed-forwards, on average over the blocks: the Mixture-of-Experts
        layers' share of them, each whole on every tp rank (trainer.models.decoder.tp), less the tp-th counted."""
        return (1 - 1 / tp) * self.moe_layers / self.n_layers if self.n_layers else 0.0

    def block_matmul_elems(self, tp: int) -> float:
        """Elements per token of one block's matmul and attention outputs: what selective activation
        checkpointing keeps (q, k, v, SDPA's output, the output projection's; SwiGLU's three)."""
        h, f, kvd = self.dim, self.ffn_hidden, self.n_kv_heads * self.head_dim
        return (2 * h + 2 * kvd + 2 * f) / tp + 2 * h + 2 * f * self.whole_ffn_share(tp)
