"""The run's workers as the controller sees them: the ``WorkerGroup`` interface, and its Ray implementation.

    group = RayWorkerGroup(cfg, run_id, store_url, resources={"CPU": 1})   # cfg: the parsed RunConfig
    ids = group.start(2)                       # actors begin to start (placement groups reserved first)
    ready = group.ready(ids, timeout=60)       # the ones whose process is up
    calls = [group.submit(w, "train", 100) for w in ready]
    done = group.wait(calls, timeout=0.5)
    group.result(done[0])                      # a value, or WorkerLost if the actor died

The controller only sees worker ids and calls, through :class:`WorkerGroup`:
:class:`RayWorkerGroup` implements it on Ray, and ``tests.fake_group.FakeGroup``
in memory, so the controller is tested without Ray.

The run's ``min_workers`` are reserved together first, as one *gang*
placement group (one bundle per worker, ``reserve_gang``): a run is admitted
when the whole gang is, so two runs never each hold part of their minimum
while they wait. Once admitted, the gang hands its resources over to the
workers: each worker, the minimum, the elastic part above it and the
standbys alike, gets a one-bundle placement group ({"CPU": 1}, or one GPU
on GPU clusters) reserved before the actor starts, so a worker that cannot be placed stays *pending* instead of failing:
when a node joins, pending workers come up by themselves, and the controller
grows the group. Every placement group keeps off the cluster's quarantined
nodes (``orchestrator.service.quarantine``), and a worker still waiting is
placed again when they change. Every worker is
built from the run's parsed config (``trainer.config.RunConfig``), which the
driver parsed once and which pickles through Ray.
"""

from __future__ import annotations

import functools
import itertools
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from checkpointing.errors import EtrainError
from trainer.config import RunConfig

from ..service.quarantine import avoiding, placement_exclusions


class WorkerLost(EtrainError):
    """The worker's actor (or its node) died."""


class GroupFailure(EtrainError):
    """A collective call on the group failed; carries what was seen."""

    def __init__(self, message: str, kind: str = "error", suspects: tuple = ()):
        super().__init__(message)
        self.kind = kind
        self.suspects = tuple(suspects)

    def __reduce__(self):
        return (GroupFailure, (str(self), self.kind, self.suspects))


@dataclass
class _Worker:
    wid: str
    actor: Any
    pg: Any
    info_ref: Any
    pg_ref: Any  # ready when the placement group holds its resources
    info: dict | None = None
    bundle: int | None = None  # its bundle in the run's gang; None: a placement group of its own
    labeled: bool = False  # placed by the minimum's label selector ([elastic] min_node_labels)
    avoid: frozenset = frozenset()  # the quarantined nodes its placement group was made to keep off


@dataclass
class Call:
    """A method call submitted to one worker; ``ref`` is the group's handle on its result."""

    wid: str
    method: str
    ref: Any
    seq: int = field(default_factory=itertools.count().__next__)


class WorkerGroup(Protocol):
    """What the controller needs of a group of workers (``orchestrator.workers.worker.TrainWorker`` each).

    Workers are named by ids that are never reused. Calls are asynchronous:
    ``submit`` returns at once, ``wait`` and ``result`` bound how long they
    block. A worker that is gone makes its calls raise :class:`WorkerLost`.
    Implementations subclass this protocol to inherit :meth:`alive`.
    """

    workers: Mapping[str, Any]  # the workers started and not killed, by id

    def start(self, n: int) -> list[str]:
        """Start ``n`` new workers (never blocks); their ids. They may stay pending while there is no room."""
        ...

    def ready(self, wids: list[str], timeout: float) -> list[str]:
        """Those of ``wids`` whose process is up, waiting up to ``timeout`` for all of them. A worker
        found dead before it was up (killed while starting) is stopped and leaves ``workers``: the
        controller replaces it, and counts it as a failure when the group was forming."""
        ...

    def placed(self, wids: list[str]) -> list[str]:
        """Those of ``wids`` that hold their resources: up, or booting and soon up (never blocks)."""
        ...

    def info(self, wid: str) -> dict:
        """What a worker that is up said of itself: ``worker_id``, ``pid``, ``node_id``, ``ip``."""
        ...

    def handle(self, wid: str) -> Any:
        """What another worker calls this one through (a restore fetches memory-tier files with it)."""
        ...

    def submit(self, wid: str, method: str, *args) -> Call:
        """Call ``method(*args)`` on the worker; WorkerLost if it is gone already."""
        ...

    def wait(self, calls: list[Call], timeout: float, *, first: bool = False) -> list[Call]:
        """Those of ``calls`` that have returned, waiting up to ``timeout`` for all of them (``first``: for
        any one of them; then every other that has returned by then comes too)."""
        ...

    def result(self, call: Call, timeout: float | None = None) -> Any:
        """The call's value, or what it raised; WorkerLost if the worker died, TimeoutError past ``timeout``."""
        ...

    def kill(self, wid: str) -> None:
        """Stop the worker and free its resources (nothing if it is gone already)."""
        ...

    def shutdown(self) -> None:
        """Kill every worker and give the gang back."""
        ...

    def reserve_gang(self, n: int) -> None:
        """Reserve ``n`` workers' resources together (all or none), unless a gang is reserved already; the
        next workers started take its bundles. A group without gangs (the default) reserves nothing."""

    def gang_ready(self, timeout: float) -> bool:
        """Whether the gang holds its resources (waiting up to ``timeout``); True for a group without gangs."""
        return True

    def in_gang(self, wid: str) -> bool:
        """Whether the worker holds a bundle of the gang (a shrink keeps these: the gang stays in use)."""
        return getattr(self.workers.get(wid), "bundle", None) is not None

    def alive(self, wid: str, timeout: float = 2.0) -> bool:
        """Whether the worker answers a ping within ``timeout``."""
        try:
            self.result(self.submit(wid, "ping"), timeout=timeout)
            return True
        except (WorkerLost, TimeoutError):
            return False


@functools.cache
def _remote_worker_class():
    """``TrainWorker`` as a Ray actor class, made once per process: Ray exports a class to the cluster at
    the first ``.remote()`` of each wrapping, 30-90 ms measured here, which a replacement started inside a
    recovery paid every time (an actor of a class already exported starts in about 3 ms)."""
    import ray

    from .worker import CONCURRENCY, TrainWorker

    return ray.remote(**CONCURRENCY)(TrainWorker)


class RayWorkerGroup(WorkerGroup):
    """One ``TrainWorker`` actor per worker, in a bundle of the run's gang or a placement group of its own."""

    def __init__(self, config: RunConfig, run_id: str, store_url: str, *, resources: dict | None = None,
                 pg_timeout_s: float = 120.0, env: dict | None = None, gang_labels: Mapping[str, str] | None = None,
                 elastic_labels: Mapping[str, str] | None = None):
        self.config = config
        self.run_id = run_id
        self.store_url = store_url
        self.resources = resources or {"CPU": 1}
        self.pg_timeout_s = pg_timeout_s
        self.env = env or {}
        self.workers: dict[str, _Worker] = {}
        self._counter = itertools.count()
        # Ray label selectors for the gang's bundles and the elastic part's ({}: any node): [elastic] *_node_labels
        self.gang_labels, self.elastic_labels = dict(gang_labels or {}), dict(elastic_labels or {})
        self._labeled_slots = 0  # workers placed by the minimum's labels (the gang's size, once handed over)
        self.gang: Any = None  # the gang placement group (reserve_gang), its size and its ready ref
        self.gang_size = 0
        self.gang_ref: Any = None
        self.gang_avoid: frozenset = frozenset()  # the quarantined nodes the gang was made to keep off

    def reserve_gang(self, n: int) -> None:
        from ray.util.placement_group import placement_group

        if self.gang is None:
            # PACK is a preference: the bundles spread over nodes when no one node holds them all.
            self.gang_avoid = placement_exclusions()  # the quarantined nodes (orchestrator.service.quarantine)
            self.gang = placement_group([dict(self.resources)] * n, strategy="PACK",
                                        name=f"etrain-{self.run_id}-gang-{uuid.uuid4().hex[:4]}",
                                        **_selector(self.gang_labels, n, self.gang_avoid))
            self.gang_size, self.gang_ref = n, self.gang.ready()

    def gang_ready(self, timeout: float) -> bool:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.gang is None:
            return False
        if not ray.wait([self.gang_ref], timeout=0)[0] and self.gang_avoid != placement_exclusions():
            # The quarantine changed while the gang waits: made again to keep off (or to use) those nodes.
            gang, n, self.gang = self.gang, self.gang_size, None
            try:
                remove_placement_group(gang)
            except Exception:  # removed already
                pass
            self.reserve_gang(n)
        done, _ = ray.wait([self.gang_ref], timeout=timeout)
        return bool(done)

    def _hand_over_gang(self) -> None:
        """The gang admitted the run; its resources go to the workers' own placement groups, made at once.
        A worker in a gang bundle would pin its replacement to that bundle's node, draining or not (Ray
        places a bundle again only once its node is dead): one placement group per worker lets a drain or
        a failure move a worker anywhere. Between the removal and the new groups another pending gang may
        take the resources: the run's workers then wait (SCHEDULING, then QUEUED again), holding nothing."""
        from ray.util.placement_group import remove_placement_group

        if self.gang is not None:
            try:
                remove_placement_group(self.gang)
            except Exception:  # removed already
                pass
            self._labeled_slots, self.gang, self.gang_size, self.gang_ref = self.gang_size, None, 0, None

    def _labels_for_next(self) -> dict[str, str]:
        """The minimum's label selector for as many live workers as the gang held, the elastic part's after."""
        labeled = sum(1 for w in self.workers.values() if w.labeled)
        return self.gang_labels if labeled < self._labeled_slots else self.elastic_labels

    def _free_bundle(self) -> int | None:
        held = {w.bundle for w in self.workers.values()}
        return next((b for b in range(self.gang_size) if b not in held), None) if self.gang is not None else None

    def start(self, n: int) -> list[str]:
        self._hand_over_gang()
        avoid = placement_exclusions()  # the quarantined nodes (orchestrator.service.quarantine)
        out = []
        for _ in range(n):
            wid = f"w{next(self._counter)}-{uuid.uuid4().hex[:4]}"
            bundle = self._free_bundle()
            self.workers[wid] = self._place(wid, bundle, None if bundle is not None else self._labels_for_next(),
                                            avoid, f"etrain-{self.run_id}-{wid}")
            out.append(wid)
        return out

    def _place(self, wid: str, bundle: int | None, labels: dict | None, avoid: frozenset, name: str) -> _Worker:
        """The worker's actor, in the gang's ``bundle``, or in a placement group of its own on a node with
        ``labels`` and none of ``avoid``."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if bundle is not None:  # a gang member
            pg, index, pg_ref = self.gang, bundle, self.gang_ref
        else:
            pg = placement_group([dict(self.resources)], strategy="PACK", name=name, **_selector(labels, 1, avoid))
            index, pg_ref = 0, pg.ready()
        opts = {
            "num_cpus": self.resources.get("CPU", 1), "num_gpus": self.resources.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            "max_restarts": 0, "max_task_retries": 0, "name": name,
        }
        if self.env:
            opts["runtime_env"] = {"env_vars": dict(self.env)}
        actor = _remote_worker_class().options(**opts).remote(self.config, wid, self.store_url, self.pg_timeout_s)
        return _Worker(wid, actor, pg, actor.info.remote(), pg_ref, bundle=bundle, avoid=avoid,
                       labeled=bundle is None and bool(labels) and labels == self.gang_labels)

    def _place_again_if_stale(self, wids: list[str]) -> None:
        """Workers still waiting for a placement group of their own, made before the quarantined nodes last
        changed, are placed again with the current ones: one made before a quarantine would take the node
        once it frees up, one made during it would never take the node once it is released."""
        import ray
        from ray.util.placement_group import remove_placement_group

        waiting = [w for w in map(self.workers.get, wids) if w and w.bundle is None and w.info is None]
        avoid = placement_exclusions() if waiting else frozenset()  # one read of Ray's GCS, while any wait
        stale = [w for w in waiting if w.avoid != avoid]
        placed = ray.wait([w.pg_ref for w in stale], num_returns=len(stale), timeout=0)[0] if stale else []
        for w in stale:
            if w.pg_ref in placed:  # it holds its node already: it stays there (its run moves it, if it must)
                w.avoid = avoid
                continue
            for undo in (lambda: ray.kill(w.actor, no_restart=True), lambda: remove_placement_group(w.pg)):
                try:
                    undo()
                except Exception:  # gone already
                    pass
            labels = self.gang_labels if w.labeled else self.elastic_labels
            self.workers[w.wid] = self._place(w.wid, None, labels, avoid,
                                              f"etrain-{self.run_id}-{w.wid}-{uuid.uuid4().hex[:4]}")

    def ready(self, wids: list[str], timeout: float) -> list[str]:
        """Those of ``wids`` whose actor is up (waits up to ``timeout`` for all of them); one whose
        first call failed (it died while starting) is killed, which drops it from ``workers``."""
        import ray

        self._place_again_if_stale(wids)
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

        self._place_again_if_stale(wids)
        waiting = {self.workers[w].pg_ref: w for w in wids if w in self.workers and self.workers[w].info is None}
        done, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0) if waiting else ([], [])
        booting = {waiting[r] for r in done}
        return [w for w in wids if w in self.workers and (self.workers[w].info is not None or w in booting)]

    def info(self, wid: str) -> dict:
        return self.workers[wid].info or {}

    def handle(self, wid: str) -> Any:
        """The worker's actor handle (another worker calls it: a restore's file fetch)."""
        return self.workers[wid].actor

    def submit(self, wid: str, method: str, *args) -> Call:
        if wid not in self.workers:
            raise WorkerLost(f"worker {wid} is gone")
        return Call(wid, method, getattr(self.workers[wid].actor, method).remote(*args))

    def wait(self, calls: list[Call], timeout: float, *, first: bool = False) -> list[Call]:
        import ray

        if not calls:
            return []
        by_ref = {c.ref: c for c in calls}
        done, _ = ray.wait(list(by_ref), num_returns=1 if first else len(by_ref), timeout=timeout)
        if first and done and len(by_ref) > 1:
            done, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
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
        if w.bundle is None:  # a gang member's bundle stays reserved for its replacement
            try:
                remove_placement_group(w.pg)
            except Exception:
                pass

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for wid in list(self.workers):
            self.kill(wid)
        if self.gang is not None:
            try:
                remove_placement_group(self.gang)
            except Exception:  # removed already (the job ended)
                pass
            self.gang, self.gang_size, self.gang_ref = None, 0, None


def _selector(labels: dict[str, str], bundles: int, avoid: frozenset = frozenset()) -> dict:
    """Ray's ``bundle_label_selector`` argument for ``bundles`` bundles on nodes with ``labels`` and none of
    ``avoid`` (the quarantined nodes) ({}: any node)."""
    selector = avoiding(labels, avoid)
    return {"bundle_label_selector": [dict(selector) for _ in range(bundles)]} if selector else {}


def remove_orphaned_placement_groups(run_id: str) -> int:
    """Remove the placement groups of ``run_id``'s workers that are still reserved: Ray frees a placement
    group when the *job* that created it ends, not when its creator actor dies, so a killed controller
    (Ctrl-C of ``etrain run``, a test's ``BackgroundRun.close``) would hold its workers' CPUs and GPUs
    for as long as the driver lives. Called once the run's controller is gone; returns how many."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    prefix, n = f"etrain-{run_id}-", 0
    for pg_id, info in placement_group_table().items():
        if str(info.get("name", "")).startswith(prefix) and info.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
                n += 1
            except Exception:  # removed meanwhile
                pass
    return n
