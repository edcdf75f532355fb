"""transformers' Mixture-of-Experts models (``source = "hf"``): Mixtral, Qwen2-MoE, Qwen3-MoE.

    kind = moe_family(config)         # None: dense; the model_type of a mapped MoE; ConfigError: one etrain cannot map
    logits = moe_forward(model, ids)  # the model's own forward with output_router_logits; its aux loss kept
    aux = router_aux_loss(model)      # router_aux_loss_coef x that forward's load-balancing loss

The model keeps its own router and its own balancing loss: the forward asks for the router logits and
transformers computes ``load_balancing_loss_func`` over every layer's, exactly as its own training loss does;
etrain adds ``router_aux_loss_coef`` times it to the language-model loss of each micro-batch (the model's
``loss`` with ``labels``, computed per micro-batch as a plain loop with the same micro-batches would).

The mapped families share one layout, checked on the built model: every sparse block holds ``gate`` (a top-k
router, weight (experts, hidden)) and ``experts`` with fused weights ``gate_up_proj`` (experts, 2 x inter,
hidden) and ``down_proj`` (experts, hidden, inter). A transformers model whose config names experts and that
is not one of these (DeepSeek, gpt-oss, ...) is refused: etrain would train it without its balancing loss.

Under tensor parallelism the sparse blocks are replicated across the tp ranks, as the built-in MoE's are
(:mod:`.decoder_tp`): the model's own plan keeps its attention (and dense MLP) entries and loses those of the
experts (:func:`dense_tp_plan`), so every tp rank routes and computes the whole block on the same tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from checkpointing.errors import ConfigError

from ..grouped import expert_linear

MAPPED = ("mixtral", "qwen2_moe", "qwen3_moe")
# Config fields by which transformers' MoE configs name their experts (any of them > 0: an MoE).
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


def moe_family(config) -> str | None:
    """The model_type of a mapped MoE, None for a dense model; ConfigError for an MoE etrain cannot map."""
    kind = getattr(config, "model_type", "")
    if kind in MAPPED:
        return kind
    named = [f for f in EXPERT_FIELDS if isinstance(getattr(config, f, None), int) and getattr(config, f) > 0]
    if named:
        raise ConfigError(f"model.hf_config: model_type {kind!r} is a Mixture of Experts ({named[0]}="
                          f"{getattr(config, named[0])}) whose expert layout etrain cannot map (its routing, balancing "
                          f"loss and expert parallelism); use one of the mapped families {', '.join(MAPPED)}, the "
                          'built-in MoE (model.preset="moe-tiny"), or wrap it in a model.source="python" factory')
    return None


def dense_tp_plan(plan: dict | None) -> dict | None:
    """A mapped MoE's own ``_tp_plan`` without the entries inside its experts (transformers' expert TP, which
    etrain does not do: the sparse blocks stay whole on every tp rank)."""
    if plan is None:
        return None
    return {k: v for k, v in plan.items() if "experts" not in k.split(".")}


def sparse_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks of a mapped model (``gate`` + fused ``experts``), in order; ConfigError when the
    installed transformers lays a mapped family out otherwise."""
    blocks = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    for b in blocks:
        ex = b.experts
        if not (isinstance(getattr(ex, "gate_up_proj", None), torch.Tensor)
                and isinstance(getattr(ex, "down_proj", None), torch.Tensor) and ex.gate_up_proj.ndim == 3):
            raise ConfigError(f"{type(model).__name__}: its experts ({type(ex).__name__}) are not the fused layout "
                              "etrain maps (gate_up_proj, down_proj of (experts, ...)) in this transformers "
                              "version; use the built-in MoE (model.preset=\"moe-tiny\")")
    if not blocks:
        raise ConfigError(f"{type(model).__name__} declares experts but holds no sparse block (gate, experts) "
                          "etrain can find in this transformers version; use the built-in MoE")
    return blocks


def moe_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Logits of ``inputs``; the forward's load-balancing loss, times the model's coefficient, kept on the
    model for :func:`router_aux_loss`."""
    from .cp import global_positions

    out = model(input_ids=inputs, position_ids=global_positions(model, inputs), use_cache=False,
                output_router_logits=True)
    aux = out.aux_loss
    model.etrain_aux_loss = None if aux is None else float(model.config.router_aux_loss_coef) * aux
    return out.logits


def router_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The weighted balancing loss of ``model``'s last :func:`moe_forward` (None before any)."""
    return getattr(model, "etrain_aux_loss", None)


class ExpertLayer:
    """A sparse block as expert parallelism sees it (trainer.parallel.expert): its ``experts`` module, their
    number, and ``ep``: once set, the experts' forward routes each (token, choice) slot to its expert's rank
    (:meth:`ExpertParallel.run`) and combines the outputs by the router's weights, as transformers does."""

    def __init__(self, block: nn.Module):
        self.experts = block.experts
        self.n_experts = int(block.experts.num_experts)
        self._ep = None

    @property
    def ep(self):
        return self._ep

    @ep.setter
    def ep(self, ep) -> None:
        self._ep = ep
        experts = self.experts
        experts.forward = lambda hidden, index, weights: dispatch(experts, ep, hidden, index, weights)


def dispatch(experts: nn.Module, ep, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (``hidden`` (tokens, dim), the chosen experts and their weights (tokens,
    k)) with the slots sorted by expert and computed on their experts' ranks."""
    k = index.shape[-1]
    flat = index.flatten()
    order = flat.argsort(stable=True)  # slots sorted by expert, token order within one
    counts = torch.bincount(flat, minlength=experts.num_experts)
    out_sorted = ep.run(lambda x, c: local_experts(experts, x, c), hidden[order // k], counts)
    out = hidden.new_zeros(flat.numel(), hidden.shape[-1]).index_copy(0, order, out_sorted)
    return (out.view(-1, k, hidden.shape[-1]) * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)


def local_experts(experts: nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """This rank's experts (its block of the ep-split ``gate_up_proj``/``down_proj``) on ``x``, sorted by
    local expert, ``counts[i]`` slots for the ``i``-th."""
    from torch.distributed.tensor import DTensor

    gate_up, down = (w.to_local() if isinstance(w, DTensor) else w for w in (experts.gate_up_proj, experts.down_proj))
    gate, up = expert_linear(x, gate_up, counts).chunk(2, dim=-1)  # grouped GEMM where it runs (.grouped)
    return expert_linear(experts.act_fn(gate) * up, down, counts)


def count_load(model: nn.Module) -> None:
    """Every sparse block counts the slots its router sends to each expert (``tokens_per_expert``, read and
    cleared after each step by :func:`trainer.models.moe.balance_step`: the step log's imbalance and loads)."""
    for block in sparse_blocks(model):
        n = int(block.experts.num_experts)
        block.register_buffer("tokens_per_expert", torch.zeros(n), persistent=False)
        block.dropped = 0  # transformers' experts are dropless
        block.etrain_counts_load = True
        block.gate.register_forward_hook(lambda _m, _inp, out, block=block, n=n: add_load(block, out[2], n))


@torch.no_grad()
def add_load(block: nn.Module, index: torch.Tensor, n: int) -> None:
    block.tokens_per_expert += torch.bincount(index.flatten(), minlength=n).to(block.tokens_per_expert)
