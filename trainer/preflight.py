"""The checks a run passes before any process group starts, one list for every way a run starts.

    info = preflight(cfg, world_size=4, rank=0, device=device)   # `etrain train` on each rank
    info = preflight(cfg, world_size=ecfg.workers)                # the driver of `etrain run` / `submit`

Each check raises ``ConfigError`` (exit 2) naming the field and the fix: the layout at this world size, what
the device can do (only where the device is known: a rank), the NVMe offload's directory and room (this
rank's share), the model's family against the run, and ``model.init_from``'s shapes. What only one launcher
does stays with it: `etrain train` loads the corpus and takes the writer lock, the driver sizes the elastic
range and tokenizes once for every worker.
"""

from __future__ import annotations

import torch

from .config import RunConfig
from .export.convert import init_from_preflight
from .models import ModelInfo, model_preflight
from .parallel.dims import ParallelDims
from .parallel.parallelize import check_device_features
from .zero.offload import offload_preflight


def preflight(cfg: RunConfig, *, world_size: int, rank: int = 0, device: torch.device | None = None
              ) -> ModelInfo | None:
    """Every check of the module's list for ``cfg`` at ``world_size`` (as rank ``rank``, on ``device`` when it is
    known); what a model a user brings turned out to be (None for the built-in one)."""
    ParallelDims.from_config(cfg, world_size)
    if device is not None:
        check_device_features(cfg.parallel, device)
    offload_preflight(cfg, world_size, rank)  # parallel.offload="nvme": its directory and room
    info = model_preflight(cfg)
    if cfg.model.init_from and not cfg.checkpoint.resume:  # its shapes, before any process group
        init_from_preflight(cfg)
    return info
