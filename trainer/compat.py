"""The torch releases etrain runs on (2.11, 2.12, 2.13) and the few places they differ.

    from trainer import compat
    compat.all_gather_single(out, mine, group=g)

Every call into an API that one of the supported releases lacks goes through
one function here; each picks what the installed torch has (by looking for
the attribute, not by comparing versions), so a release in between works too.
``make test-compat`` runs a subset of the tests on torch 2.11; ``make test``
runs the pinned newest (docs/dependencies.md).

Shims, and the releases that need them:

* :func:`all_gather_single`: ``torch.distributed.all_gather_single`` is new in
  2.13 (which deprecates ``all_gather_into_tensor``); 2.11 and 2.12 have only
  ``all_gather_into_tensor`` (same arguments, same result).
* :func:`reduce_scatter_single`: likewise ``reduce_scatter_single`` (2.13)
  against ``reduce_scatter_tensor`` (2.11, 2.12).

The function is looked up on ``torch.distributed`` at every call, so the
communication meter's wrappers (trainer.observe.telemetry, which meters both names)
see it.

* :func:`fsdp_comm_bases`: FSDP2's custom collectives (``FSDPModule.set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` and their ``AllGather`` / ``ReduceScatter`` bases, which ZeRO++ under
  ZeRO-3 plugs into) exist in 2.11 and 2.13 alike; a torch without them is refused by name.

Differences met by code that suits every release, so without a shim:

* ``torch.distributed.pipelining`` in 2.11 checks a stage's input strides
  against the ones it inferred: ``trainer.parallel.pipeline.Pipeline`` hands the
  first stage contiguous tokens.
* ``DeviceMesh._unflatten`` in 2.11 refuses a dim given by its name (its check is
  inverted): ``ParallelDims.expert_mesh`` (expert parallelism) gives its index.

CI tests the ends of the range (``make test`` on 2.13, ``make test-compat`` on
2.11: tests/test_compat.py and the tests marked ``compat``); 2.12 was checked
by hand against the same list (it has the 2.11 names of both collectives).
"""

from __future__ import annotations

import torch.distributed as dist


def _collective(new: str, old: str):
    """``torch.distributed.<new>`` where this torch has it, else ``<old>`` (looked up now, not at import)."""
    fn = getattr(dist, new, None)
    return fn if fn is not None else getattr(dist, old)


def all_gather_single(output_tensor, input_tensor, group=None, async_op: bool = False):
    """Every rank's ``input_tensor`` concatenated into ``output_tensor`` (torch >= 2.13: ``all_gather_single``;
    older: ``all_gather_into_tensor``)."""
    return _collective("all_gather_single", "all_gather_into_tensor")(output_tensor, input_tensor, group=group,
                                                                      async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``input`` summed over the group, this rank's ``output``-sized piece of it (torch >= 2.13:
    ``reduce_scatter_single``; older: ``reduce_scatter_tensor``)."""
    return _collective("reduce_scatter_single", "reduce_scatter_tensor")(output, input, op=op, group=group,
                                                                         async_op=async_op)


def fsdp_comm_bases():
    """FSDP2's ``(AllGather, ReduceScatter)`` interfaces for ``set_custom_all_gather`` /
    ``set_custom_reduce_scatter``, or None where this torch has no such hooks."""
    from torch.distributed.fsdp import FSDPModule

    if not (hasattr(FSDPModule, "set_custom_all_gather") and hasattr(FSDPModule, "set_custom_reduce_scatter")):
        return None
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:
        return None
    return AllGather, ReduceScatter


def require_fsdp_comm_bases():
    """:func:`fsdp_comm_bases`, or a ConfigError naming the keys and the fix where this torch has none."""
    bases = fsdp_comm_bases()
    if bases is None:
        import torch

        from checkpointing.errors import ConfigError

        raise ConfigError(f"parallel.quantized_weights / quantized_gradients at zero_stage=3 need FSDP2's "
                          f"custom all-gather and reduce-scatter hooks, which torch {torch.__version__} lacks; "
                          "use torch >= 2.11, or zero_stage=2")
    return bases
