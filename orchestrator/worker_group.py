"""The Ray side of a run's workers: actors in placement groups, and calls on them.

    group = RayWorkerGroup(spec, store_url, resources={"CPU": 1})
    ids = group.start(2)                       # actors begin to start (placement groups reserved first)
    ready = group.ready(ids, timeout=60)       # the ones whose process is up
    calls = [group.submit(w, "train", 100) for w in ready]
    done = group.wait(calls, timeout=0.5)
    group.result(done[0])                      # a value, or WorkerLost if the actor died

Each worker gets a one-bundle placement group ({"CPU": 1}, or one GPU on GPU
clusters) reserved before its actor starts, so a worker that cannot be placed
stays *pending* instead of failing: when a node joins, pending workers come
up by themselves, and the controller grows the group. The controller only
sees worker ids and calls, so a fake group with the same methods drives it in
tests without Ray.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any

from checkpointing.errors import EtrainError


class WorkerLost(EtrainError):
    """The worker's actor (or its node) died."""


@dataclass
class _Worker:
    wid: str
    actor: Any
    pg: Any
    info_ref: Any
    pg_ref: Any  # ready when the placement group holds its resources
    info: dict | None = None


@dataclass
class Call:
    wid: str
    method: str
    ref: Any
    seq: int = field(default_factory=itertools.count().__next__)


class Pinging:
    """``alive()`` for a group that has ``submit`` and ``result`` (the Ray group and the tests' fake)."""

    def alive(self, wid: str, timeout: float = 2.0) -> bool:
        try:
            self.result(self.submit(wid, "ping"), timeout=timeout)
            return True
        except (WorkerLost, TimeoutError):
            return False


class RayWorkerGroup(Pinging):
    def __init__(self, config: dict, run_id: str, store_url: str, *, resources: dict | None = None,
                 pg_timeout_s: float = 120.0, env: dict | None = None):
        self.config = config
        self.run_id = run_id
        self.store_url = store_url
        self.resources = resources or {"CPU": 1}
        self.pg_timeout_s = pg_timeout_s
        self.env = env or {}
        self.workers: dict[str, _Worker] = {}
        self._counter = itertools.count()

    def start(self, n: int) -> list[str]:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .worker import CONCURRENCY, TrainWorker

        actor_cls = ray.remote(**CONCURRENCY)(TrainWorker)
        out = []
        for _ in range(n):
            wid = f"w{next(self._counter)}-{uuid.uuid4().hex[:4]}"
            pg = placement_group([dict(self.resources)], strategy="PACK", name=f"etrain-{self.run_id}-{wid}")
            opts = {
                "num_cpus": self.resources.get("CPU", 1), "num_gpus": self.resources.get("GPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
                "max_restarts": 0, "max_task_retries": 0, "name": f"etrain-{self.run_id}-{wid}",
            }
            if self.env:
                opts["runtime_env"] = {"env_vars": dict(self.env)}
            actor = actor_cls.options(**opts).remote(self.config, wid, self.store_url, self.pg_timeout_s)
            self.workers[wid] = _Worker(wid, actor, pg, actor.info.remote(), pg.ready())
            out.append(wid)
        return out

    def ready(self, wids: list[str], timeout: float) -> list[str]:
        """Those of ``wids`` whose actor is up (waits up to ``timeout`` for all of them)."""
        import ray

        pending = {self.workers[w].info_ref: w for w in wids if w in self.workers and self.workers[w].info is None}
        if pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
            for ref in done:
                w = self.workers[pending[ref]]
                try:
                    w.info = ray.get(ref)
                except Exception:  # it died while starting
                    self.kill(w.wid)
        return [w for w in wids if w in self.workers and self.workers[w].info is not None]

    def placed(self, wids: list[str]) -> list[str]:
        """Those of ``wids`` that hold their resources: up, or booting and soon up (never blocks)."""
        import ray

        waiting = {self.workers[w].pg_ref: w for w in wids if w in self.workers and self.workers[w].info is None}
        done, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0) if waiting else ([], [])
        booting = {waiting[r] for r in done}
        return [w for w in wids if w in self.workers and (self.workers[w].info is not None or w in booting)]

    def info(self, wid: str) -> dict:
        return self.workers[wid].info or {}

    def submit(self, wid: str, method: str, *args) -> Call:
        if wid not in self.workers:
            raise WorkerLost(f"worker {wid} is gone")
        return Call(wid, method, getattr(self.workers[wid].actor, method).remote(*args))

    def wait(self, calls: list[Call], timeout: float) -> list[Call]:
        import ray

        if not calls:
            return []
        by_ref = {c.ref: c for c in calls}
        done, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout)
        return [by_ref[r] for r in done]

    def result(self, call: Call, timeout: float | None = None) -> Any:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

        try:
            return ray.get(call.ref, timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError(f"worker {call.wid} did not answer {call.method} within {timeout} s") from None
        except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
            raise WorkerLost(f"worker {call.wid} died ({type(e).__name__})") from None

    def kill(self, wid: str) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        w = self.workers.pop(wid, None)
        if w is None:
            return
        try:
            ray.kill(w.actor, no_restart=True)
        except Exception:
            pass
        try:
            remove_placement_group(w.pg)
        except Exception:
            pass

    def shutdown(self) -> None:
        for wid in list(self.workers):
            self.kill(wid)
