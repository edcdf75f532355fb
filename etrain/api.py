"""``etrain.train`` (one process, or one torchrun rank) and ``etrain.submit`` (an elastic run on Ray)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from checkpointing.errors import ConfigError, EtrainError
from trainer.config import RunConfig
from trainer.config.load import apply_overrides, config_from_dict, load_raw

Config = str | os.PathLike | dict | RunConfig


def config_document(config: Config, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The run's TOML document from a path, a dict or a RunConfig, with ``section.field=value`` overrides."""
    overrides = list(overrides)
    if isinstance(config, RunConfig):
        return apply_overrides(config.to_dict(), overrides)
    if isinstance(config, dict):
        return apply_overrides(config, overrides)
    if isinstance(config, (str, os.PathLike)):
        return load_raw(os.fspath(config), overrides)
    raise ConfigError(f"config must be a TOML path, a dict or a RunConfig, not {type(config).__name__}")


class TrainingFailed(EtrainError):
    """A run that started and did not finish its work (the CLI's exit 1); ``outcome`` says how far it got."""

    def __init__(self, message: str, outcome):
        super().__init__(message)
        self.outcome = outcome


@dataclass
class TrainResult:
    """What :func:`train` did: the last step, the first and last training loss, the newest held-out loss."""

    step: int
    first_loss: float | None
    loss: float | None
    eval_loss: float | None
    seconds: float


def train(config: Config, overrides: Iterable[str] = (), *, resume: bool = False, log_file: str | None = None,
          quiet: bool = False) -> TrainResult:
    """Train ``config`` in this process: alone, or as one rank under torchrun (RANK, WORLD_SIZE, ... from the
    environment), exactly as ``python -m trainer`` does. ConfigError for invalid input, TrainingFailed when
    the run could not finish (e.g. its checkpoints failed)."""
    from trainer.cli import train_config

    doc = config_document(config, list(overrides) + (["checkpoint.resume=true"] if resume else []))
    out = train_config(lambda: config_from_dict(doc), log_file=log_file, quiet=quiet)
    if out.exit_code == 2:
        raise ConfigError(out.error)
    if out.exit_code:
        raise TrainingFailed(out.error, out)
    return TrainResult(out.step, out.first_loss, out.loss, out.eval_loss, out.seconds)


def submit(config: Config, workers: int | None = None, address: str | None = None, store: str | None = None, *,
           overrides: Iterable[str] = (), run_id: str | None = None, min_workers: int | None = None,
           max_workers: int | None = None) -> Run:
    """Start an elastic run on Ray (the cluster at ``address`` / $RAY_ADDRESS, else a local Ray on 127.0.0.1)
    and return at once; the run goes on in the background of this process (``etrain run`` without the wait).
    ``store``: the run store URL (default: beside the checkpoints). The returned :class:`Run` carries the
    run's token (``run.token``; this user's run registry keeps it too), which its control methods need."""
    from orchestrator.driver.run import connect, prepare_run_doc
    from orchestrator.service.auth import mint

    doc = config_document(config, overrides)
    token = mint()
    join = (lambda: connect(address, 0)) if address or os.environ.get("RAY_ADDRESS") else None  # grants checked
    spec, st = prepare_run_doc(doc, workers=workers, min_workers=min_workers, max_workers=max_workers,
                               run_id=run_id, store=store, token=token, join=join)
    run = Run(spec.run_id, st.url, address, token=token)
    run._start(spec, st)
    return run


class Run:
    """A run in the run store: follow it, change it, wait for it (``etrain status/events/suspend/resume/
    resize/stop``). Methods that change the run take effect at its next step boundary, and need the run's
    token: ``token``, else one found as the CLI finds it ($ETRAIN_RUN_TOKEN, this user's run registry,
    $ETRAIN_ADMIN_TOKEN); ``orchestrator.service.auth.NotAuthorized`` otherwise."""

    def __init__(self, run_id: str, store_url: str, address: str | None = None, *, token: str | None = None):
        self.run_id = run_id
        self.store_url = store_url
        self.address = address
        self.token = token
        self._bg = None

    def __repr__(self) -> str:  # never the token
        return f"Run({self.run_id!r}, phase={self.status().get('phase')!r})"

    def _store(self):
        from orchestrator.store.run_store import open_store

        return open_store(self.store_url)

    def _start(self, spec, st) -> None:
        from orchestrator.driver.run import BackgroundRun, connect, parse_spec

        _, e = parse_spec(spec)
        connect(self.address, int((max(spec.max_workers, spec.workers) + e.standby) * e.cpus_per_worker) or 1)
        self._bg = BackgroundRun(spec, st)

    def status(self) -> dict:
        """The run's status: phase, step, world size, loss, eval loss, checkpoints, recoveries, goodput."""
        live = self._bg.snapshot() if self._bg is not None and self._bg.thread.is_alive() else None
        return live or self._store().get_status(self.run_id) or {}

    def events(self, kind: str | None = None) -> list[dict]:
        """Failures, recoveries, resizes and checkpoints, oldest first (``kind`` filters)."""
        rows = self._store().events(self.run_id)
        return [e for e in rows if kind is None or e.get("kind") == kind]

    def _change(self, changes) -> None:
        from orchestrator.service.auth import change_run
        from orchestrator.store.documents import writing

        store = self._store()
        with writing(store):  # a store this user may only read: StoreNotWritable, naming it
            change_run(store, self.run_id, changes, self.token)

    def suspend(self) -> None:
        """Checkpoint and stop at the next step boundary; :meth:`resume` continues it on any valid size."""
        self._change({"suspended": True})

    def stop(self) -> None:
        """End the run at the next step boundary (with a final checkpoint)."""
        self._change({"stop": True})

    def resize(self, workers: int | None = None, *, allow_growth: bool = False) -> None:
        """Change the run's size at its next step boundary (a size its layout allows; ConfigError otherwise).
        As ``etrain resize`` does (:func:`orchestrator.service.resize.resize_run`): the size asked for overrides
        the cluster allocator's target, a run the allocator requeued joins the queue again at that size, and
        the size sticks: the allocator never grows the run above it into idle capacity unless
        ``allow_growth`` (``run.resize(allow_growth=True)`` alone gives it that room back)."""
        from orchestrator.service.resize import resize_run

        resize_run(self._store(), self.run_id, workers, self.token, allow_growth=allow_growth)

    def resume(self, workers: int | None = None) -> Run:
        """Continue a suspended or interrupted run (waits for the current one to end first)."""
        from orchestrator.driver.run import prepare_resume

        if self._bg is not None and self._bg.thread.is_alive():
            self.wait()
        spec, st = prepare_resume(self.run_id, self.store_url, workers, token=self.token)
        self._start(spec, st)
        return self

    def wait(self, timeout: float = 3600.0, *, until_step: int | None = None) -> dict:
        """Block until the run reaches a terminal phase (FINISHED, SUSPENDED, FAILED), or with ``until_step``
        until it has completed that step (or ended); its status then."""
        from orchestrator.phase import TERMINAL, Phase

        if until_step is not None:
            return self._poll(lambda st: (st.get("step") or 0) >= until_step or Phase.of(st) in TERMINAL, timeout,
                              f"reach step {until_step}")
        if self._bg is not None:
            self._bg.join(timeout)
            return self._bg.result
        return self._poll(lambda st: Phase.of(st) in TERMINAL, timeout, "end")

    def _poll(self, done, timeout: float, what: str) -> dict:
        """The status, polled until ``done(status)``; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if done(st):
                return st
            time.sleep(0.2)
        raise TimeoutError(f"run {self.run_id!r} did not {what} within {timeout:.0f} s")
