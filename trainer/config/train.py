"""``[train]``: steps, batch sizes, the optimizer and the learning-rate schedule.

    t = TrainConfig(steps=100, warmup_steps=10, lr_schedule="wsd", decay_ratio=0.2)
    t.lr_at(0), t.lr_at(50), t.lr_at(99)      # 3e-4 (warming up), 3e-3 (stable), 3e-4 (decayed to the floor)

The learning rate is a pure function of the step and these fields (:meth:`TrainConfig.lr_at`): nothing
about it is saved, so a run resumed on any world size trains each step at the rate it would have had.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

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
    # The floor every decaying schedule ends at, as a fraction of lr (TorchTitan's min_lr_factor).
    min_lr_ratio: float = 0.1
    # Linear warmup to lr over the first warmup_steps steps, in every schedule.
    warmup_steps: int = 10
    # After the warmup: "cosine" to lr * min_lr_ratio; "linear" to lr * min_lr_ratio at the last step;
    # "constant" stays at lr; "wsd" (warmup-stable-decay) stays at lr, then decays to lr * min_lr_ratio
    # over the last decay_steps (or decay_ratio x steps) steps, shaped by decay_type.
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    # "wsd" only: the decay's share of train.steps (rounded to whole steps), unless decay_steps is set.
    decay_ratio: float = 0.1
    # "wsd" only: the decay's length in steps; 0 leaves it to decay_ratio.
    decay_steps: int = 0
    # "wsd" only: the decay's shape: 1 - p ("linear"), 1 - sqrt(p) ("sqrt"), half a cosine ("cosine").
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
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
        self._check_schedule()
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay={self.weight_decay} must be >= 0 (0 disables it)")
        if self.eps <= 0:
            raise ConfigError(f"train.eps={self.eps} must be > 0 (AdamW's denominator term, e.g. 1e-8)")

    def _check_schedule(self) -> None:
        """``lr_schedule`` and the ``wsd`` keys: known names, and a decay that fits in the run."""
        if self.lr_schedule not in SCHEDULES:
            raise ConfigError(f"train.lr_schedule={self.lr_schedule!r} must be one of {_quoted(SCHEDULES)}")
        if self.decay_type not in DECAY_TYPES:
            raise ConfigError(f"train.decay_type={self.decay_type!r} must be one of {_quoted(DECAY_TYPES)} "
                              '(the shape of train.lr_schedule="wsd"\'s decay)')
        if not 0.0 <= self.decay_ratio <= 1.0:
            raise ConfigError(f"train.decay_ratio={self.decay_ratio} must be in [0, 1] (the share of train.steps "
                              "the decay takes), e.g. 0.1")
        if self.decay_steps < 0:
            raise ConfigError(f"train.decay_steps={self.decay_steps} must be >= 0 (0: train.decay_ratio decides)")
        if self.lr_schedule != "wsd":
            return
        decay = self.wsd_decay_steps
        if self.warmup_steps + decay > self.steps:
            given = (f"train.decay_steps={self.decay_steps}" if self.decay_steps
                     else f"train.decay_ratio={self.decay_ratio} of train.steps={self.steps}: {decay} step(s)")
            room = self.steps - self.warmup_steps
            fix = (f"make the decay at most {room} step(s)" if room > 0
                   else f"lower train.warmup_steps below {self.steps}")
            raise ConfigError(
                f'train.lr_schedule="wsd": train.warmup_steps={self.warmup_steps} plus the decay ({given}) exceed '
                f"train.steps={self.steps}; {fix}, or raise train.steps")

    @property
    def wsd_decay_steps(self) -> int:
        """Steps of the ``wsd`` schedule's decay: ``decay_steps``, else ``decay_ratio`` of ``steps``, rounded
        half up."""
        # in decimal, as written (0.15 x 30 = 4.5 -> 5), and exact for any train.steps
        return self.decay_steps or math.floor(Fraction(repr(self.decay_ratio)) * self.steps + Fraction(1, 2))

    def inert_keys(self) -> list[str]:
        """The schedule keys set away from their defaults that this ``lr_schedule`` does not read."""
        unread = {"cosine": _WSD_KEYS, "linear": _WSD_KEYS, "constant": (*_WSD_KEYS, "min_lr_ratio"), "wsd": ()}
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [f"train.{k}" for k in unread[self.lr_schedule] if getattr(self, k) != defaults[k]]

    def schedule_moves(self, saved: dict[str, Any], step: int) -> str:
        """For a resume at ``step`` from a checkpoint whose recorded config differs in ``saved`` (field ->
        its value there): "" unless a field the schedule reads (:data:`SCHEDULE_KEYS`) is among them, else
        which ones moved the schedule and, when the recorded values make a valid schedule (they are data,
        checked like any input), the rate ``step`` trains at now and would have before."""
        moved = {k: v for k, v in saved.items() if k in SCHEDULE_KEYS}
        if not moved:
            return ""
        what = f"; the learning-rate schedule moves ({', '.join('train.' + k for k in moved)})"
        was = self._with_saved(moved)
        return what + (f": step {step} trains at lr {self.lr_at(step):.4g}, not {was.lr_at(step):.4g}"
                       if was is not None else "")

    def _with_saved(self, saved: dict[str, Any]) -> TrainConfig | None:
        """This config with the recorded schedule values ``saved``, or None when they are ill-typed or invalid."""
        for key, value in saved.items():
            want = type(getattr(self, key))
            if isinstance(value, bool) or not isinstance(value, (int, float) if want is float else want):
                return None
        try:
            return dataclasses.replace(self, **saved)
        except (ConfigError, TypeError, ValueError):
            return None

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based: the step log's step ``step + 1``).

        Every schedule warms up linearly: step s < warmup_steps trains at ``lr * (s + 1) / warmup_steps``.
        Then ``cosine`` follows half a cosine from lr towards ``floor = lr * min_lr_ratio``, reaching it at
        step ``steps`` (one past the last); ``linear`` falls from lr in equal steps and trains the last step
        at the floor; ``constant`` stays at lr; ``wsd`` stays at lr until the last ``d`` steps
        (:attr:`wsd_decay_steps`), whose i-th (1-based) trains at ``floor + (lr - floor) * shape(i / d)``,
        so the last step trains at the floor. Steps past ``steps`` keep the floor (or lr)."""
        w = self.warmup_steps
        if w and step < w:
            return self.lr * (step + 1) / w
        floor = self.lr * self.min_lr_ratio
        if self.lr_schedule == "constant":
            return self.lr
        if self.lr_schedule == "cosine":
            progress = min(1.0, (step - w) / max(1, self.steps - w))
            return floor + (self.lr - floor) * _SHAPES["cosine"](progress)
        if self.lr_schedule == "linear":
            progress = min(1.0, (step - w + 1) / max(1, self.steps - w))
            return floor + (self.lr - floor) * _SHAPES["linear"](progress)
        decay = self.wsd_decay_steps
        start = self.steps - decay  # the decay's first step
        if step < start or not decay:
            return self.lr
        progress = min(1.0, (step - start + 1) / decay)
        return floor + (self.lr - floor) * _SHAPES[self.decay_type](progress)


def _quoted(names: tuple[str, ...]) -> str:
    return ", ".join(f'"{n}"' for n in names)


SCHEDULES = ("cosine", "linear", "constant", "wsd")
# The fields the learning-rate schedule reads: a checkpoint recorded under other values of them moves it.
SCHEDULE_KEYS = ("steps", "warmup_steps", "lr", "min_lr_ratio", "lr_schedule", "decay_ratio", "decay_steps",
                 "decay_type")
DECAY_TYPES = ("linear", "sqrt", "cosine")
# What remains of the way from lr down to the floor at progress p in [0, 1] (1 at p = 0, 0 at p = 1).
_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}
_WSD_KEYS = ("decay_ratio", "decay_steps", "decay_type")
