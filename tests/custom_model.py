"""A model a user brings with ``[model] source = "python"``: any nn.Module from a factory.

Deliberately not a transformer and not built from etrain code: an embedding, a stack of residual
MLP blocks in an ``nn.ModuleList``, a norm and a head; its own weight names.
"""

from __future__ import annotations

import torch
from torch import nn


class MixerBlock(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyMixer(nn.Module):
    def __init__(self, vocab: int, width: int, hidden: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.trunk = nn.ModuleList(MixerBlock(width, hidden) for _ in range(depth))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.trunk:
            h = block(h)
        return self.head(self.final_norm(h))


def build(table: dict) -> nn.Module:
    """The factory: receives the whole [model] table; its own knobs live under [model.args]."""
    args = table["args"]
    return TinyMixer(table["vocab_size"], args.get("width", 48), args.get("hidden", 96), args.get("depth", 3))


def tp_plan(model: TinyMixer, tp_mesh) -> dict:
    """A user's tensor-parallel plan: the MLPs column- then row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.trunk)):
        plan[f"trunk.{i}.up"] = ColwiseParallel()
        plan[f"trunk.{i}.down"] = RowwiseParallel()
    return plan


def not_a_module(table: dict):
    return {"weights": [1, 2, 3]}


def smoothed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss of the user's own: label-smoothed cross-entropy."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), label_smoothing=0.1)
