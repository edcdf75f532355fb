"""``[health]``: the checks for faults that do not announce themselves, and what a run does about them.

    [health]
    check_every_steps = 16     # digests of the state compared every 16 steps (0: no checks)
    spike_zscore = 8.0         # a loss or gradient norm this many robust deviations above the window's median
    spike_window = 64          # steps the median and MAD are taken over
    rollback_depth = 3         # verified snapshots kept: the newest, one of every 16 checks, one of every 256
    on_persistent = "evict"    # a fault that follows one rank: "evict" it (Ray) or "stop" the run
    max_skipped_batches = 8    # batches skipped as the data's fault before the run stops and says why

or ``--set health.check_every_steps=0``. :mod:`trainer.health` does the checking (docs/operations.md#silent-faults).
``faults`` is for ``etrain chaos`` (its ``bitflip`` and ``poison_batch`` faults, as the trainer gets them).
Parsed once, here; the trainer and the orchestrator read this value, never the raw table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from checkpointing.errors import ConfigError

from .checks import check_range

MAX_CHECK_EVERY = 1 << 20
BITFLIP_TARGETS = ("param", "grad", "optimizer", "activation")
FAULT_KINDS = ("bitflip", "poison_batch")


@dataclass(kw_only=True)
class HealthConfig:
    """Silent-fault detection and response (docs/operations.md#silent-faults)."""

    # Every N steps the state's digests are compared across the ranks that hold the same shard, and a
    # step that passes becomes a verified snapshot; 0 turns the checks (and the rollback) off.
    check_every_steps: int = 16
    # A loss or gradient norm above median + spike_zscore x 1.4826 x MAD of the last spike_window steps is a spike.
    spike_zscore: float = 8.0
    spike_window: int = 64
    # Verified snapshots kept in host memory as a sparse ring: the newest check, the newest of every 16th
    # check, of every 256th... (rollback_depth of them), for faults found late.
    rollback_depth: int = 3
    on_persistent: Literal["evict", "stop"] = "evict"
    # Batches skipped as the data's fault (a spike every replay reproduces) before the run stops.
    max_skipped_batches: int = 8
    # In-process faults for chaos tests: {"kind": "bitflip"|"poison_batch", "step": N, "rank": R, ...}.
    faults: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("check_every_steps", "spike_window", "rollback_depth", "max_skipped_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"health.{name}={v!r:.40} must be a whole number")
        check_range("health", "check_every_steps", self.check_every_steps, 0, MAX_CHECK_EVERY,
                    "steps between checks; 0 turns the checks off")
        if isinstance(self.spike_zscore, bool) or not isinstance(self.spike_zscore, (int, float)):
            raise ConfigError(f"health.spike_zscore={self.spike_zscore!r:.40} must be a number, e.g. 8.0")
        if not 2.0 <= float(self.spike_zscore) <= 1e6:
            raise ConfigError(f"health.spike_zscore={self.spike_zscore} must be in [2, 1e6]: below 2 ordinary noise "
                              "counts as a spike; 8 is the default")
        check_range("health", "spike_window", self.spike_window, 16, 1 << 16,
                    "steps; the median and MAD need at least 16")
        check_range("health", "rollback_depth", self.rollback_depth, 1, 8,
                    "verified snapshots kept in host memory (1: the newest only)")
        if self.on_persistent not in ("evict", "stop"):
            raise ConfigError(f'health.on_persistent={self.on_persistent!r:.40} must be "evict" (the rank leaves, '
                              'its node is quarantined) or "stop" (the run suspends at its last verified step)')
        check_range("health", "max_skipped_batches", self.max_skipped_batches, 0, 1 << 20,
                    "batches; 0 stops the run at the first batch found to be the data's fault")
        if not isinstance(self.faults, list):
            raise ConfigError('health.faults must be a list of tables, e.g. [{kind = "bitflip", step = 20, rank = 1}]')
        for i, f in enumerate(self.faults):
            check_fault(f, f"health.faults[{i}]")

    @property
    def enabled(self) -> bool:
        return self.check_every_steps > 0


def check_fault(f, where: str) -> None:
    """One in-process fault as ``etrain chaos`` writes it; ConfigError naming the field otherwise."""
    if not isinstance(f, dict):
        raise ConfigError(f"{where} must be a table with kind and step")
    kind = f.get("kind")
    if kind not in FAULT_KINDS:
        raise ConfigError(f"{where}.kind={kind!r:.40} must be one of {', '.join(FAULT_KINDS)}")
    allowed = {"kind", "step", "rank", "target", "bit", "persistent", "seed", "element"}
    extra = set(f) - allowed
    if extra:
        raise ConfigError(f"{where} has unknown keys {sorted(extra)!r:.80}; known: {sorted(allowed)}")
    for key in ("step", "rank", "bit", "seed", "element"):
        v = f.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ConfigError(f"{where}.{key}={v!r:.40} must be a whole number >= 0")
    if not isinstance(f.get("step"), int) or f["step"] < 1:
        raise ConfigError(f"{where}.step must name the step (numbered from 1) the fault happens at")
    if kind == "bitflip":
        if f.get("target", "param") not in BITFLIP_TARGETS:
            raise ConfigError(f"{where}.target={f.get('target')!r:.40} must be one of {', '.join(BITFLIP_TARGETS)}")
        if f.get("bit") is not None and f["bit"] > 63:
            raise ConfigError(f"{where}.bit={f['bit']} must be a bit of the element: 0-31 for fp32, 0-15 for bf16")
        if not isinstance(f.get("persistent", False), bool):
            raise ConfigError(f"{where}.persistent must be true or false")
