"""torch.profiler over the steps ``[profile]`` names, on the ranks it names.

    prof = step_profiler(cfg, world, device, done=trainer.step, until=last)   # None: this rank traces nothing
    for each step n (the step log's number):
        prof.before(n); trainer.train_step(); prof.after(n)
    prof.close()                                                              # in a finally

:meth:`trainer.loop.Trainer.run_steps` does this. A traced window of steps ``[first, last]`` writes
``<profile.dir>/<run_id>/steps_<first>-<last>/rank<R>.pt.trace.json``: a Chrome trace that TensorBoard's
profiler plugin (``tensorboard --logdir <profile.dir>``), Perfetto (ui.perfetto.dev) and chrome://tracing open.
Each traced step is a range ``etrain.step#N`` named by its number in the step log (torch's own
``ProfilerStep#k`` count from the window's start). The step before the window, when this process trains it,
is the profiler's warm-up, left out of the trace. On CUDA the window also records the allocator's history,
dumped beside the trace as ``rank<R>.memory_snapshot.pickle`` (open it at pytorch.org/memory_viz); CPU runs
never touch CUDA.

Disabled, or on a rank that does not trace, :func:`step_profiler` returns None and nothing here runs.
"""

from __future__ import annotations

import logging
import os

import torch

from ..config import RunConfig
from ..config.profile import ProfileConfig
from ..world import World

log = logging.getLogger("etrain")

# Allocation events the CUDA allocator's history keeps (torch.cuda.memory._record_memory_history).
MEMORY_HISTORY_ENTRIES = 100_000


def step_profiler(cfg: RunConfig, world: World, device: torch.device, *, done: int,
                  until: int) -> StepProfiler | None:
    """The profiler of a loop that has trained ``done`` steps and trains up to step ``until``, or None when
    ``[profile]`` is off, this rank does not trace, or the window is already behind. Rank 0 warns when
    the window or a rank it names is out of this run's reach."""
    p = cfg.profile
    if not p.enabled:
        return None
    if world.is_main:
        _warn_unreachable(p, world.size, done, until)
    if world.rank not in p.ranks or p.last <= done or p.first > until:
        return None
    return StepProfiler(p, cfg.run_id, world.rank, device)


def _warn_unreachable(p: ProfileConfig, world_size: int, done: int, until: int) -> None:
    if p.first > until:
        log.warning("profile.steps=[%d, %d] starts after the last step this run trains (%d): nothing is traced; "
                    "lower profile.steps or raise train.steps", p.first, p.last, until)
    elif p.last > until:
        log.warning("profile.steps=[%d, %d] ends after the last step this run trains (%d): steps %d-%d are "
                    "traced", p.first, p.last, until, max(p.first, done + 1), until)
    missing = [r for r in p.ranks if r >= world_size]
    if missing:
        log.warning("profile.ranks names rank(s) %s, beyond this world of %d rank(s): they trace nothing",
                    ",".join(map(str, missing)), world_size)


class StepProfiler:
    """One window of traced steps on this rank: started before its first step (or the step before, as
    warm-up), stopped and written after its last, or by :meth:`close` when the loop ends early."""

    def __init__(self, p: ProfileConfig, run_id: str, rank: int, device: torch.device):
        self.p = p
        self.rank = rank
        self.root = os.path.join(p.dir, run_id)
        self.device = device
        self.cuda = device.type == "cuda"
        self._prof: torch.profiler.profile | None = None
        self._step_range: torch.profiler.record_function | None = None
        self._traced: list[int] = []  # the steps recorded so far (not the warm-up)
        self._over = False

    def before(self, step: int) -> None:
        """Step ``step`` (numbered as in the step log) is about to train."""
        if self._over:
            return
        if self._prof is None:
            if step < self.p.first - 1 or step > self.p.last:
                return
            self._start(step)
        self._step_range = torch.profiler.record_function(f"etrain.step#{step}")
        self._step_range.__enter__()

    def after(self, step: int) -> None:
        """Step ``step`` has trained; after the window's last step the trace is written."""
        if self._prof is None or self._over:
            return
        self._end_step_range()
        if step >= self.p.first:
            self._traced.append(step)
        self._prof.step()  # past the window's last active step: torch stops and writes the trace (_write)
        if step >= self.p.last:
            self._finish()

    def close(self) -> None:
        """The loop ends: a window still open is stopped and written with the steps it has."""
        if self._prof is not None and not self._over:
            self._end_step_range()
            self._finish()

    def _start(self, step: int) -> None:
        warmup = 1 if step < self.p.first else 0
        active = self.p.last - max(step, self.p.first) + 1
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._write, record_shapes=True)
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES, device=self.device)
        self._prof.start()

    def _end_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _window_dir(self) -> str:
        first, last = (self._traced[0], self._traced[-1]) if self._traced else (self.p.first, self.p.first)
        return os.path.join(self.root, f"steps_{first}-{last}")

    def _write(self, prof: torch.profiler.profile) -> None:
        """torch's on_trace_ready: the window's Chrome trace, as tensorboard_trace_handler names one."""
        out = self._window_dir()
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"rank{self.rank}.pt.trace.json")
        prof.export_chrome_trace(path)
        log.info("profile: rank %d traced step(s) %s to %s", self.rank, _span(self._traced), path)

    def _finish(self) -> None:
        self._over = True
        prof, self._prof = self._prof, None
        try:
            prof.stop()  # writes the trace unless the schedule already did
        finally:
            if self.cuda:
                self._dump_memory()

    def _dump_memory(self) -> None:
        try:
            out = self._window_dir()
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, f"rank{self.rank}.memory_snapshot.pickle")
            torch.cuda.memory._dump_snapshot(path)
            log.info("profile: rank %d's CUDA memory history of step(s) %s in %s", self.rank,
                     _span(self._traced), path)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return str(steps[0]) if steps[0] == steps[-1] else f"{steps[0]}-{steps[-1]}"
