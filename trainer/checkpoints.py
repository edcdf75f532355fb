"""The run's checkpoint manager, as both launchers make it, and the checks of its storage before a run starts.

    checkpoint_preflight(cfg, resume=False)        # before any process group: the URL takes a write
    mgr = checkpoint_manager(cfg, world)           # None without checkpoint.url
"""

from __future__ import annotations

from checkpointing.errors import CheckpointError, ConfigError, StorageError
from checkpointing.manager import CheckpointManager
from checkpointing.storage.base import Storage
from checkpointing.storage.faults import StorageFaults
from checkpointing.storage.retry import RetryPolicy

from .config import RunConfig
from .world import World


def checkpoint_preflight(cfg: RunConfig, *, resume: bool, fix: str = "pass --resume to continue it") -> None:
    """Before any process group starts: the checkpoint URL takes a write (a probe), and a run that
    does not resume finds no committed checkpoints of its run id there. ConfigError otherwise (exit 2)."""
    c = cfg.checkpoint
    if not c.url:
        return
    storage = Storage(c.url, retry=RetryPolicy(attempts=3, deadline_s=min(30.0, c.timeout_s)))
    mgr = CheckpointManager(c.url, cfg.run_id, storage=storage)
    try:
        mgr.probe()
        if not resume:
            mgr.check_fresh_start(fix)
    except (CheckpointError, StorageError) as e:
        raise ConfigError(str(e)) from None
    finally:
        storage.close()


def checkpoint_manager(cfg: RunConfig, world: World, *, epoch: int = 0, fence=None) -> CheckpointManager | None:
    """The run's checkpoint manager per ``[checkpoint]``, or None without a URL."""
    c = cfg.checkpoint
    if not c.url:
        return None
    faults = StorageFaults.from_dict(c.faults) if c.faults else None
    storage = Storage(c.url, retry=RetryPolicy(deadline_s=c.timeout_s), concurrency=c.concurrency, faults=faults)
    mgr = CheckpointManager(c.url, cfg.run_id, rank=world.rank, world_size=world.size, async_save=c.async_save,
                            when_busy=c.when_busy, keep_last=c.keep_last, keep_every=c.keep_every, epoch=epoch,
                            fence=fence, storage=storage, commit_timeout_s=c.timeout_s)
    if c.export_every and world.rank == 0:  # rank 0 commits, and exports what it committed
        from .export.every import attach_exports

        attach_exports(mgr, cfg)
    return mgr
