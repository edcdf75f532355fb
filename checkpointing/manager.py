"""Checkpoint policy: save (sync or async), commit, load with fallback, verify, retention.

    ckpt = CheckpointManager("s3://bucket/runs", "run-1", rank=r, world_size=w)
    ckpt.save(step, state_dict, layout=..., config_hash=..., trainer_state=...)   # blocks for staging only
    for result in ckpt.poll(): ...              # finished saves: committed, failed or skipped
    manifest = ckpt.load(state_dict)            # newest valid checkpoint, resharded in place
    ckpt.wait()                                 # before exit

A save is a transaction. ``dcp.save`` with :class:`EtrainWriter` plans and
lays the files out; then every rank, with no collectives, writes its files
and a small marker listing them; the coordinator (rank 0) waits for every
marker, checks the fence, and writes ``MANIFEST.json``, which is the commit.
Async saves block training only for a snapshot of the state into host
buffers; everything else runs in a background thread. Any failure leaves the
step without a manifest, so it does not exist for any reader, and the
previous checkpoint is untouched. At most one save is in flight; another
request waits for it or is skipped with a warning (``when_busy``).

Only the first save of a state layout goes through DCP's planning (its
object collectives, and per tensor the work of finding its shard). A save
whose every rank still holds the layout that this manager's last planned
save was made for (same keys, tensors, dtypes, shapes, shardings, same
group; see ``_layout_fingerprint``) and lays its items out in the same
places reuses that save's plan and DCP metadata: each rank lays out and
starts writing its files at once, and one small collective confirms that
every rank could; any difference, on any rank, makes it a planned save.

Fencing: each save carries the epoch of the controller that ordered it. A
commit is refused when the fence (``fence()``, by default the run's ``FENCE``
object in storage) names a newer epoch, or when a newer epoch already
committed a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError, ConfigError, FencedError, StorageError, UnsafePathError
from .layout import RunRoot, fence_blob, parse_fence
from .lock import WriterLock
from .manifest import (
    FILE_SIZE,
    MANIFEST_NAME,
    METADATA_NAME,
    FileEntry,
    Manifest,
    checksum,
    is_listable_name,
    parse_step_dir,
)
from .retry import describe
from .storage import Storage

# torch (and with it DCP) is imported where a save or load needs it, so that
# listing and verifying checkpoints (``etrain ckpt``) starts in a blink.

log = logging.getLogger("etrain")

RANKS_DIR = "_ranks"
STALE_UPLOAD_CHECK_S = 600.0  # retention looks for abandoned multipart uploads at most this often


@dataclass(frozen=True)
class _PlannedLayout:
    """What a save planned by DCP leaves for later saves of the same layout (see the module doc)."""

    plan_id: str  # rank 0's nonce of the planned save: the same on every rank
    layout: str  # _layout_fingerprint of the state it was planned for
    plan: Any  # this rank's final DCP SavePlan
    paths: dict  # where each of its items is in the state dict (dcp_io.PlannedItems)
    results: list  # this rank's WriteResults: where each item went
    is_coordinator: bool
    metadata: Any  # the DCP Metadata (coordinator only)
    tokens: tuple  # each rank's file token in that save

    def metadata_for(self, tokens: list[str]):
        """The planned save's metadata with every rank's file names of a new attempt."""
        from .dcp_io import retoken_metadata

        return retoken_metadata(self.metadata, dict(zip(self.tokens, tokens)))


def _parse_marker(blob: bytes) -> dict | None:
    """A rank's marker, checked; None while it does not parse (a local write still landing)."""
    try:
        b = json.loads(blob)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(b, dict) or not isinstance(b.get("rank"), int) or not isinstance(b.get("ok"), bool):
        return None
    if b["ok"]:
        files = b.get("files")
        if not isinstance(files, list) or not all(
                isinstance(f, dict) and is_listable_name(f.get("path")) and isinstance(f.get("size"), int)
                and isinstance(f.get("crc32c"), str) and set(f) == {"path", "size", "crc32c"} for f in files):
            return None
    else:
        b["error"] = str(b.get("error", "failed"))[:500]
    return b


@dataclass
class SaveResult:
    """What became of one save request."""

    step: int
    status: str  # "committed", "failed", "skipped", or "exists" (the step was committed already)
    error: str = ""
    bytes: int = 0  # this rank's bytes (all ranks' on the coordinator once committed)
    blocking_s: float = 0.0  # training was blocked this long
    persist_s: float = 0.0  # upload and commit, after the blocking part
    finished_unix: float = field(default_factory=time.time)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, for diagnosis
    # "fence_unavailable": the commit could not read the fence (a run-store outage, which the
    # orchestrator rides out on its own bound): not counted as a failure of the storage.
    cause: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "committed"

    def to_dict(self) -> dict:
        """The fields reported to the controller and the metrics (phases left out)."""
        return {"step": self.step, "status": self.status, "error": self.error, "bytes": self.bytes,
                "blocking_s": self.blocking_s, "persist_s": self.persist_s, "cause": self.cause}


class FenceUnavailable(CheckpointError):
    """The commit could not read the fence (the run store is away)."""


def retained_steps(committed: list[int], keep_last: int, keep_every: int) -> set[int]:
    """Committed steps that retention keeps: the newest ``keep_last`` and every ``keep_every``-th."""
    keep = set(sorted(committed)[-keep_last:]) if keep_last > 0 else set()
    if keep_every > 0:
        keep |= {s for s in committed if s % keep_every == 0}
    return keep


def group_rank_errors(errors: dict[int, str]) -> str:
    """``{1: "X", 3: "X", 2: "Y"}`` -> ``"ranks 1,3: X; rank 2: Y"``."""
    by_msg: dict[str, list[int]] = {}
    for rank, msg in sorted(errors.items()):
        by_msg.setdefault(msg, []).append(rank)
    parts = []
    for msg, ranks in by_msg.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {','.join(map(str, ranks))}: {msg}")
    return "; ".join(parts)


class CheckpointManager:
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
        self._pool = None  # dcp_io.StagingPool, made at the first save
        self._gc_thread: threading.Thread | None = None
        self._stale_checked = -float("inf")  # when retention last looked for stale multipart uploads
        self._group = None  # process group of the background saves
        self._control = None  # process group of the busy vote (the main thread's, never the saves')
        self._snap_cache: dict = {}  # path -> host buffer of the async snapshot
        self._snap_views: dict = {}  # path -> the DTensor over that buffer, made once (from_local costs)
        self._planned: _PlannedLayout | None = None  # the last save DCP planned, while its layout holds
        self._io: ThreadPoolExecutor | None = None  # file upload threads, kept from one save to the next
        self._done: list[SaveResult] = []
        self._lock = threading.Lock()

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
        snap = sum(t.numel() * t.element_size() for t in self._snap_cache.values())
        w = self._writer
        files = w.staged_bytes if w is not None and w.staged_bytes else 0
        pooled = self._pool.held_bytes if self._pool is not None else 0
        return snap + max(files, pooled)

    def save(self, step: int, state_dict: dict[str, Any], *, layout: dict, config_hash: str,
             trainer_state: dict, extra: dict | None = None) -> SaveResult | None:
        """Save ``state_dict`` as ``step``. Collective: every rank calls it.

        Sync: the whole save runs here. Async: only a snapshot of every
        tensor into reused host buffers blocks the caller; DCP planning (on a
        process group of its own, so its collectives never interleave with
        training's), upload and commit run in a background thread. Returns the
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
                   extra=extra or {}, t0=t0)
        if not self.async_save:
            return self._save_now(job, state_dict, self.process_group)
        group = self._checkpoint_group()
        try:
            snapshot = self._snapshot(state_dict)
        except Exception as e:
            res = SaveResult(step, "failed", f"staging failed: {describe(e)}", blocking_s=time.monotonic() - t0)
            log.warning("checkpoint at step %d failed: %s", step, res.error)
            self._finish(res)
            return res
        job["blocking"] = time.monotonic() - t0
        self._inflight_step = step
        self._thread = threading.Thread(target=self._save_now, args=(job, snapshot, group),
                                        name=f"etrain-ckpt-{step}", daemon=True)
        self._thread.start()
        return None

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

    def _snapshot(self, state_dict: dict) -> dict:
        """A copy of every tensor in ``state_dict`` in host buffers kept from one save to the next."""
        import torch

        devices: set[str] = set()
        out = self._snapshot_tree(state_dict, "", devices)
        if "cuda" in devices:
            torch.cuda.current_stream().synchronize()  # once, after every copy was queued
        return out

    def _snapshot_tree(self, obj, path: str, devices: set[str]):
        import torch
        from torch.distributed.tensor import DTensor

        if isinstance(obj, dict):
            return {k: self._snapshot_tree(v, f"{path}/{k}", devices) for k, v in obj.items()}
        if not isinstance(obj, torch.Tensor):
            return obj
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        buf = self._snap_cache.get(path)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=torch.cuda.is_available())
            self._snap_cache[path] = buf
        devices.add(local.device.type)
        buf.copy_(local.detach(), non_blocking=local.device.type == "cuda")
        if not isinstance(obj, DTensor):
            return buf
        view = self._snap_views.get(path)
        if (view is None or view._local_tensor.data_ptr() != buf.data_ptr() or view.device_mesh is not obj.device_mesh
                or view.placements != obj.placements or view.shape != obj.shape or view.stride() != obj.stride()):
            view = DTensor.from_local(buf, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())
            self._snap_views[path] = view
        return view

    def _agree(self, plan_id: str | None, token: str, refusal: tuple[str, str],
               group) -> tuple[str, bool, list[str], tuple[str, str]]:
        """One collective before each save's commit: rank 0's nonce (where this attempt's markers
        go), whether every rank can reuse ``plan_id``, every rank's file token, and whether some rank
        refused the save (``_refusal``; ("", "") when none did).

        ``plan_id`` is the plan this rank has laid its files out by (None: it
        needs a planned save). The plan is reused only when every rank names
        the same one.
        """
        nonce = f"e{self.epoch}-{uuid.uuid4().hex[:12]}" if self.rank == 0 else None
        everyone = self._all_gather((plan_id, nonce, token, refusal), group)
        reuse = plan_id is not None and all(p == plan_id for p, *_ in everyone)
        refused = [r for *_, r in everyone if r[0]]
        status = "failed" if any(k == "failed" for k, _ in refused) else ("exists" if refused else "")
        why = "; ".join(sorted({m for _, m in refused}))
        return everyone[0][1], reuse, [t for _, _, t, _ in everyone], (status, why)

    def _all_gather(self, value, group) -> list:
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return [value]
        out = [None] * self.world_size
        dist.all_gather_object(out, value, group=group or self.process_group)
        return out

    def _new_writer(self, step: int, token: str):
        from .dcp_io import EtrainWriter, StagingPool, upload_threads

        if self._pool is None:
            self._pool = StagingPool()
        if self._io is None:
            self._io = ThreadPoolExecutor(upload_threads(self.storage), thread_name_prefix="etrain-up")
            weakref.finalize(self, self._io.shutdown, wait=False)
        writer = EtrainWriter(self.storage, self.step_rel(step), file_size=self.file_size, pool=self._pool,
                              overlap=True, executor=self._io, epoch=self.epoch, token=token)
        self._writer = writer
        return writer

    def _drop_writer(self, writer) -> None:
        """No upload thread may outlive a failed save (they read the state); the files this
        attempt wrote go with it (their names are this attempt's own, see dcp_io.file_name)."""
        writer.abort()
        writer.remove_files()
        writer.release()
        if self._writer is writer:
            self._writer = None

    def _lay_out_as_planned(self, step: int, state_dict: dict, layout: str, token: str):
        """Lay this rank's files out by the last planned save and start writing them, if its layout
        still holds. Returns the writer and the plan id, or (None, None). Never raises: every rank
        must go on to ``_agree``."""
        from .dcp_io import PlannedItems, same_results

        planned = self._planned
        if planned is None or planned.layout != layout:
            return None, None
        writer = None
        try:
            writer = self._new_writer(step, token)
            writer.is_coordinator = planned.is_coordinator
            writer.write_data(planned.plan, PlannedItems(planned.paths, state_dict))
            if same_results(writer.results, planned.results):
                return writer, planned.plan_id
            log.debug("checkpoint at step %d: items moved (sizes changed); planning again", step)
        except Exception as e:
            log.debug("checkpoint at step %d: cannot reuse the last plan (%s); planning again", step, describe(e))
        if writer is not None:
            self._drop_writer(writer)
        return None, None

    def _refusal(self, step: int) -> tuple[str, str]:
        """Whether this rank must not write step ``step`` at all, as (status, why), ("", "") if it may:
        "exists" when the step is committed already, "failed" when it cannot tell or (the
        coordinator) the run's writer lock is lost. Looked at before any byte is written."""
        try:
            if self.is_committed(step):
                return "exists", f"step {step} is already committed at {self.url_of(step)}; not written again"
            if self.lock is not None:
                self.lock.check()
        except (CheckpointError, FencedError) as e:
            return "failed", str(e)
        return "", ""

    def _save_now(self, job: dict, state_dict: dict, group) -> SaveResult:
        """Plan (or reuse the last plan) + lay out + upload + commit, in the calling thread."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner
        from torch.distributed.checkpoint.api import CheckpointException

        from .dcp_io import PlannedItems

        step = job["step"]
        t0 = time.monotonic()
        writer = None
        # Every file of this attempt carries this rank's token: no other save, of
        # this step or any other, writes a file of the same name.
        token = uuid.uuid4().hex[:8]
        try:
            refusal = self._refusal(step)
            layout = _layout_fingerprint(state_dict)
            writer, plan_id = (None, None) if refusal[0] else self._lay_out_as_planned(step, state_dict, layout,
                                                                                        token)
            t1 = time.monotonic()
            job["nonce"], reuse, tokens, refusal = self._agree(plan_id, token, refusal, group)
            t2 = time.monotonic()
            if refusal[0]:
                if writer is not None:
                    self._drop_writer(writer)
                res = SaveResult(step, refusal[0], refusal[1], blocking_s=self._blocking(job))
                if self.rank == 0:
                    log.warning("checkpoint at step %d not written: %s", step, refusal[1])
                self._finish(res)
                return res
            if reuse:
                w0 = writer.timings["write_data"]
                job["metadata"] = self._planned.metadata_for(tokens) if writer.is_coordinator else None
                job["dcp_phases"] = {"plan": w0 - t0, "lay_out": t1 - w0, "agree": t2 - t1}
            else:
                if writer is not None:  # another rank cannot reuse the plan
                    self._drop_writer(writer)
                self._planned = None
                writer = self._new_writer(step, token)
                planner = DefaultSavePlanner()
                dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=group,
                         no_dist=self.world_size == 1 and not dist.is_initialized())
                job["metadata"] = writer.metadata if writer.is_coordinator else None
                paths = PlannedItems.paths_of(writer.plan, planner, state_dict)
                if paths is not None:
                    self._planned = _PlannedLayout(job["nonce"], layout, writer.plan, paths, writer.results,
                                                   writer.is_coordinator, writer.metadata, tuple(tokens))
                t3 = time.monotonic()
                w0, w1 = writer.timings.get("write_data", t3), writer.timings.get("write_data_end", t3)
                job["dcp_phases"] = {"plan": w0 - t0, "lay_out": w1 - w0, "dcp_finish": t3 - w1}
        except (Exception, CheckpointException) as e:
            self._planned = None
            if writer is not None:
                self._drop_writer(writer)
            res = SaveResult(step, "failed", f"staging failed: {describe(e)}",
                             blocking_s=job.get("blocking", time.monotonic() - job["t0"]))
            log.warning("checkpoint at step %d failed: %s", step, res.error)
            self._finish(res)
            return res
        job["writer"] = writer
        return self._persist(job)

    def _persist(self, job: dict) -> SaveResult:
        step, writer = job["step"], job["writer"]
        rel = self.step_rel(step)
        t0 = time.monotonic()
        phases = {"snapshot": job.get("blocking", 0.0), **job["dcp_phases"]}
        job["phases"] = phases
        marker = f"{rel}/{RANKS_DIR}/{job['nonce']}/rank_{self.rank:05d}.json"
        try:
            entries = writer.upload()
            phases["upload"] = time.monotonic() - t0
            body = {"rank": self.rank, "epoch": self.epoch, "ok": True, "files": [e.__dict__ for e in entries]}
            self.storage.put(marker, json.dumps(body).encode(), exclusive=True)
            phases["marker"] = time.monotonic() - t0 - phases["upload"]
            mine = sum(e.size for e in entries)
            if self.rank == 0:
                mine = self._commit(job, entries)
            res = SaveResult(step, "committed", bytes=mine, blocking_s=self._blocking(job),
                             persist_s=time.monotonic() - t0, phases=phases)
        except Exception as e:
            reason = describe(e) if not isinstance(e, (CheckpointError, FencedError)) else str(e)
            try:  # tell the coordinator at once instead of letting it time out
                self.storage.put(marker, json.dumps({"rank": self.rank, "ok": False, "error": reason}).encode())
            except Exception as e2:  # the coordinator's timeout covers this rank then
                log.debug("could not write the failure marker of step %d: %s", step, describe(e2))
            if not job.get("manifest_attempted"):
                # A failed save removes what it wrote. Never once the manifest was tried:
                # a write that failed to answer may still have committed.
                writer.remove_files()
                for f in job.get("others_files", ()):
                    self._remove(f"{rel}/{f}")
            res = SaveResult(step, "failed", reason, blocking_s=self._blocking(job), persist_s=time.monotonic() - t0,
                             cause="fence_unavailable" if isinstance(e, FenceUnavailable) else "")
            if self.rank == 0 or not isinstance(e, CheckpointError):
                log.warning("checkpoint at step %d failed (the previous checkpoint is untouched): %s", step, reason)
        finally:
            writer.release()
            if self._writer is writer:
                self._writer = None
        self._finish(res)
        return res

    def _remove(self, rel: str) -> None:
        try:
            self.storage.delete_tree(rel)
        except Exception as e:  # retention removes what is left of an uncommitted step
            log.debug("could not remove %s of a failed save: %s", rel, describe(e))

    def _blocking(self, job: dict) -> float:
        """How long training waited: the snapshot (async), or the whole save (sync)."""
        return job["blocking"] if "blocking" in job else time.monotonic() - job["t0"]

    def _wait_for_ranks(self, rel: str, nonce: str) -> dict[int, dict]:
        where = f"{rel}/{RANKS_DIR}/{nonce}"
        start = time.monotonic()
        deadline = start + self.commit_timeout_s
        # The other ranks are usually a few ms behind: look again soon, then back off,
        # never sleeping past more than 1/20 of the time waited so far.
        floor = 0.002 if self.storage.is_local else 0.01
        while True:
            names = [n for n in self.storage.list_dir(where) if n.startswith("rank_")]
            # A marker being written on a local disk can be listed before its bytes are in
            # (no renames): one that does not parse yet is read again on the next look.
            markers = {}
            if names:
                for blob in self.storage.get_many([f"{where}/{n}" for n in names]).values():
                    b = _parse_marker(blob)
                    if b is not None:
                        markers[b["rank"]] = b
            if len(markers) >= self.world_size:
                return markers
            failed = {r: b["error"] for r, b in markers.items() if not b["ok"]}  # a failed rank reports early
            if failed:
                raise CheckpointError(f"not committed: {group_rank_errors(failed)}")
            if time.monotonic() > deadline:
                have = set(markers)
                missing = [r for r in range(self.world_size) if r not in have]
                label = "rank" if len(missing) == 1 else "ranks"
                raise CheckpointError(
                    f"not committed: {label} {','.join(map(str, missing))} did not finish uploading "
                    f"within {self.commit_timeout_s:.0f} s")
            time.sleep(min(0.5, max(floor, 0.05 * (time.monotonic() - start))))

    def _commit(self, job: dict, own_entries) -> int:
        import pickle

        step = job["step"]
        rel = self.step_rel(step)
        t0 = time.monotonic()
        markers = self._wait_for_ranks(rel, job["nonce"])
        job["phases"]["wait_for_ranks"] = time.monotonic() - t0
        t0 = time.monotonic()
        files = {}
        for b in markers.values():
            for f in b.get("files", ()):
                files[f["path"]] = f
        job["others_files"] = [p for p in files if p not in {e.path for e in own_entries}]
        failed = {r: b["error"] for r, b in markers.items() if not b["ok"]}
        if failed:
            raise CheckpointError(f"not committed: {group_rank_errors(failed)}")
        self._check_sizes(rel, files.values())
        try:
            fence = self.fence()
        except (FencedError, ConfigError):
            raise
        except Exception as e:
            raise FenceUnavailable(f"not committed: the fence could not be read ({describe(e)})") from e
        if fence > self.epoch:
            raise FencedError(f"not committed: epoch {self.epoch} is fenced off by epoch {fence}")
        if self.lock is not None:
            self.lock.check()
        newest = self._latest_committed_after(step)
        if newest is not None:
            theirs = self.read_manifest(newest)
            if theirs.epoch > self.epoch:
                raise FencedError(f"not committed: epoch {theirs.epoch} already committed step {newest}")
        present = self.storage.list_dir(rel)
        if MANIFEST_NAME in present:
            raise CheckpointError(f"not committed: {rel} was committed by another save meanwhile")
        # The DCP metadata goes last but one: every attempt at a step names it the same (stock DCP
        # readers look for it there), so a leftover of an attempt that died uncommitted goes first.
        if METADATA_NAME in present:
            self.storage.delete_tree(f"{rel}/{METADATA_NAME}")
        blob = pickle.dumps(job["metadata"])
        self.storage.put(f"{rel}/{METADATA_NAME}", blob, exclusive=True)
        job["others_files"].append(METADATA_NAME)
        files[METADATA_NAME] = {"path": METADATA_NAME, "size": len(blob), "crc32c": checksum(blob)}
        manifest = Manifest(run_id=self.run_id, step=step, epoch=self.epoch, world_size=self.world_size,
                            layout=job["layout"], config_hash=job["config_hash"],
                            trainer_state=job["trainer_state"],
                            files=[FileEntry(**files[k]) for k in sorted(files)], created_unix=time.time(),
                            extra=job["extra"])
        job["manifest_attempted"] = True
        try:
            self.storage.put(f"{rel}/{MANIFEST_NAME}", manifest.to_json(), exclusive=True)
        except FileExistsError:
            raise CheckpointError(f"not committed: {rel}/{MANIFEST_NAME} already exists") from None
        job["phases"]["commit"] = time.monotonic() - t0
        self._start_gc()
        return manifest.total_bytes

    def _check_sizes(self, rel: str, files) -> None:
        """Every file a rank reported is in storage at the size it meant to write: a write that the
        storage cut short while reporting success is caught here, before the commit, not at load."""
        by_dir: dict[str, list[dict]] = {}
        for f in files:
            by_dir.setdefault(posixpath.dirname(f["path"]), []).append(f)
        for sub, entries in by_dir.items():
            present = self.storage.list_dir(f"{rel}/{sub}" if sub else rel)
            for f in entries:
                size = present.get(posixpath.basename(f["path"]))
                if size != f["size"]:
                    found = "is missing" if size is None else f"holds {size} bytes"
                    raise CheckpointError(f"not committed: {rel}/{f['path']} {found}, {f['size']} were written "
                                          "(a truncated or lost write)")

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
        keep = retained_steps(committed, self.keep_last, self.keep_every)
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

        from .dcp_io import EtrainReader, SafeLoadPlanner

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
                cause = _load_failure(e)
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


def _layout_fingerprint(state_dict) -> str:
    """A digest of everything this rank's DCP save plan depends on: the keys, and per tensor its
    dtype, shapes, sharding and the properties DCP records (``TensorProperties``). Where non-tensor
    items land (their serialized size) is checked after laying out instead."""
    import torch
    from torch.distributed.tensor import DTensor

    h = hashlib.blake2b(digest_size=16)
    coords: dict[int, tuple] = {}

    def props(t: torch.Tensor, requires_grad: bool) -> str:
        return f"{t.dtype}{t.layout}{int(requires_grad)}{int(t.is_pinned())}"

    def walk(obj, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            h.update(f"{path}:{type(obj).__name__}{len(obj)};".encode())
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        elif isinstance(obj, DTensor):
            mesh, local = obj.device_mesh, obj._local_tensor
            if id(mesh) not in coords:
                coords[id(mesh)] = (tuple(mesh.shape), mesh.get_coordinate())
            h.update(f"{path}:D{tuple(obj.shape)}{tuple(local.shape)}{obj.placements}{coords[id(mesh)]}"
                     f"{props(local, obj.requires_grad)};".encode())
        elif isinstance(obj, torch.Tensor):
            h.update(f"{path}:T{tuple(obj.shape)}{props(obj, obj.requires_grad)};".encode())
        else:
            h.update(f"{path}:{type(obj).__name__};".encode())

    walk(state_dict, "")
    return h.hexdigest()


def _load_failure(e: BaseException) -> BaseException:
    """The underlying error of a (possibly DCP-wrapped) load failure; a checkpoint problem first."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(e, CheckpointException):
        return e
    inner = []
    for _rank, wrapped in sorted(e.failures.items()):
        # DCP wraps each rank's failure as (exception, stack summary).
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        inner.append(exc if isinstance(exc, BaseException) else RuntimeError(str(exc)))
    for exc in inner:
        if isinstance(exc, CheckpointError) and not isinstance(exc, StorageError):
            return exc
    return inner[0] if inner else e
