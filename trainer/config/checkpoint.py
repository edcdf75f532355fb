"""``[checkpoint]``: where and how often checkpoints are written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from checkpointing.errors import ConfigError

from .checks import check_finite, check_storage_url


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often checkpoints are written (see the checkpointing package)."""

    url: str = ""
    interval_steps: int = 0
    # Upload in the background after a short blocking copy to host memory.
    async_save: bool = True
    # A save requested while another is in flight: "wait" for it or "skip".
    when_busy: Literal["wait", "skip"] = "wait"
    keep_last: int = 3
    keep_every: int = 0
    # Resume from the newest committed checkpoint under url, if there is one.
    resume: bool = False
    # Bound on one save's upload and commit; past it the save fails (training goes on).
    timeout_s: float = 600.0
    # Files and multipart parts in flight per rank.
    concurrency: int = 8
    # Storage fault injection for chaos testing (see checkpointing.storage.faults.StorageFaults).
    faults: dict = field(default_factory=dict)
    # This many saves failing in a row fail the run: its work is no longer being made durable.
    max_consecutive_failures: int = 3
    # A transformers export of every N-th committed step, in the background, at <url>/<run_id>/exports/step_N (0: none).
    export_every: int = 0

    def __post_init__(self) -> None:
        check_finite(self, "checkpoint")
        if self.url:
            check_storage_url(self.url, "checkpoint.url")
        if self.interval_steps < 0:
            raise ConfigError(f"checkpoint.interval_steps={self.interval_steps} must be >= 0 (0 disables)")
        if self.interval_steps > 0 and not self.url:
            raise ConfigError(
                f"checkpoint.interval_steps={self.interval_steps} needs checkpoint.url; "
                'set it to a directory such as "file:///tmp/ckpt" or "s3://bucket/prefix"'
            )
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 1")
        if self.keep_every < 0:
            raise ConfigError(f"checkpoint.keep_every={self.keep_every} must be >= 0 (0 keeps none extra)")
        if self.timeout_s <= 0:
            raise ConfigError(f"checkpoint.timeout_s={self.timeout_s} must be > 0")
        if self.concurrency < 1:
            raise ConfigError(f"checkpoint.concurrency={self.concurrency} must be >= 1")
        if self.max_consecutive_failures < 1:
            raise ConfigError(f"checkpoint.max_consecutive_failures={self.max_consecutive_failures} must be >= 1 "
                              "(saves that may fail in a row before the run fails)")
        e, i = self.export_every, self.interval_steps
        if e < 0 or (e and (not i or e % i)):  # an export is made from a committed checkpoint
            near = f"export_every={i * max(1, e // i)}, or " if i and e > 0 else ""
            raise ConfigError(f"checkpoint.export_every={e} must be a multiple of checkpoint.interval_steps={i}; use "
                              f"{near}interval_steps={max(e, 1)} or a divisor of it (export_every=0 exports nothing)")
        if self.faults:
            from checkpointing.storage.faults import StorageFaults

            try:
                StorageFaults.from_dict(self.faults)
            except TypeError as e:
                raise ConfigError(f"checkpoint.faults: {e}; see checkpointing.storage.faults.StorageFaults") from None
