"""Mixture of Experts for the built-in decoder (``[model] n_experts > 0``, ``preset = "moe-tiny"``).

    moe = MoE(cfg.model)          # replaces a block's feed-forward (ModelConfig.is_moe_layer)
    y = moe(x)                    # (batch, seq, dim) in and out; moe.aux_loss: this forward's balancing loss

Token-choice top-k routing in fp32: each token's router logits (``router``, no bias) go through a softmax;
the top ``top_k`` experts by score plus ``expert_bias`` (a buffer, moved by auxiliary-loss-free balancing:
:func:`update_router_bias`) are chosen, and their scores, renormalized over the chosen ones, weight the
experts' outputs. ``n_shared_experts`` SwiGLUs of ``ffn_hidden`` see every token. The auxiliary loss is
the Switch Transformer's, ``n_experts * sum_e f_e * P_e`` (f_e: the share of routed slots that expert e
got, P_e: its mean router probability), times ``aux_loss_coef``. With ``capacity_factor > 0`` an expert
takes at most ``ceil(capacity_factor * tokens * top_k / n_experts)`` slots, first come first served in
token order; the rest are dropped (their share of the output is zero). The slots routed and dropped are
counted per training forward (``tokens_per_expert``, ``dropped``), once: not again when activation
checkpointing reruns the layer in backward, nor in evaluation.

Under context parallelism (``self.cp_group``, set by the spec's ``apply_cp``) each cp rank routes its own
share of the sequence: f_e counts the slots of the whole sequence (the counts summed over the cp group, no
gradient), P_e is the rank's own mean, so the mean of the cp ranks' aux losses (how the cp ranks' losses
and gradients are averaged) is the whole sequence's. Capacity (``capacity_factor > 0``) applies to the
tokens a rank routes. Under pipeline parallelism (``self.aux_scale``, set by trainer.parallel.parallelize)
the aux loss is not part of the last stage's loss: :class:`AuxLossToBackward` passes the layer's output on
unchanged and, in backward, gives the aux loss the gradient ``aux_scale`` (the schedule's 1 / micro-batches,
as each micro-batch's loss is scaled), and adds what it so trained to ``aux_trained`` (for the step log; a
pipelined evaluation adds it in forward, for the held-out loss).

Experts are computed on the slots sorted by expert, by one grouped GEMM per projection where torch runs it
for the device and dtype, else a loop over experts (:mod:`.grouped`). Under expert parallelism
(``self.ep``, trainer.parallel.expert) this rank holds ``n_experts / ep`` of them (the weights are DTensors
split on the expert dim), and the sorted slots travel to their experts' ranks and back by all-to-all with
uneven splits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ModelConfig
from .grouped import expert_linear


class Experts(nn.Module):
    """``n`` SwiGLU experts as stacked weights: w1, w3 (n, hidden, dim), w2 (n, dim, hidden)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.grouped = True  # by grouped GEMM where it runs (trainer.models.grouped); False: a loop over experts

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: slots sorted by expert, ``counts[i]`` of them for this rank's ``i``-th expert (under expert
        parallelism the weights are DTensors split on the expert dim, and this rank computes its own)."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        h = F.silu(expert_linear(x, w1, counts, self.grouped)) * expert_linear(x, w3, counts, self.grouped)
        return expert_linear(h, w2, counts, self.grouped)


class AuxLossToBackward(torch.autograd.Function):
    """``y`` unchanged forward; backward: ``y``'s gradient, and ``scale`` for the (scalar) ``aux``, as if
    ``aux * scale`` were part of the loss; ``layer.aux_trained`` grows by that (once per backward, so a
    block that activation checkpointing recomputes counts once)."""

    @staticmethod
    def forward(ctx, y, aux, scale: float, layer):
        ctx.aux, ctx.scale, ctx.layer = aux.detach(), scale, layer
        return y

    @staticmethod
    def backward(ctx, grad):
        ctx.layer.aux_trained = ctx.layer.aux_trained + ctx.aux.float() * ctx.scale
        return grad, torch.full_like(ctx.aux, ctx.scale), None, None


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.ffn_hidden)
        self.shared = SwiGLU(cfg.dim, cfg.ffn_hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=False)
        # Slots each expert got since the last update_router_bias (fp32, for balancing and the step log).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self.dropped = 0  # slots dropped by capacity since the last read
        self.ep = None  # set by trainer.parallel.expert.apply_ep: the group this layer's experts are split over
        self.cp_group = None  # context parallelism: the cp group, whose slot counts f_e sums (module docstring)
        self.aux_scale: float | None = None  # pipelined: the aux loss's gradient scale (module docstring)
        self.aux_trained: torch.Tensor | float = 0.0  # pipelined: the scaled aux losses trained since the last read

    def route(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen experts (T, k), their weights (T, k), the aux loss) of tokens ``t`` (T, dim); fp32."""
        logits = F.linear(t.float(), self.router.weight.float())
        scores = logits.softmax(dim=-1)
        with torch.no_grad():
            idx = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / w.sum(dim=-1, keepdim=True)
        load = torch.bincount(idx.flatten(), minlength=self.n_experts).float()
        slots = idx.numel()
        if self.cp_group is not None:  # f_e over the whole sequence: every cp rank routes an equal share
            import torch.distributed as dist

            dist.all_reduce(load, group=self.cp_group)
            slots *= dist.get_world_size(self.cp_group)
        aux = self.n_experts * (load / slots * scores.mean(dim=0)).sum()
        return idx, w, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        idx, w, aux = self.route(t)
        self.aux_loss = aux * self.aux_loss_coef
        flat = idx.flatten()
        order = flat.argsort(stable=True)  # slots sorted by expert, token order within one
        counts = torch.bincount(flat, minlength=self.n_experts)
        # training only, and not activation checkpointing's rerun in backward
        counting = self.training and torch._C._current_graph_task_id() == -1
        if counting:
            with torch.no_grad():
                self.tokens_per_expert += counts.float()
        if self.capacity_factor > 0:
            cap = math.ceil(self.capacity_factor * flat.numel() / self.n_experts)
            starts = counts.cumsum(0) - counts
            rank_in_expert = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
            keep = rank_in_expert < cap
            self.dropped += int((~keep).sum()) if counting else 0
            order = order[keep]
            counts = counts.clamp(max=cap)
        slots = t[order // self.top_k]
        if self.ep is None:
            out_sorted = self.experts(slots, counts.tolist())  # an idle expert: an empty group
        else:
            out_sorted = self.ep.run(self.experts, slots, counts)
        out = t.new_zeros(flat.numel(), shape[-1])
        out = out.index_copy(0, order, out_sorted)
        y = (out.view(-1, self.top_k, shape[-1]) * w.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        if self.shared is not None:
            y = y + self.shared(t)
        if self.aux_scale is not None and torch.is_grad_enabled():
            y = AuxLossToBackward.apply(y, self.aux_loss, self.aux_scale, self)
        elif self.aux_scale is not None:  # a pipelined evaluation: no backward to count it in
            self.aux_trained = self.aux_trained + self.aux_loss.detach().float() * self.aux_scale
        return y.view(shape)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(layers: list[MoE]) -> torch.Tensor | None:
    """The sum of the aux losses of ``layers``' last forward (None without any)."""
    losses = [m.aux_loss for m in layers if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


@dataclass(frozen=True)
class BalanceStats:
    """One step's routing over the data-parallel ranks (:func:`balance_step`)."""

    imbalance: float  # the largest max / mean slots per expert over the MoE layers (0 without MoE layers)
    tokens_per_expert: dict[str, list[float]]  # routed slots per expert, by MoE layer (its block's index)
    dropped: int  # slots dropped by capacity (capacity_factor > 0), all layers
    # pipelined: every stage's routing biases (router_bias_state), gathered for the checkpoint; None unpipelined
    router_bias: dict[str, list[float]] | None = None


@torch.no_grad()
def balance_step(model: nn.Module | list[nn.Module], rate: float, group=None, pp_group=None) -> BalanceStats:
    """After a step: the load of every MoE layer of ``model`` (or of each of a rank's pipeline stages), and
    the slots capacity dropped, summed over ``group`` (the ranks that route different tokens through the same
    layers: data-parallel, and cp) in one all-reduce, each expert's routing bias moved by ``rate`` toward the
    mean load (DeepSeek-V3's auxiliary-loss-free balancing; a no-op at rate 0), the counters cleared. Under
    pipeline parallelism the stages' figures are gathered over ``pp_group`` for the step log."""
    import torch.distributed as dist

    # The built-in layers, and a model's own sparse blocks that count their load (trainer.models.hf.moe)
    named = [(name, m) for part in _parts(model)
             for name, m in part.named_modules() if isinstance(m, MoE) or hasattr(m, "etrain_counts_load")]
    stats = BalanceStats(0.0, {}, 0)
    if named:
        loads = torch.stack([m.tokens_per_expert for _, m in named])
        dropped = torch.tensor([float(m.dropped) for _, m in named], device=loads.device)
        both = torch.cat([loads, dropped.unsqueeze(1)], dim=1)
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(both, group=group)
        loads = both[:, :-1]
        ratio = float((loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-9)).max())
        for (_, m), load in zip(named, loads):
            if rate > 0 and isinstance(m, MoE):
                m.expert_bias += rate * torch.sign(load.mean() - load)
            m.tokens_per_expert.zero_()
            m.dropped = 0
        by_layer = {layer_label(name): load.tolist() for (name, _), load in zip(named, loads)}
        stats = BalanceStats(ratio, by_layer, int(both[:, -1].sum()))
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return stats
    every: list = [None] * dist.get_world_size(pp_group)  # each stage's layers: a few numbers per expert
    dist.all_gather_object(every, (stats, router_bias_state(model)), group=pp_group)
    return BalanceStats(max(s.imbalance for s, _ in every),
                        {k: v for s, _ in every for k, v in s.tokens_per_expert.items()},
                        sum(s.dropped for s, _ in every), {k: v for _, bias in every for k, v in bias.items()})


def keep_counters(layers: list[MoE]) -> Callable[[], None]:
    """The restore of ``layers``' routing counters (slots per expert, dropped, the pipelined aux losses) to
    what they are now: for a forward and backward that must not count (trainer.parallel.pipeline)."""
    saved = [(m, m.tokens_per_expert.clone(), m.dropped, m.aux_trained) for m in layers]

    @torch.no_grad()
    def restore() -> None:
        for m, tokens, dropped, aux in saved:
            m.tokens_per_expert.copy_(tokens)
            m.dropped, m.aux_trained = dropped, aux
    return restore


def _parts(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """A model, or a rank's pipeline stages, as a list of modules."""
    return model if isinstance(model, list) else [model]


def layer_label(path: str) -> str:
    """A MoE layer's label in metrics: its block's index (``layers.3.feed_forward`` -> ``3``), else its path."""
    parts = path.split(".")
    if "layers" in parts[:-2]:  # the built-in "layers.3.feed_forward", transformers' "model.layers.3.mlp"
        return parts[parts.index("layers") + 1]
    return path


def update_router_bias(model: nn.Module, rate: float, group=None) -> float:
    """:func:`balance_step`, its load-imbalance ratio alone."""
    return balance_step(model, rate, group).imbalance


def router_bias_state(model: nn.Module | list[nn.Module]) -> dict[str, list[float]]:
    """The routing biases that auxiliary-loss-free balancing moved, by MoE layer path (for the checkpoint's
    trainer state: a run resumes with them, at any ep); {} while all are zero. ``model``: or a rank's stages."""
    return {name: m.expert_bias.tolist() for part in _parts(model)
            for name, m in part.named_modules() if isinstance(m, MoE) and bool(m.expert_bias.any())}


@torch.no_grad()
def load_router_bias(model: nn.Module | list[nn.Module], state: dict[str, list[float]]) -> None:
    for part in _parts(model):
        for name, m in part.named_modules():
            if isinstance(m, MoE):
                m.expert_bias.copy_(torch.tensor(state.get(name, [0.0] * m.n_experts), dtype=m.expert_bias.dtype))
