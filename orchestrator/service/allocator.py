"""The cluster's allocator: one detached, named Ray actor that decides how many workers each run of the
cluster should have, and writes it into each run's spec for its controller to follow.

    handle = ensure_allocator(store.url)             # the cluster's allocator; started if there is none
    register(handle, run_id, store.url)              # what `etrain run`, `etrain submit` and etrain.submit do
    core = AllocatorCore(store, capacity=lambda cpw, gpw: 3)   # the same logic without Ray (tests)
    plan = core.tick()                               # gather the runs' demands, decide, write the targets

Every ``interval_s`` the allocator reads each registered run's spec, status, history and events from
the run's own store (:mod:`orchestrator.service.demand`), the cluster's capacity in workers (alive
nodes, draining ones left out) and the teams' quotas, asks its policy
(:mod:`orchestrator.service.policy`; by default today's rules, :mod:`orchestrator.service.rules`;
``ETRAIN_SCHEDULING_POLICY`` names another) and writes what changed, each as a compare-and-swap on
the spec it read (a user's resize in between wins; the next decision reads it):

* ``target``: the size the run's controller works toward (0, never decided or withdrawn: the user's
  ``workers``);
* ``requeue``: give every worker back after a durable commit and wait in QUEUED (suspended for a
  higher priority), cleared when the run is admitted again.

Each decision is a run event ``allocated`` (action, workers, cause, reason); a shrink for another run,
or for the cluster's capacity or a quota, is also ``preempted`` (a suspend's ``preempted`` event is the
controller's, written when it has committed and given its workers back). Runs that ended leave
the registry. The registry, the last decision and why each queued run waits are the store document
``allocator`` of the store the allocator was started with; the quotas are its document ``quotas``
(``etrain quota``). A restarted allocator (Ray restarts it) reads them back: it decides from the specs
and statuses, so it stops nothing and places nothing twice.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable

from checkpointing.errors import ConfigError, EtrainError

from ..store import liveness
from ..store.documents import RunSpec, SpecConflict, StoreUnavailable, UnknownRun
from ..store.run_store import RunStore, open_store
from .demand import demand_of, desired
from .metrics import ClusterMetrics
from .policy import Admit, ClusterView, Plan, Restore, SchedulingPolicy, SetTarget, Suspend, policy_named
from .rules import default_policy

log = logging.getLogger("etrain")

ALLOCATOR_NAME = "etrain.allocator"
NAMESPACE = "etrain"
STATE_DOC = "allocator"
QUOTAS_DOC = "quotas"
INTERVAL_S = 2.0
POLICY_VAR = "ETRAIN_SCHEDULING_POLICY"  # the deployment's scheduling policy (docs/service.md)
PREEMPTING = {"preempted", "capacity", "quota"}


def read_doc(store: RunStore, name: str) -> tuple[dict, object]:
    """A store document of the allocator's as a dict ({} when absent or not one) and its version."""
    raw, version = store.read_versioned(None, name)
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        doc = {}
    return (doc if isinstance(doc, dict) else {}), version


def update_doc(store: RunStore, name: str, change: Callable[[dict], dict], attempts: int = 10) -> dict:
    """Apply ``change`` to a store document as a compare-and-swap, again when another writer got in between."""
    for _ in range(attempts):
        doc, version = read_doc(store, name)
        new = change(dict(doc))
        if store.write_if(None, name, json.dumps(new, sort_keys=True), version):
            return new
    raise EtrainError(f"the store's {name!r} document kept changing under {attempts} writes; try again")


def quotas(store: RunStore) -> dict[str, int]:
    teams = read_doc(store, QUOTAS_DOC)[0].get("teams", {})
    return {str(t): int(n) for t, n in teams.items() if isinstance(n, int) and not isinstance(n, bool) and n >= 0}


def set_quota(store: RunStore, team: str, max_workers: int | None) -> dict[str, int]:
    """Set (or, with None, remove) ``team``'s quota: the most workers its runs may hold together."""
    if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 0):
        raise ConfigError(f"--max-workers {max_workers} must be an integer >= 0")

    def change(doc: dict) -> dict:
        teams = dict(doc.get("teams", {}))
        if max_workers is None:
            teams.pop(team, None)
        else:
            teams[team] = max_workers
        return {**doc, "teams": teams}

    return update_doc(store, QUOTAS_DOC, change)["teams"]


class AllocatorCore:
    """The allocator's logic, without Ray: ``capacity(cpus_per_worker, gpus_per_worker)`` says how many
    workers the cluster holds now (or, as :func:`ray_capacity`, that and how many fit in what is free);
    ``opener`` opens a run's store from its URL; ``policy`` decides (the default rules without one)."""

    def __init__(self, state: RunStore, capacity: Callable[[float, float], int | tuple[int, int]], *, clock=time.time,
                 opener: Callable[[str], RunStore] = open_store, policy: SchedulingPolicy | None = None):
        self.state = state
        self.policy = policy or default_policy()
        self.capacity = capacity
        self.clock = clock
        self.opener = opener
        self._stores: dict[str, RunStore] = {state.url: state}
        self._sizes: dict[tuple[str, int], tuple] = {}
        self.lock = threading.Lock()
        self.last: dict = {}
        self.metrics = ClusterMetrics()
        self.phases: dict[str, str] = {}

    def runs(self) -> dict[str, str]:
        return dict(read_doc(self.state, STATE_DOC)[0].get("runs", {}))

    def register(self, run_id: str, store_url: str) -> None:
        update_doc(self.state, STATE_DOC, lambda d: {**d, "runs": {**d.get("runs", {}), run_id: store_url}})

    def _forget(self, gone: set[str]) -> None:
        if gone:
            update_doc(self.state, STATE_DOC,
                       lambda d: {**d, "runs": {r: u for r, u in d.get("runs", {}).items() if r not in gone}})

    def _store(self, url: str) -> RunStore:
        if url not in self._stores:
            self._stores[url] = self.opener(url)
        return self._stores[url]

    def _shape(self, spec: RunSpec) -> tuple:
        """(valid sizes in [min, max], global batch, total steps, cpus and gpus per worker) of the spec's
        config, parsed once per spec generation."""
        key = (spec.run_id, spec.generation)
        if key not in self._sizes:
            from trainer.config.load import config_from_dict

            from ..config import allowed_sizes

            cfg = config_from_dict(spec.config)
            self._sizes[key] = (tuple(allowed_sizes(cfg, spec.min_workers, spec.max_workers)),
                                cfg.train.global_batch, cfg.train.steps, spec.sharing.cpus_per_worker,
                                spec.sharing.gpus_per_worker)
        return self._sizes[key]

    def gather(self) -> tuple[list, dict[str, tuple[RunStore, RunSpec]], set[str], dict]:
        demands, specs, gone = [], {}, set()
        self.phases = {}
        per_worker = {"cpus": 0.0, "gpus": 0.0}
        for run_id, url in sorted(self.runs().items()):
            try:
                st = self._store(url)
                spec = st.get_spec(run_id)
                # A run whose controller is gone holds nothing: marked INTERRUPTED here if no one did yet.
                status = liveness.notice(st, run_id, st.get_status(run_id), by="the cluster's allocator")
                if (status or {}).get("phase", "INITIALIZING") == "INITIALIZING":
                    continue  # neither holding nor queued yet: its gang is asked for (QUEUED in 2 s if not granted)
                events = st.events(run_id)
                sizes, batch, steps, cpw, gpw = self._shape(spec)
                d = demand_of(spec, status, st.get_history(run_id), events, sizes=sizes, global_batch=batch,
                              total_steps=steps)
            except (UnknownRun, ConfigError, FileNotFoundError):
                gone.add(run_id)  # deleted, or a spec this version cannot read: nothing to allocate
                continue
            except (StoreUnavailable, EtrainError) as e:
                log.warning("allocator: run %r skipped this round: %s", run_id, e)
                continue
            if d is None:
                gone.add(run_id)
                continue
            demands.append(d)
            specs[run_id] = (st, spec)
            self.phases[run_id] = (status or {}).get("phase", "INITIALIZING")
            per_worker["cpus"] = max(per_worker["cpus"], cpw)
            per_worker["gpus"] = max(per_worker["gpus"], gpw)
        return demands, specs, gone, per_worker

    def tick(self) -> Plan:
        with self.lock:
            started = time.perf_counter()
            demands, specs, gone, pw = self.gather()
            self._forget(gone)
            cap = self.capacity(pw["cpus"] or 1.0, pw["gpus"])
            if isinstance(cap, tuple):  # (what the cluster holds, what is free now): see ray_capacity
                total, free = cap
                cap = min(total, sum(d.allocated for d in demands) + free)
            now = self.clock()
            plan = self.policy.decide(demands, ClusterView(capacity=cap, quotas=quotas(self.state)), now)
            applied = [a for d in plan.decisions if (a := self._apply(d, *specs[d.run_id]))]
            self.metrics.observe(demands, plan, self.phases, applied, time.perf_counter() - started, cap, now)
            self.last = {"decided_unix": time.time(), "capacity": cap, "targets": plan.targets,
                         "waiting": plan.waiting, "teams": {d.run_id: d.team for d in demands},
                         "priorities": {d.run_id: d.priority for d in demands},
                         "applied": applied}
            update_doc(self.state, STATE_DOC, lambda doc: {**doc, **self.last})
            return plan

    def _apply(self, d, store: RunStore, spec: RunSpec) -> dict | None:
        if isinstance(d, SetTarget) and d.cause in ("capacity", "valid") and "QUEUED" not in self.phases.values():
            # The cluster lost nodes and no run waits for them: the run's controller already runs at what it
            # can form and keeps its replacements pending, which a joining node places at once.
            return None
        if isinstance(d, Suspend):
            changes, action, workers, cause = {"requeue": True, "target": 0}, "suspend", 0, d.cause
        elif isinstance(d, Restore):  # the target withdrawn: the user's `workers` again
            changes, action, workers, cause = {"target": 0}, "grow", d.workers, "restored"
        else:
            workers = d.workers
            changes = {"requeue": False, "target": workers}
            action = "admit" if isinstance(d, Admit) else d.action
            cause = d.cause if isinstance(d, SetTarget) else "admitted"
        if all(getattr(spec, k) == v for k, v in changes.items()):
            return None
        try:
            store.update_spec(spec.run_id, expected=spec.generation, **changes)
        except (SpecConflict, StoreUnavailable, UnknownRun) as e:  # a user's change got in first: decide again
            log.info("allocator: %s of run %r not written (%s); deciding again", action, spec.run_id, e)
            return None
        event = {"action": action, "workers": workers, "cause": cause, "reason": d.reason,
                 "from_workers": desired(spec) if not spec.requeue else 0}
        store.add_event(spec.run_id, {"kind": "allocated", **event})
        if action == "shrink" and cause in PREEMPTING:  # a suspend's `preempted` is the controller's, at its commit
            store.add_event(spec.run_id, {"kind": "preempted", **event})
        return {"run_id": spec.run_id, **event}


def ray_capacity(cpus_per_worker: float, gpus_per_worker: float,
                 draining: frozenset[str] | None = None) -> tuple[int, int]:
    """(workers the live Ray cluster holds, workers that fit in what is free now): each alive node's CPUs
    (GPUs, when workers take GPUs) over what one worker takes, the draining nodes (``draining``, node
    ids; by default Ray's, :func:`orchestrator.service.drains.ray_draining_nodes`) left out. The allocator counts
    as capacity what its runs were granted plus what is free, never more than the cluster holds: what
    others hold (standby spares, other jobs) is not the runs' to share."""
    import ray

    if draining is None:
        from .drains import ray_draining_nodes

        try:
            draining = frozenset(ray_draining_nodes())
        except Exception:  # the drain state unreadable this round: count every alive node
            draining = frozenset()
    key, per = ("GPU", gpus_per_worker) if gpus_per_worker > 0 else ("CPU", max(cpus_per_worker, 1e-6))
    total = 0
    for n in ray.nodes():
        if not n.get("Alive") or n.get("NodeID") in draining:
            continue
        total += int(n.get("Resources", {}).get(key, 0) // per)
    available = ray.available_resources().get(key, 0)
    free = int(available // per)
    return total, min(free, total)


class Allocator:
    """The Ray actor (``ensure_allocator``): an :class:`AllocatorCore` on the live cluster, ticking on a
    thread of its own."""

    def __init__(self, state_url: str, interval_s: float = INTERVAL_S):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s etrain-allocator %(levelname)s %(message)s")
        policy = policy_named(os.environ.get(POLICY_VAR) or "default")  # the cluster's environment names it
        log.info("allocator: scheduling policy %r", policy.name)
        self.core = AllocatorCore(open_store(state_url), ray_capacity, policy=policy)
        self.interval_s = interval_s
        self.state_url = state_url
        self.endpoint = start_endpoint(self.core.metrics)
        threading.Thread(target=self._loop, name="allocator", daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                self.core.tick()
            except Exception as e:  # an outage of the state store, a bug: log it and decide again later
                log.warning("allocator: decision failed: %s", e)
            time.sleep(self.interval_s)

    def register(self, run_id: str, store_url: str) -> str:
        self.core.register(run_id, store_url)
        return self.state_url

    def state(self) -> dict:
        return {"state_url": self.state_url, "runs": self.core.runs(), **self.core.last,
                "metrics_url": self.endpoint.url if self.endpoint else None}

    def tick(self) -> dict:
        plan = self.core.tick()
        return {"targets": plan.targets, "waiting": plan.waiting}


def start_endpoint(metrics: ClusterMetrics):
    """The allocator's /metrics endpoint on this node's address (127.0.0.1 on a local cluster), registered
    for Prometheus file_sd discovery; None when it cannot listen (the allocator decides all the same)."""
    import ray

    from trainer.observe.endpoint import MetricsEndpoint

    try:
        return MetricsEndpoint(metrics, addr=ray.util.get_node_ip_address(), port=0)
    except OSError as e:
        log.warning("allocator: no metrics endpoint: %s", e)
        return None


def ensure_allocator(state_url: str):
    """The cluster's allocator actor, started (detached, named, restarted by Ray when it dies) if there is none."""
    import ray

    cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=4)(Allocator)
    return cls.options(name=ALLOCATOR_NAME, namespace=NAMESPACE, lifetime="detached",
                       get_if_exists=True).remote(state_url)


def find_allocator():
    """The running allocator actor, or None."""
    import ray

    try:
        return ray.get_actor(ALLOCATOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def register(spec: RunSpec, store_url: str, timeout_s: float = 30.0) -> str | None:
    """Tell the cluster's allocator (started if none) about ``spec``'s run; the allocator's state store, or
    None when it could not be reached (the run goes on as a run of its own, with a warning)."""
    import ray

    try:
        handle = ensure_allocator(store_url)
        return ray.get(handle.register.remote(spec.run_id, store_url), timeout=timeout_s)
    except Exception as e:
        log.warning("run %r: the cluster's allocator is not reachable (%s); the run is sized by its own spec",
                    spec.run_id, e)
        return None
