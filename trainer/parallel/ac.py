"""Activation checkpointing: which blocks recompute their activations in backward.

What a block is, and how it is wrapped, is the model's (:meth:`trainer.models.spec.ModelSpec.apply_ac`);
this step only says when it runs in the order (:mod:`trainer.parallel.parallelize`).
"""

from __future__ import annotations

from ..config import ParallelConfig


def apply_ac(spec, stage, pcfg: ParallelConfig) -> None:
    """Checkpoint ``stage``'s blocks as ``parallel.activation_checkpoint`` (and ``ac_every_k``) ask."""
    spec.apply_ac(stage, pcfg.activation_checkpoint, pcfg.ac_every_k)
