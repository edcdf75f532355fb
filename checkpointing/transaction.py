"""One save attempt of a :class:`checkpointing.manager.CheckpointManager`: the commit protocol.

    class CheckpointManager(SaveTransaction): ...     # the manager mixes this in
    res = mgr._save_now(job, snapshot, group)         # in the save thread (async) or the caller's (sync)

An attempt runs, on every rank, with no collectives but one:

1. refusal: a step that is committed already (``exists``), or a coordinator
   that lost the run's writer lock (``failed``), writes nothing at all;
2. lay out: reuse the last planned save's layout when it still holds (each
   rank starts uploading at once), else plan with ``dcp.save`` on the
   checkpoint process group; every file carries this rank's random token;
3. agree: one ``all_gather`` of (plan id, token, refusal) and rank 0's nonce;
4. upload, then a marker per rank under ``_ranks/<nonce>/`` listing its files;
5. commit (rank 0): wait for every marker, check every file's size, the
   fence, the writer lock and that no newer epoch committed; write the DCP
   metadata (``.metadata``) and ``MANIFEST.json``, both exclusively.

A failure anywhere before the manifest write removes this attempt's files;
after the manifest write was tried nothing is removed (a write that failed to
answer may still have committed). Saves never touch a file of another save.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .errors import CheckpointError, ConfigError, FencedError
from .host_copy import PlannedLayout, layout_fingerprint
from .manifest import MANIFEST_NAME, METADATA_NAME, FileEntry, Manifest, checksum, is_listable_name
from .storage.retry import describe

log = logging.getLogger("etrain")

RANKS_DIR = "_ranks"


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


class SaveTransaction:
    """The save path of :class:`checkpointing.manager.CheckpointManager` (mixed in; it reads the
    manager's storage, rank, world size, epoch, fence, lock and caches)."""

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
        from .dcp.writer import EtrainWriter, StagingPool, upload_threads

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
        attempt wrote go with it (their names are this attempt's own, see checkpointing.dcp.writer.file_name)."""
        writer.abort()
        writer.remove_files()
        writer.release()
        if self._writer is writer:
            self._writer = None

    def _lay_out_as_planned(self, step: int, state_dict: dict, layout: str, token: str):
        """Lay this rank's files out by the last planned save and start writing them, if its layout
        still holds. Returns the writer and the plan id, or (None, None). Never raises: every rank
        must go on to ``_agree``."""
        from .dcp.writer import PlannedItems, same_results

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

        from .dcp.writer import PlannedItems

        step = job["step"]
        t0 = time.monotonic()
        writer = None
        # Every file of this attempt carries this rank's token: no other save, of
        # this step or any other, writes a file of the same name.
        token = uuid.uuid4().hex[:8]
        try:
            refusal = ("failed", job["staging_error"]) if job.get("staging_error") else self._refusal(step)
            layout = layout_fingerprint(state_dict) if state_dict is not None else ""
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
                    self._planned = PlannedLayout(job["nonce"], layout, writer.plan, paths, writer.results,
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
                writer.remove_files(job.get("others_files", ()))
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
                            extra=job["extra"], config=job.get("config") or {})
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
