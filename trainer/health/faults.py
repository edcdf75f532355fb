"""In-process faults for chaos tests: bits flipped in a rank's state, gradients or activations, and poisoned
batches (``[health] faults``, as ``etrain chaos`` writes its ``bitflip`` and ``poison_batch`` faults).

    faults = Faults(cfg.health.faults, rank, seed)
    faults.at_boundary(step, leaves)          # param / optimizer flips, before step ``step`` computes
    faults.on_grads(step, grads)              # grad flips, once the step's gradients are reduced
    hook = faults.activation_hook(step)       # activation flips: a forward hook for the step, or None
    targets = faults.poison(step, targets, vocab)   # poison_batch: the step's targets shifted by vocab / 2

A transient fault fires once, the first time its step is computed (a replay of that step is clean); one
with ``persistent = true`` fires at its step and every step after it on that rank, replays included, as a
bad core would. A poisoned batch is the data's: every computation of that step, on every rank, sees it.
Which element and bit: ``element`` and ``bit`` when given, else drawn from (seed, step, rank); the default
bit is the sign or one of the exponent's top four bits (the flips that matter).
"""

from __future__ import annotations

import logging
import random

import torch

log = logging.getLogger("etrain")

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit ``bit`` of element ``index`` of ``t`` (flattened), in place."""
    flat = t.view(-1) if t.is_contiguous() else None
    if flat is None:
        raise ValueError("cannot flip a bit in a tensor that is not contiguous")
    ints = flat.view(_INT[t.element_size()])
    width = t.element_size() * 8
    mask = (1 << bit) if bit < width - 1 else -(1 << (width - 1))  # the sign bit of a signed view
    ints[index : index + 1].bitwise_xor_(torch.tensor(mask, dtype=ints.dtype, device=ints.device))


def default_bit(rng: random.Random, element_size: int) -> int:
    width = element_size * 8
    mantissa = {16: 7, 32: 23, 64: 52}.get(width, width - 9)
    return rng.choice([width - 1] + [width - 2 - i for i in range(4) if width - 2 - i >= mantissa])


def _key(spec: dict) -> tuple:
    """A fault's identity whatever rank its process holds now."""
    return tuple(sorted((k, str(v)) for k, v in spec.items() if k != "rank"))


class Faults:
    def __init__(self, specs: list[dict], rank: int, seed: int, fired: set | None = None):
        self.rank = rank
        self.seed = seed
        self.specs = [dict(s) for s in specs]
        # the transient faults that fired, by their content (a set the caller may keep across trainers)
        self.fired: set = fired if fired is not None else set()
        self.log: list[dict] = []  # what fired: kind, target, step, leaf, element, bit

    def _due(self, i: int, spec: dict, step: int, kind: str, target: str | None = None) -> bool:
        if spec["kind"] != kind or (target and spec.get("target", "param") != target):
            return False
        if kind == "bitflip" and spec.get("rank", 0) != self.rank:
            return False
        if spec.get("persistent"):
            return step >= spec["step"]
        return step == spec["step"] and _key(spec) not in self.fired

    def _rng(self, spec: dict, step: int) -> random.Random:
        return random.Random(f"{spec.get('seed', self.seed)}:{spec['step']}:{self.rank}:{spec.get('target')}")

    def _flip(self, i: int, spec: dict, step: int, named: list[tuple[str, torch.Tensor]], target: str) -> None:
        named = [(k, t) for k, t in named if t.numel() > 1]
        if not named:
            return
        rng = self._rng(spec, step)
        key, t = named[rng.randrange(len(named))]
        element = spec.get("element")
        element = rng.randrange(t.numel()) if element is None else element % t.numel()
        bit = spec.get("bit")
        bit = default_bit(rng, t.element_size()) if bit is None else min(bit, t.element_size() * 8 - 1)
        flip_bit(t, element, bit)
        self.fired.add(_key(spec))
        self.log.append({"kind": "bitflip", "target": target, "step": step, "rank": self.rank, "leaf": key,
                         "element": element, "bit": bit})
        log.warning("chaos: flipped bit %d of element %d of %s (%s) on rank %d at step %d", bit, element, key,
                    target, self.rank, step)

    def at_boundary(self, step: int, leaves: list[tuple[str, torch.Tensor]]) -> None:
        """Param and optimizer flips due before step ``step`` (numbered from 1) computes."""
        from .digest import local

        for i, spec in enumerate(self.specs):
            for target, prefix in (("param", "model."), ("optimizer", "optim.")):
                if self._due(i, spec, step, "bitflip", target):
                    self._flip(i, spec, step, [(k, local(t)) for k, t in leaves if k.startswith(prefix)], target)

    def on_grads(self, step: int, grads: list[tuple[str, torch.Tensor]]) -> None:
        for i, spec in enumerate(self.specs):
            if self._due(i, spec, step, "bitflip", "grad"):
                self._flip(i, spec, step, grads, "grad")

    def activation_hook(self, step: int):
        """A forward hook flipping one element of the module's output once (this step's first micro-batch)."""
        due = [(i, s) for i, s in enumerate(self.specs) if self._due(i, s, step, "bitflip", "activation")]
        if not due:
            return None
        i, spec = due[0]
        done = []

        def hook(module, inputs, output):
            if done or not isinstance(output, torch.Tensor) or not output.is_floating_point():
                return None
            from torch.distributed.tensor import DTensor

            if isinstance(output, DTensor):  # this rank's shard only: no collective on one rank
                mine = output._local_tensor.detach().clone().contiguous()
                self._flip(i, spec, step, [("activation", mine)], "activation")
                out = DTensor.from_local(mine, output.device_mesh, output.placements, run_check=False,
                                         shape=output.shape, stride=output.stride())
            else:
                out = output.detach().clone().contiguous()
                self._flip(i, spec, step, [("activation", out)], "activation")
            done.append(True)
            return output + (out - output.detach())  # the flipped values, gradients as before
        return hook

    def poisons(self, step: int) -> bool:
        return any(s["kind"] == "poison_batch" and s["step"] == step for s in self.specs)

    def poison(self, step: int, targets: torch.Tensor, vocab: int) -> torch.Tensor:
        """The step's targets, each shifted by half the vocabulary: every prediction the model learned is wrong."""
        if not self.poisons(step):
            return targets
        if not any(e.get("kind") == "poison_batch" and e["step"] == step for e in self.log):
            self.log.append({"kind": "poison_batch", "step": step, "rank": self.rank})
        return (targets + vocab // 2) % vocab
