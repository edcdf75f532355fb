"""A worker's side of ``[health]`` (trainer.health): chaos faults injected into this process, and what a
rollback or a replay in its trainer means for the rest of the worker (a mixin of
:class:`orchestrator.workers.worker.TrainWorker`)."""

from __future__ import annotations


class HealthHooks:
    def set_health_faults(self, faults: list | None) -> None:
        """Chaos: ``[health] faults`` entries in this worker from now on, at whatever rank it holds (a bad
        device goes where its process goes); None: the config's ``health.faults``."""
        self._health_faults = faults
        self._apply_health_faults()

    def _apply_health_faults(self) -> None:
        if self.trainer is None:
            return
        if self._health_faults is not None:  # injected here: at the rank held now
            specs = [{**f, "rank": self.trainer.world.rank} if f.get("kind") == "bitflip" else f
                     for f in self._health_faults]
        else:
            specs = self.cfg.health.faults
        # A transient fault that fired in this process never fires again, whatever trainer the process builds.
        self.trainer.health.set_faults(specs, fired=self._fired)

    def attach_health(self) -> None:
        """A new trainer (a new group): its faults, and its rollbacks and replays told to the rest of the worker."""
        self._apply_health_faults()
        health = self.trainer.health
        # A rollback makes the tier's snapshots of the steps it undid wrong: they are forgotten.
        health.on_rollback.append(lambda step: self.tier is not None and self.tier.forget_after(step))
        health.on_replay.append(self._replayed)

    def _replayed(self, stats) -> None:
        """A step a rollback trained again: its history row supersedes the faulty pass's, and the controller
        sees the group alive (``replayed``) while the step count is behind what it saw."""
        self._record(stats)
        with self._lock:
            self._last["replayed"] = True
