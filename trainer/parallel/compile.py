"""``parallel.compile``: ``torch.compile`` per repeated block, after TP and activation checkpointing, before FSDP.

    check_compile(pcfg, device)        # ConfigError (exit 2) when inductor cannot build for the device
    apply_compile(spec, stage, pcfg)   # every block of the stage compiled in place (FQNs unchanged)

As torchtitan does it: the blocks are the unit because they repeat (one graph, reused by every block
of the same shapes) and hold all the compute that fuses well; the embedding and the output head stay
eager. Each block is compiled in place (``nn.Module.compile``), not wrapped, so parameter names,
checkpoints and exports do not change. ``fullgraph`` where the model's spec says its blocks allow it
(:attr:`trainer.models.spec.ModelSpec.compile_fullgraph`: the built-in decoder's do; a model a user
brings may break the graph, which then runs the breaks eagerly).

Compilation is lazy: the first step of each shape compiles (seconds to minutes), later ones reuse it.
"""

from __future__ import annotations

import os
import shutil

import torch

from checkpointing.errors import ConfigError

from ..config import ParallelConfig


def compiler_missing(device: torch.device) -> str | None:
    """Why inductor cannot build kernels for ``device``, or None when it can."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "triton is not importable (the CUDA backend of inductor needs it)"
    cxx = os.environ.get("CXX") or "g++"
    if not any(shutil.which(c) for c in (cxx, "c++", "clang++")):
        return f"no C++ compiler on PATH ({cxx}, c++ or clang++; inductor builds CPU kernels with one)"
    return None


def check_compile(pcfg: ParallelConfig, device: torch.device) -> None:
    """ConfigError naming ``parallel.compile`` when it is on and this machine cannot compile for ``device``."""
    if not pcfg.compile:
        return
    why = compiler_missing(device)
    if why:
        raise ConfigError(f"parallel.compile=true cannot work here: {why}; install it, or set parallel.compile=false")


def apply_compile(spec, stage, pcfg: ParallelConfig) -> None:
    """Compile each of ``stage``'s blocks in place when ``parallel.compile`` is on."""
    if not pcfg.compile:
        return
    for block in stage.blocks:
        block.compile(fullgraph=spec.compile_fullgraph)
