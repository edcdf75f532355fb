"""The pre-flight fit check: warn before the first step when the layout is predicted not to fit the device.

    msg = fit_warning(cfg, world_size, device)            # None when it fits, or on a CPU
    warn_if_not_fitting(cfg, world_size, device)          # printed to stderr (python -m trainer, Ray workers)
    msg = fit_warning(cfg, 8, device, memory_bytes=80 * 2**30)   # with the device's memory given

On a GPU the device's memory is read from CUDA; on the CPU nothing is checked unless
``memory_bytes`` is given (host memory is shared by every process and swaps rather than fails).
The warning names the predicted bytes per rank, the device's, and the fastest layout the planner
finds that fits at the same world size, as the config fields to set.
"""

from __future__ import annotations

from ..config import RunConfig
from .accounting import Layout
from .cost import DEVICES, custom
from .search import HEADROOM, evaluate, plan_size

GiB = 2**30


def fit_warning(cfg: RunConfig, world_size: int, device, memory_bytes: int | None = None) -> str | None:
    """The warning text (module docstring), or None."""
    import torch

    if memory_bytes is None:
        if getattr(device, "type", "cpu") != "cuda":
            return None
        memory_bytes = torch.cuda.get_device_properties(device).total_memory
    from ..parallel.dims import resolve_precision
    from .shape import planning_config

    mixed = resolve_precision(cfg.parallel, torch.device(getattr(device, "type", "cpu"))) == torch.bfloat16
    dev = custom(DEVICES["h100"], name=str(device), memory=int(memory_bytes), mixed=mixed)
    plan_cfg = planning_config(cfg)
    own = evaluate(plan_cfg, Layout.of(plan_cfg, world_size), dev)
    if not own.valid or own.fits:
        return None
    need, have = own.memory["total"] / GiB, HEADROOM * memory_bytes / GiB
    msg = (f"the layout {own.layout.describe()} is predicted to need {need:.1f} GiB per rank, more than the "
           f"{have:.1f} GiB usable on {device}")
    res = plan_size(plan_cfg, world_size, dev, budget_s=1.0, losers=0)
    if res["best"] is not None:
        b = res["best"]
        msg += (f"; {b.layout.describe()} is predicted to fit ({b.memory['total'] / GiB:.1f} GiB): set "
                f"{b.layout.settings(cfg, world_size)} (etrain plan CONFIG shows why)")
    else:
        msg += f"; no layout at world size {world_size} is predicted to fit: add devices (etrain plan CONFIG)"
    return msg


def warn_if_not_fitting(cfg: RunConfig, world_size: int, device, memory_bytes: int | None = None) -> str | None:
    """Print :func:`fit_warning`'s text to stderr, if any (rank 0, before the first step at each size);
    a failed prediction never stops a run."""
    import logging
    import sys

    try:
        msg = fit_warning(cfg, world_size, device, memory_bytes)
    except Exception as e:  # noqa: BLE001 - a prediction must never stop a run
        logging.getLogger("etrain").debug("fit check skipped: %s", e)
        return None
    if msg:
        print(f"etrain: warning: {msg}", file=sys.stderr, flush=True)
    return msg
