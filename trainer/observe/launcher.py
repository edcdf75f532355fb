"""Metrics of a run under a plain launcher (torchrun, ``python -m trainer``): rank 0 serves them.

    m = LauncherMetrics(cfg, world, store)      # store: the process group's key-value store (or None)
    m.after_step(stats, trainer, ckpt, saves)   # every step, on every rank
    m.record_saves(saves)                       # results that finished after the last step
    m.close()

Rank 0 owns the run's :class:`~trainer.observe.metrics.RunMetrics` and its
:class:`~trainer.observe.endpoint.MetricsEndpoint`. Every ``metrics.every_s``
each other rank puts its telemetry into the store (the launcher's rendezvous
store) and rank 0 reads it from there. Under Ray the controller plays this
part instead (``orchestrator.driver.run``).
"""

from __future__ import annotations

import json
import time

from .metrics import RunMetrics, goodput_ratio
from .endpoint import MetricsEndpoint
from .telemetry import StepMeter, mfu, rank_telemetry


class LauncherMetrics:
    """Rank 0 serves the run's endpoint; the other ranks report through the store (see the module)."""

    def __init__(self, cfg, world, store=None):
        self.cfg, self.world, self.store = cfg, world, store
        self.steps = StepMeter()
        self.every = cfg.metrics.every_s
        self.next_report = 0.0
        self.productive_s = 0.0
        self.endpoint: MetricsEndpoint | None = None
        self.metrics: RunMetrics | None = None
        if world.is_main:
            self.metrics = RunMetrics(cfg.run_id)
            m = cfg.metrics
            self.endpoint = MetricsEndpoint(self.metrics, addr=m.addr, port=m.port, file_sd_dir=m.file_sd_dir)

    @property
    def url(self) -> str | None:
        return self.endpoint.url if self.endpoint else None

    def after_step(self, stats, trainer, ckpt, saves=()) -> None:
        self.steps.observe(stats.step_seconds, stats.data_seconds)
        self.productive_s += stats.step_seconds
        if self.metrics is not None:
            self.metrics.observe_step({**stats.to_dict(), "mfu": mfu(self.cfg, trainer.device, stats.tokens_per_s,
                                                                     stats.world_size)})
        self.record_saves(saves)
        now = time.monotonic()
        if now < self.next_report:
            return
        self.next_report = now + self.every
        t = {**rank_telemetry(trainer, ckpt), "steps": self.steps.snapshot()}
        if self.metrics is None:
            if self.store is not None:
                self.store.set(f"etrain/telemetry/{self.world.rank}", json.dumps(t))
            return
        self.metrics.observe_ranks("rank0", t)
        if self.store is not None:
            for r in range(1, self.world.size):
                key = f"etrain/telemetry/{r}"
                if self.store.check([key]):
                    self.metrics.observe_ranks(f"rank{r}", json.loads(self.store.get(key)))
        self.metrics.observe_run(world_size=self.world.size, epoch=0, phase="RUNNING",
                                 goodput=goodput_ratio(self.productive_s, time.time() - self.metrics.started))

    def record_saves(self, saves) -> None:
        if self.metrics is not None:
            for r in saves:
                self.metrics.observe_save(r)

    def close(self, phase: str = "FINISHED") -> None:
        if self.metrics is not None:
            self.metrics.observe_run(world_size=self.world.size, epoch=0, phase=phase, goodput=self.metrics.goodput)
        if self.endpoint is not None:
            self.endpoint.close()
