"""Checkpoint policy: save (sync or async), load with fallback, verify, retention, and the checks
before a run starts.

    ckpt = CheckpointManager("s3://bucket/runs", "run-1", rank=r, world_size=w)
    ckpt.probe(); ckpt.check_fresh_start(); ckpt.take_writer_lock()   # rank 0, before training
    ckpt.save(step, state_dict, layout=..., config_hash=..., trainer_state=..., config=cfg.to_dict())
    for result in ckpt.poll(): ...              # finished saves: committed, failed, skipped or exists
    manifest = ckpt.load(state_dict)            # newest valid checkpoint, resharded in place
    ckpt.wait(); ckpt.close()                   # before exit

A save is a transaction (:mod:`checkpointing.transaction`): every rank writes
files of its own attempt and a marker listing them; the coordinator (rank 0)
waits for every marker, checks the fence and the writer lock, and writes
``MANIFEST.json``, which is the commit. Async saves block training only for a
snapshot of the state into host buffers; everything else runs in a background
thread. Any failure leaves the step without a manifest, so it does not exist
for any reader, and the previous checkpoint is untouched. At most one save is
in flight; another request waits for it or, by one vote of all ranks, is
skipped with a warning (``when_busy``).

Only the first save of a state layout goes through DCP's planning (its
object collectives, and per tensor the work of finding its shard). A save
whose every rank still holds the layout that this manager's last planned
save was made for (same keys, tensors, dtypes, shapes, shardings, same
group; see ``checkpointing.host_copy.layout_fingerprint``) and lays its items out in the same
places reuses that save's plan and DCP metadata: each rank lays out and
starts writing its files at once, and one small collective confirms that
every rank could; any difference, on any rank, makes it a planned save.

Fencing: each save carries the epoch of the controller that ordered it. A
commit is refused when the fence (``fence()``, by default the run's ``FENCE``
object in storage) names a newer epoch, when a newer epoch already committed
a checkpoint, or when the coordinator lost the run's writer lock
(:mod:`checkpointing.lock`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import CheckpointError, ConfigError, StorageError, UnsafePathError
from .host_copy import HostCopy, PlannedLayout
from .layout import RunRoot, fence_blob, parse_fence
from .lock import WriterLock
from .manifest import (
    FILE_SIZE,
    MANIFEST_NAME,
    Manifest,
    checksum,
    parse_step_dir,
)
from .names import redact_config
from .storage.retry import describe
from .storage.base import Storage
from .transaction import (  # noqa: F401  (SaveResult, group_rank_errors: callers import them from here)
    FenceUnavailable,
    SaveResult,
    SaveTransaction,
    group_rank_errors,
)

# torch (and with it DCP) is imported where a save or load needs it, so that
# listing and verifying checkpoints (``etrain ckpt``) starts in a blink.

log = logging.getLogger("etrain")

STALE_UPLOAD_CHECK_S = 600.0  # retention looks for abandoned multipart uploads at most this often


def retained_steps(committed: list[int], keep_last: int, keep_every: int) -> set[int]:
    """Committed steps that retention keeps: the newest ``keep_last`` and every ``keep_every``-th."""
    keep = set(sorted(committed)[-keep_last:]) if keep_last > 0 else set()
    if keep_every > 0:
        keep |= {s for s in committed if s % keep_every == 0}
    return keep


class CheckpointManager(SaveTransaction):
    def __init__(self, url: str, run_id: str, *, rank: int = 0, world_size: int = 1, async_save: bool = True,
                 when_busy: str = "wait", keep_last: int = 3, keep_every: int = 0, epoch: int = 0,
                 fence: Callable[[], int] | None = None, storage: Storage | None = None,
                 commit_timeout_s: float = 600.0, file_size: int = FILE_SIZE, process_group=None):
        self.root = RunRoot(run_id)  # validates the run id
        self.run_id = run_id
        self.storage = storage or Storage(url)
        self.prefix = self.root.checkpoints
        self.rank = rank
        self.world_size = world_size
        self.async_save = async_save
        self.when_busy = when_busy
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.epoch = epoch
        self.fence = fence or self.read_fence
        self.commit_timeout_s = commit_timeout_s
        self.file_size = file_size
        self.process_group = process_group
        self.lock: WriterLock | None = None  # the run's writer lock, on the coordinator (take_writer_lock)
        self.failed_in_a_row = 0  # saves that failed since the last commit (the coordinator's count)
        self.last_error = ""
        self._thread: threading.Thread | None = None
        self._inflight_step: int | None = None
        self._writer = None  # the EtrainWriter of the save in flight
        self._pool = None  # checkpointing.dcp.writer.StagingPool, made at the first save
        self._gc_thread: threading.Thread | None = None
        self._stale_checked = -float("inf")  # when retention last looked for stale multipart uploads
        self._group = None  # process group of the background saves
        self._control = None  # process group of the busy vote (the main thread's, never the saves')
        self._host = HostCopy()  # the async save's copy of the state: host buffers kept between saves
        self._planned: PlannedLayout | None = None  # the last save DCP planned, while its layout holds
        self._io: ThreadPoolExecutor | None = None  # file upload threads, kept from one save to the next
        self._done: list[SaveResult] = []
        self._lock = threading.Lock()
        # Called on the coordinator with each step it commits, from the save's thread (a periodic
        # export starts there); an error in it never fails the save.
        self.on_committed: Callable[[int], None] | None = None
        self.pinned: frozenset[int] = frozenset()  # committed steps being read (exported): retention keeps them

    # --- naming and listing ----------------------------------------------------

    def step_rel(self, step: int) -> str:
        return self.root.step(step)

    def url_of(self, step: int) -> str:
        """The full URL of one step's checkpoint directory."""
        return self.storage.join(self.step_rel(step))

    def steps(self) -> list[int]:
        """Every step directory present, committed or not, ascending."""
        names = self.storage.list_dir(self.prefix)
        return sorted(s for s in (parse_step_dir(n) for n, size in names.items() if size is None) if s is not None)

    def is_committed(self, step: int) -> bool:
        return MANIFEST_NAME in self.storage.list_dir(self.step_rel(step))

    def committed_steps(self) -> list[int]:
        return [s for s in self.steps() if self.is_committed(s)]

    def latest_committed(self) -> int | None:
        for s in reversed(self.steps()):
            if self.is_committed(s):
                return s
        return None

    def _latest_committed_after(self, step: int) -> int | None:
        """The newest committed step after ``step``, if any (one listing when there is none)."""
        for s in reversed(self.steps()):
            if s <= step:
                return None
            if self.is_committed(s):
                return s
        return None

    def read_manifest(self, step: int) -> Manifest:
        """Step ``step``'s manifest, strictly validated (its step and run id included)."""
        rel = f"{self.step_rel(step)}/{MANIFEST_NAME}"
        try:
            blob = self.storage.get(rel)
        except FileNotFoundError:
            raise CheckpointError(f"{self.step_rel(step)} has no {MANIFEST_NAME}: it was never committed") from None
        return Manifest.from_json(blob, where=rel, step=step, run_id=self.run_id)

    # --- before training -------------------------------------------------------------

    def probe(self) -> None:
        """Write, read back and remove a small object under the run: a URL that cannot be written
        (missing, read-only, a file, no credentials, unreachable) fails here, before training."""
        rel = f"{self.root.probe_dir}/{uuid.uuid4().hex}"
        payload = f"etrain write probe {time.time()}".encode()
        where = self.storage.join(self.run_id)
        try:
            self.storage.put(rel, payload, exclusive=True)
            back = self.storage.get(rel)
            self.storage.delete_tree(rel)
        except UnsafePathError:
            raise
        except Exception as e:
            raise CheckpointError(f"checkpoint.url: cannot write checkpoints to {where}: {describe(e)}") from None
        if back != payload:
            raise CheckpointError(f"checkpoint.url: {where} did not return what was written to it")

    def check_fresh_start(self, fix: str = "pass --resume to continue it") -> None:
        """ConfigError if the run already has committed checkpoints: a run that does not resume
        must not write over (or beside) another run's history."""
        newest = self.latest_committed()
        if newest is not None:
            raise ConfigError(
                f"run {self.run_id!r} already has committed checkpoints at {self.storage.join(self.prefix)} "
                f"(newest step {newest}); {fix}, or choose another run_id")

    def take_writer_lock(self, *, owner: str = "", epoch: int | None = None, ttl_s: float = 30.0) -> WriterLock:
        """Hold the run's writer lock (WriterLockHeld names the holder if another live writer has it).
        The coordinator takes it; commits then check it. ``owner`` and ``epoch`` (default: the
        manager's): a holder of the same owner and an older epoch is taken over. See
        :mod:`checkpointing.lock`."""
        lock = WriterLock(self.storage, self.run_id, epoch=self.epoch if epoch is None else epoch, owner=owner,
                          ttl_s=ttl_s)
        lock.acquire()
        self.lock = lock
        return lock

    def close(self) -> None:
        """Release the writer lock (if held). Saves in flight are not waited for: call wait() first."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # --- fencing -----------------------------------------------------------------

    def read_fence(self) -> int:
        """The newest epoch recorded in the run's FENCE object (0 if none)."""
        try:
            blob = self.storage.get(self.root.fence)
        except FileNotFoundError:
            return 0
        try:
            return parse_fence(blob)
        except ValueError as e:
            raise CheckpointError(f"the fence {self.storage.join(self.root.fence)} is unreadable: {e}") from None

    def write_fence(self, epoch: int) -> None:
        self.storage.put(self.root.fence, fence_blob(epoch))

    # --- saving ------------------------------------------------------------------

    @property
    def in_flight(self) -> int | None:
        """The step being uploaded, if any."""
        t = self._thread
        return self._inflight_step if t is not None and t.is_alive() else None

    @property
    def staging_bytes(self) -> int:
        """Host memory held for checkpoints: snapshot buffers plus file staging buffers."""
        snap = self._host.nbytes()
        w = self._writer
        files = w.staged_bytes if w is not None and w.staged_bytes else 0
        pooled = self._pool.held_bytes if self._pool is not None else 0
        return snap + max(files, pooled)

    def save(self, step: int, state_dict: dict[str, Any], *, layout: dict, config_hash: str,
             trainer_state: dict, extra: dict | None = None, config: dict | None = None) -> SaveResult | None:
        """Save ``state_dict`` as ``step``. Collective: every rank calls it.

        ``config``: the run's resolved config, recorded in the manifest beside its hash (any URL
        in it that carries credentials is redacted first).

        Sync: the whole save runs here. Async: the caller is blocked only to
        queue a copy of every tensor into reused host buffers (made here for a
        new layout; else by the background thread, or by ``fence_writes()``
        before the optimizer next writes the state in place, whichever comes
        first); the copy, DCP planning (on a process group of its own, so its
        collectives never interleave with training's), upload and commit run
        in a background thread. Returns the
        result when the save finished inside this call (sync saves, skips);
        None when it continues in the background (see poll()).
        """
        t0 = time.monotonic()
        busy = self.in_flight
        if self.when_busy == "skip" and self._any_rank_busy(busy is not None):
            # One vote decides for every rank: a rank whose upload just ended must
            # not start a save whose collectives the skipping ranks never join.
            msg = f"checkpoint at step {step} skipped: the previous save is still uploading"
            if self.rank == 0:
                log.warning(msg)
            res = SaveResult(step, "skipped", msg)
            self._finish(res)
            return res
        if busy is not None:
            self.wait()
        job = dict(step=step, layout=layout, config_hash=config_hash, trainer_state=trainer_state,
                   extra=extra or {}, config=redact_config(config) if config and self.rank == 0 else {}, t0=t0)
        if not self.async_save:
            return self._save_now(job, state_dict, self.process_group)
        group = self._checkpoint_group()
        try:  # CUDA state: queued on a side stream; host state: copied by the save thread (or fence_writes()
            # before the next optimizer step, whichever is first). Forward and backward overlap either.
            pending = self._host.copy_async(state_dict, defer=True)
        except Exception as e:
            res = SaveResult(step, "failed", f"staging failed: {describe(e)}", blocking_s=time.monotonic() - t0)
            log.warning("checkpoint at step %d failed: %s", step, res.error)
            self._finish(res)
            return res
        job["blocking"] = time.monotonic() - t0
        self._inflight_step = step
        self._thread = threading.Thread(target=self._save_when_copied, args=(job, pending, group),
                                        name=f"etrain-ckpt-{step}", daemon=True)
        self._thread.start()
        return None

    def _save_when_copied(self, job: dict, pending, group) -> SaveResult:
        """The save thread: once the host buffers hold the state, the save; a copy that failed on the device
        fails this save on every rank (they agree on it in the save's first collective)."""
        try:
            snapshot = pending.wait()
        except Exception as e:
            snapshot, job["staging_error"] = None, f"staging failed: {describe(e)}"
        return self._save_now(job, snapshot, group)

    def _any_rank_busy(self, mine: bool) -> bool:
        """Whether any rank still uploads a save: one small collective on a group of its own."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return mine
        if self._control is None:
            self._control = dist.new_group(backend="gloo")
        vote = torch.tensor([1 if mine else 0], dtype=torch.int32)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._control)
        return bool(vote.item())

    def _checkpoint_group(self):
        """A gloo group of every rank, for the background saves' DCP collectives (made once)."""
        import torch.distributed as dist

        if self._group is None and self.world_size > 1 and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _start_gc(self) -> None:
        """Retention runs beside the next steps, not inside the save that triggered it."""
        if self._gc_thread is not None:
            self._gc_thread.join()

        def run():
            try:
                self.collect_garbage()
            except Exception as e:  # retention never fails a committed save
                log.warning("checkpoint garbage collection failed: %s", describe(e))

        self._gc_thread = threading.Thread(target=run, name="etrain-ckpt-gc", daemon=True)
        self._gc_thread.start()

    def _finish(self, res: SaveResult) -> None:
        with self._lock:
            self._done.append(res)
            if res.status == "committed":
                self.failed_in_a_row, self.last_error = 0, ""
            elif res.status == "failed" and not res.cause:
                self.failed_in_a_row += 1
                self.last_error = res.error
        if res.status == "committed" and self.rank == 0 and self.on_committed is not None:
            try:
                self.on_committed(res.step)
            except Exception as e:
                log.warning("after the commit of step %d: %s", res.step, describe(e))

    def poll(self) -> list[SaveResult]:
        """Saves that finished (committed, failed or skipped) since the last poll."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight (if any) has committed or failed, and retention ran."""
        if self._thread is not None:
            self._thread.join(timeout)
        # Read only now: the save that just ended may have started retention.
        if self._gc_thread is not None:
            self._gc_thread.join(timeout)

    # --- retention ---------------------------------------------------------------

    def collect_garbage(self) -> list[int]:
        """Apply retention; remove leftovers of uncommitted saves older than the newest commit."""
        all_steps = self.steps()
        committed = [s for s in all_steps if self.is_committed(s)]
        if not committed:
            return []
        keep = retained_steps(committed, self.keep_last, self.keep_every) | self.pinned
        newest = max(committed)
        doomed = [s for s in committed if s not in keep]
        doomed += [s for s in all_steps if s not in committed and s < newest]
        for s in sorted(doomed):
            if s in committed:
                # The manifest goes first: a half-deleted checkpoint must not look committed.
                self.storage.delete_tree(f"{self.step_rel(s)}/{MANIFEST_NAME}")
            self.storage.delete_tree(self.step_rel(s))
        if time.monotonic() - self._stale_checked > STALE_UPLOAD_CHECK_S:
            self.storage.abort_stale_uploads(self.prefix, older_than_s=3600)
            self._stale_checked = time.monotonic()
        return sorted(doomed)

    # --- loading -----------------------------------------------------------------

    def _broadcast(self, value, group=None):
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group or self.process_group)
        return box[0]

    def load(self, state_dict: dict[str, Any], *, step: int | None = None) -> Manifest | None:
        """Load the newest valid checkpoint (or ``step``) into ``state_dict`` in place. Collective.

        Resharding is implicit: every tensor is read by global offsets, so
        the current layout may differ from the one that saved. A corrupt or
        partial checkpoint is skipped with a warning naming the file and the
        field, and the one before is tried. Returns its manifest, or None when
        the run has no committed checkpoint; when it has some but none loads,
        CheckpointError lists each and why it was refused.
        """
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from .dcp.reader import EtrainReader, SafeLoadPlanner, load_failure

        self._host.fence()  # a save's deferred host copy reads the state before this load writes it
        candidates = self._broadcast(self._candidates(step) if self.rank == 0 else None)
        if isinstance(candidates, Exception):
            raise candidates
        refused: list[str] = []
        for s in candidates:
            blob = None
            reader = None
            if self.rank == 0:
                # The manifest and the DCP metadata are checked here, before DCP sees them: DCP
                # reports a metadata file it cannot read as an AssertionError of its own.
                try:
                    manifest = self.read_manifest(s)
                    reader = EtrainReader(self.storage, self.step_rel(s), manifest.file_table())
                    reader.read_metadata()
                    blob = manifest.to_json()
                except CheckpointError as e:
                    blob = e
            blob = self._broadcast(blob)
            try:
                if isinstance(blob, Exception):
                    raise blob
                manifest = Manifest.from_json(blob, where=f"{self.step_rel(s)}/{MANIFEST_NAME}", step=s,
                                              run_id=self.run_id)
                reader = reader or EtrainReader(self.storage, self.step_rel(s), manifest.file_table())
                dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(),
                         process_group=self.process_group,
                         no_dist=self.world_size == 1 and not dist.is_initialized())
                return manifest
            except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
                cause = load_failure(e)
                reason = str(cause) if isinstance(cause, CheckpointError) else describe(cause)
                if step is not None or not isinstance(cause, CheckpointError) or isinstance(cause, StorageError):
                    # Only a bad checkpoint is skipped; an outage or a bug must not
                    # silently send the run back to an older step.
                    raise CheckpointError(f"cannot load {self.step_rel(s)}: {reason}") from e
                refused.append(f"step {s}: {reason}")
                if self.rank == 0:
                    log.warning("checkpoint %s is unusable (%s); trying the one before", self.step_rel(s), reason)
        if refused:
            raise CheckpointError(
                f"run {self.run_id!r} has {len(refused)} committed checkpoint(s) at "
                f"{self.storage.join(self.prefix)} and none of them loads:\n  " + "\n  ".join(refused)
                + "\nrepair or remove them (`etrain ckpt verify` names each bad file), or start another run_id")
        return None

    def _candidates(self, step: int | None):
        try:
            if step is not None:
                return [step]
            return list(reversed(self.committed_steps()))
        except StorageError as e:
            return e

    # --- verification ------------------------------------------------------------

    def verify(self, step: int) -> list[str]:
        """Problems with one checkpoint, each naming the file; empty when it is sound."""
        rel = self.step_rel(step)
        try:
            manifest = self.read_manifest(step)
        except CheckpointError as e:
            return [str(e)]
        present = self.storage.list_dir(rel)
        problems = []
        for f in manifest.files:
            name = f"{rel}/{f.path}"
            if f.path not in present:
                problems.append(f"{name}: missing")
                continue
            if present[f.path] != f.size:
                problems.append(f"{name}: {present[f.path]} bytes, manifest says {f.size}")
                continue
            got = checksum(self.storage.get(name))
            if got != f.crc32c:
                problems.append(f"{name}: crc32c {got}, manifest says {f.crc32c}")
        return problems
