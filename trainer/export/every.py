"""``[checkpoint] export_every = N``: a ``transformers`` export of every N-th step, made in the
background from its committed checkpoint and written beside the checkpoints.

    [checkpoint]
    url = "s3://bucket/runs"
    interval_steps = 500
    export_every = 2000            # a multiple of interval_steps

    s3://bucket/runs/<run_id>/exports/step_000002000/    config.json, model.safetensors, tokenizer files,
                                                         MANIFEST.json (written last: the commit)

When the checkpoint of a step that is a multiple of ``export_every`` commits, the coordinator
(rank 0) hands the step to a thread of this module, which runs ``python -m trainer.export.every``:
``etrain ckpt export`` of that committed step (:func:`trainer.export.convert.export`, format ``hf``, fp32)
into the storage URL above, in a process of its own (niced, one thread, no GPU) so that it never
holds the GIL, a core or the GPU that training uses. Training waits for none of it: the step is
handed over from the save's background thread after the commit.

At most one export runs. A step that comes due while one runs waits; a newer one replaces a
waiting one, which is skipped with a warning (the newest weights are the ones worth having).
Retention keeps the checkpoint of the step being exported and of the one waiting
(``CheckpointManager.pinned``); exports themselves are never pruned (``keep_last`` and
``keep_every`` count checkpoints only).

An export is tied to the checkpoint it was made from: its manifest records that checkpoint's
identity (the sha256 of the checkpoint's ``MANIFEST.json``, :mod:`checkpointing.export.manifest`).
A complete export of the step's checkpoint as it is now is not redone. Anything else is removed
(its manifest first, so that no reader takes it meanwhile) and the export written again: the
leftovers of one cut short (no manifest: readers never use them), a corrupt one, and a stale one,
made from another checkpoint of the same step (the run's checkpoints were deleted and the run id
trained again). A failed export is logged with the tail of its output and never fails the run. A
run resumed from a step that is due exports it unless its export is complete (an export cut short
by the end of the previous run). ``python -m trainer`` waits for the export in flight before it exits
(:func:`wait_for_exports`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from checkpointing.cli_args import ArgumentParser
from checkpointing.errors import ConfigError, EtrainError
from checkpointing.storage.retry import describe

log = logging.getLogger("etrain")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where the trainer package lives


@dataclass(frozen=True)
class ExportResult:
    step: int
    status: str  # "exported", "exists" (complete, of this checkpoint), "skipped" (a newer step came due) or "failed"
    url: str
    seconds: float = 0.0
    error: str = ""


class ExportJobs:
    """The exports of one run, one at a time, on a thread of their own (one per run and process:
    :meth:`attach` hands the same one to each checkpoint manager of the run, e.g. every epoch on Ray)."""

    _registry: dict[tuple[str, str], ExportJobs] = {}
    _registry_lock = threading.Lock()

    def __init__(self, url: str, run_id: str, every: int, *, dtype: str = "fp32"):
        self.url, self.run_id, self.every, self.dtype = url.rstrip("/"), run_id, every, dtype
        self.manager = None
        self.results: list[ExportResult] = []
        self._cond = threading.Condition()
        self._pending: int | None = None
        self._running: int | None = None
        self._reported = 0  # results already handed to report_exports

    @classmethod
    def attach(cls, manager, every: int) -> ExportJobs:
        """The run's exports, started on ``manager``'s commits (rank 0's manager is the one that commits)."""
        key = (manager.storage.url, manager.run_id)
        with cls._registry_lock:
            jobs = cls._registry.get(key)
            if jobs is None or jobs.every != every:
                jobs = cls._registry[key] = cls(manager.storage.url, manager.run_id, every)
        jobs.manager = manager
        manager.on_committed = jobs.submit
        with jobs._cond:
            jobs._pin()
        return jobs

    @classmethod
    def of(cls, manager) -> ExportJobs | None:
        return cls._registry.get((manager.storage.url, manager.run_id)) if manager is not None else None

    def export_url(self, step: int) -> str:
        from checkpointing.export.manifest import export_rel
        from checkpointing.names import redact

        return redact(f"{self.url}/{export_rel(self.run_id, step)}")

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def submit(self, step: int) -> None:
        """Export committed step ``step`` if it is due: now, or after the export in flight."""
        if not self.due(step):
            return
        with self._cond:
            if step in (self._running, self._pending) or max(self._running or 0, self._pending or 0) > step:
                return
            if self._running is None:
                self._running = step
                self._pin()
                threading.Thread(target=self._loop, args=(step,), name=f"etrain-export-{self.run_id}",
                                 daemon=True).start()
                return
            if self._pending is not None:
                msg = (f"export of step {self._pending} skipped: the export of step {self._running} is still "
                       f"running and step {step} is newer")
                log.warning(msg)
                self.results.append(ExportResult(self._pending, "skipped", self.export_url(self._pending), error=msg))
            self._pending = step
            self._pin()

    def _pin(self) -> None:
        """Keep the checkpoints being exported from retention (called holding the lock)."""
        if self.manager is not None:
            self.manager.pinned = frozenset(s for s in (self._running, self._pending) if s is not None)

    def _loop(self, step: int | None) -> None:
        while step is not None:
            try:
                res = self._export(step)
            except Exception as e:  # an export never fails the run
                res = ExportResult(step, "failed", self.export_url(step), error=describe(e))
            if res.status == "failed":
                log.warning("export of step %d to %s failed (training goes on): %s", step, res.url, res.error)
            with self._cond:
                self.results.append(res)
                step, self._pending = self._pending, None
                self._running = step  # the queued step next, by this thread; None: it ends
                self._pin()
                self._cond.notify_all()

    def _export(self, step: int) -> ExportResult:
        from checkpointing.export.manifest import export_state
        from checkpointing.storage.base import Storage

        url, t0 = self.export_url(step), time.monotonic()
        storage = Storage(self.url)
        try:
            state = export_state(storage, self.run_id, step)
        finally:
            storage.close()
        if state.complete:  # no process for a complete one
            log.info("export of step %d is complete already: %s", step, url)
            return ExportResult(step, "exists", url)
        if state.state in ("stale", "corrupt"):
            log.warning("export of step %d at %s is %s; writing it again", step, url, state.describe())
        log.info("export of step %d started: %s", step, url)
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.run([sys.executable, "-m", "trainer.export.every", self.url, self.run_id, str(step),
                               "--dtype", self.dtype], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True)
        seconds = time.monotonic() - t0
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}")[-2000:]
            return ExportResult(step, "failed", url, seconds, tail)
        log.info("export of step %d written in %.1f s: %s", step, seconds, url)
        return ExportResult(step, "exported", url, seconds)

    def wait(self, timeout: float | None = None) -> bool:
        """Until no export runs or waits (or ``timeout`` s); whether none does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._running is not None or self._pending is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True


def attach_exports(manager, cfg) -> ExportJobs | None:
    """Start ``cfg.checkpoint.export_every``'s exports on ``manager``'s commits (None when it is 0)."""
    every = cfg.checkpoint.export_every
    if manager is None or not every:
        return None
    if manager.storage.url.startswith("memory://"):  # the export process would not see this process's memory
        raise ConfigError(f"checkpoint.export_every={every} needs storage another process can read; "
                          f"checkpoint.url={manager.storage.url} is this process's memory: use file:// or s3://, "
                          "or set export_every=0")
    return ExportJobs.attach(manager, every)


def wait_for_exports(manager, *, quiet: bool = False) -> list[ExportResult]:
    """Before a launcher exits: wait for the run's export in flight; the results of its exports."""
    jobs = ExportJobs.of(manager)
    if jobs is None:
        return []
    with jobs._cond:
        busy = [s for s in (jobs._running, jobs._pending) if s is not None]
    if busy and not quiet:
        print(f"etrain: waiting for the export of step {', '.join(map(str, busy))}", flush=True)
    jobs.wait()
    return list(jobs.results)


def report_exports(manager, trackers, step: int) -> None:
    """Exports written or failed since the last call, as tracker events at ``step`` (the training step
    now, so trackers see steps in order): ``export`` and ``export_failed``, each with its step and
    seconds, and the URL (and the error) in the event's text. Rank 0; nothing without trackers."""
    jobs = ExportJobs.of(manager)
    if jobs is None or not trackers:
        return
    with jobs._cond:
        new, jobs._reported = jobs.results[jobs._reported:], len(jobs.results)
    for r in new:
        if r.status in ("exported", "failed"):
            fields = {"step": r.step, "seconds": round(r.seconds, 3), "url": r.url}
            trackers.log_event(step, "export" if r.status == "exported" else "export_failed",
                               fields | ({"error": r.error[-300:]} if r.error else {}))


# --- the export process ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m trainer.export.every",
                                 description="Export one committed step of a run as a transformers directory "
                                             "at <url>/<run_id>/exports/step_N (what checkpoint.export_every runs).")
    ap.add_argument("url", help="the run's checkpoint.url")
    ap.add_argument("run_id")
    ap.add_argument("step", type=int)
    ap.add_argument("--dtype", default="fp32", help="fp32 (default) or bf16")
    args = ap.parse_args(argv)
    from checkpointing.export.manifest import EXPORT_MANIFEST, export_rel, export_state
    from checkpointing.layout import RunRoot
    from checkpointing.names import redact
    from checkpointing.storage.base import Storage

    from .convert import export

    url = args.url.rstrip("/")
    rel = export_rel(args.run_id, args.step)
    source = f"{url}/{RunRoot(args.run_id).step(args.step)}"
    storage = Storage(url)
    shown = redact(storage.join(rel))
    try:
        if export_state(storage, args.run_id, args.step).complete:
            print(json.dumps({"status": "exists", "url": shown}))
            return 0
        if storage.list_dir(rel):  # cut short, corrupt or stale: never used as it is; written again
            storage.delete_tree(f"{rel}/{EXPORT_MANIFEST}")  # the commit goes first: no reader takes the rest
            storage.delete_tree(rel)
        summary = export(source, storage.join(rel), "hf", args.dtype)
    except FileExistsError:  # its manifest is created exclusively: another export of the step committed first
        print(json.dumps({"status": "exists", "url": shown}))
        return 0
    except ConfigError as e:
        print(f"etrain export: {e}", file=sys.stderr)
        return 2
    except EtrainError as e:
        print(f"etrain export: {e}", file=sys.stderr)
        return 1
    finally:
        storage.close()
    print(json.dumps({"status": "exported", "url": summary["url"], "bytes": summary["bytes"]}))
    return 0


if __name__ == "__main__":
    try:
        os.nice(10)  # below training, on the cores it shares with it
    except OSError:
        pass
    import torch

    torch.set_num_threads(1)
    sys.exit(main())
