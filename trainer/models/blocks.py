"""A model's repeated blocks (the unit of FSDP, activation checkpointing and pipeline cuts), for the models
a user brings.

    named = find_blocks(model, cfg.model)                  # [(path, module)], in order
    ranges = stage_ranges([n for n, _ in named], 4, [])    # the blocks of each of 4 pipeline stages
    apply_block_ac([m for _, m in named], "every_k", 2)    # composable checkpointing: no wrapper, FQNs kept
    checkpoint(fn, x, context_fn=selective_context)         # "selective": keep matmul outputs, recompute the rest

Blocks are modules whose class is ``model.block_class``, else the model's own ``_no_split_modules``
(``transformers``), else the children of its first ``nn.ModuleList``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import torch
from torch import nn

from checkpointing.errors import ConfigError

from ..config import ModelConfig


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered meanwhile moves to the meta device as it is registered."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def shares_parameters(model: nn.Module) -> bool:
    """Whether one parameter is registered under two names (tied embeddings)."""
    return len(list(model.named_parameters(remove_duplicate=False))) != len(list(model.parameters()))


def find_blocks(model: nn.Module, mcfg: ModelConfig) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, in order (module docstring): ConfigError when there are none."""
    names = {mcfg.block_class} if mcfg.block_class else set(getattr(model, "_no_split_modules", None) or ())
    if names:
        blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in names]
        if not blocks:
            field = "model.block_class" if mcfg.block_class else "the model's _no_split_modules"
            raise ConfigError(f"{field} names {sorted(names)}, but the model has no module of that class; "
                              "set model.block_class to the class of its repeated layer")
        return blocks
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            return [(f"{name}.{k}", child) for k, child in m.named_children()]
    raise ConfigError("the model has no nn.ModuleList of blocks; set model.block_class to the class of its "
                      "repeated layer (the unit of FSDP and activation checkpointing)")


def stage_ranges(block_names: list[str], n_stages: int, split_points: list[str]) -> list[range]:
    """Block index ranges per pipeline stage: starting at ``split_points`` (block paths), else even."""
    if n_stages > len(block_names):
        raise ConfigError(f"{n_stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank) exceed the "
                          f"model's {len(block_names)} blocks; use at most {len(block_names)} stages")
    if not split_points:
        base, extra = divmod(len(block_names), n_stages)
        starts = [s * base + min(s, extra) for s in range(n_stages)]
    else:
        if len(split_points) != n_stages - 1:
            raise ConfigError(f"model.pp_split_points has {len(split_points)} entries; {n_stages} stages need "
                              f"{n_stages - 1} (the block where each stage after the first begins)")
        unknown = [x for x in split_points if x not in block_names]
        if unknown:
            raise ConfigError(f"model.pp_split_points: {unknown} are not blocks of the model; blocks are "
                              f"{block_names[0]!r} .. {block_names[-1]!r}")
        starts = [0] + [block_names.index(x) for x in split_points]
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ConfigError(f"model.pp_split_points={split_points} must name blocks in increasing order, "
                              "none of them the first")
    ends = starts[1:] + [len(block_names)]
    return [range(a, b) for a, b in zip(starts, ends)]


def apply_block_ac(blocks: list[nn.Module], mode: str, every_k: int) -> None:
    """Activation checkpointing per block with the composable API (no wrapper: FQNs stay the model's)."""
    from torch.distributed._composable import checkpoint

    for i, block in enumerate(blocks):
        if mode == "selective":
            checkpoint(block, context_fn=selective_context)
        elif mode == "full" or (mode == "every_k" and i % every_k == 0):
            checkpoint(block)


@functools.cache
def saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps (torchtitan's op-level policy): the matmuls and
    attention kernels, the costly part to recompute, and the results of tensor parallelism's reduce-scatters and
    all-reduces (never communicated again in backward)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    c10d = getattr(torch.ops, "_c10d_functional", None)
    for name in ("reduce_scatter_tensor", "all_reduce"):  # tensor parallelism's: never communicated twice
        if c10d is not None and hasattr(c10d, name):
            ops.add(getattr(c10d, name).default)
    return frozenset(ops)


def _keep_matmuls(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """``context_fn`` of ``torch.utils.checkpoint``: save what :func:`saved_ops` produce, recompute the rest
    (norms, activations, rotary embeddings, elementwise products) in backward."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_matmuls)
