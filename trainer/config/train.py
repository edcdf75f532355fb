"""``[train]``: steps, batch sizes, the optimizer and the schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from checkpointing.errors import ConfigError

from .checks import MAX_SAMPLES, check_finite, check_range


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation: steps, batch, AdamW and the learning-rate schedule."""

    steps: int = 200
    # Samples per optimizer step, fixed for the whole run whatever the world
    # size: gradient accumulation absorbs the data-parallel degree.
    global_batch: int = 8
    # Samples per forward pass on one data-parallel rank.
    micro_batch: int = 4
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # AdamW's kernels: "auto" is fused where the parameters are on a GPU (one kernel for all of them),
    # foreach (a kernel per operation over all of them) elsewhere; the results agree to rounding.
    optimizer_impl: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    seed: int = 1234
    log_every: int = 10
    # A step whose loss or gradient norm is nan/inf stops the run (exit 1 / FAILED, naming the step);
    # true: its update is skipped instead (counted and logged), the data cursor moving on.
    skip_nonfinite_steps: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 1")
        for name in ("global_batch", "micro_batch"):
            check_range("train", name, getattr(self, name), 1, MAX_SAMPLES, "samples")
        check_range("train", "seed", self.seed, -2**63, 2**63 - 1, "a 64-bit integer")
        if self.micro_batch > self.global_batch:
            raise ConfigError(
                f"train.micro_batch={self.micro_batch} is larger than train.global_batch={self.global_batch}; "
                f"use micro_batch <= {self.global_batch}"
            )
        check_finite(self, "train")
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay={self.weight_decay} must be >= 0 (0 disables it)")
        if self.eps <= 0:
            raise ConfigError(f"train.eps={self.eps} must be > 0 (AdamW's denominator term, e.g. 1e-8)")
