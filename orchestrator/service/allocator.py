"""The cluster's allocator: one detached, named Ray actor that decides how many workers each run of the
cluster should have, and writes it into each run's spec for its controller to follow.

    handle = ensure_allocator(store.url)             # the cluster's allocator; started if there is none
    register(handle, run_id, store.url)              # what `etrain run`, `etrain submit` and etrain.submit do
    core = AllocatorCore(store, capacity=lambda cpw, gpw: 3)   # the same logic without Ray (tests)
    plan = core.tick()                               # gather the runs' demands, decide, write the targets

Every ``interval_s`` the allocator reads each registered run's spec, status, history and events from
the run's own store (:mod:`orchestrator.service.demand`), the cluster's capacity in workers (alive
nodes, draining and quarantined ones left out: :mod:`orchestrator.service.capacity`), the quarantined
nodes (:mod:`orchestrator.service.quarantine`, which it also writes to Ray's GCS for placement to read)
and the teams' quotas, asks its policy
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
the registry. Runs are keyed by run id and store together (:func:`orchestrator.store.cluster_names.cluster_key`):
two stores' runs of one id are two runs.

The registry, the last decision and why each queued run waits are the store document ``allocator`` of
the cluster's service store (``etrain service init``, :mod:`orchestrator.service.grants`), or, on a
cluster without one, of the store the allocator was started with; the quotas are its document
``quotas`` (``etrain quota``) and the owners' grants its document ``grants``, which bound every run's
claims at every decision. A restarted allocator (Ray restarts it) reads them back: it decides from the
specs and statuses, so it stops nothing and places nothing twice.

One run's documents never stop a decision: each run's are read within :data:`READ_BUDGET_S` (on a
thread of their own), checked (a phase of the enum, sizes within bounds, finite rates and times), and a
run whose documents are unreadable, invalid or slow is left out of that round, with an ``allocator``
event on the run (once per reason), a log line and the metric ``etrain_allocator_skipped_runs``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

from checkpointing.errors import ConfigError, EtrainError

from ..store import liveness
from ..store.cluster_names import cluster_key, controller_name
from ..store.documents import RunSpec, SpecConflict, StoreUnavailable, UnknownRun, is_run_id
from ..store.run_store import RunStore, open_store
from .capacity import ray_capacity
from .demand import demand_of, desired
from .docs import QUOTAS_DOC, STATE_DOC, dict_field, quotas, read_doc, set_quota, update_doc  # noqa: F401
from .grants import clamp, grants_of, service_url
from .metrics import ClusterMetrics
from .policy import MAX_WORKERS, Admit, ClusterView, Plan, Restore, SchedulingPolicy, SetTarget, Suspend, policy_named
from .quarantine import publish, quarantined_nodes
from .rules import default_policy

log = logging.getLogger("etrain")

ALLOCATOR_NAME = "etrain.allocator"
NAMESPACE = "etrain"
INTERVAL_S = 2.0
POLICY_VAR = "ETRAIN_SCHEDULING_POLICY"  # the deployment's scheduling policy (docs/service.md)
PREEMPTING = {"preempted", "capacity", "quota"}
READ_BUDGET_S = 10.0  # the most one run's documents may take to read in a decision; slower: skipped this round


def registry_entries(doc: dict) -> dict[str, tuple[str, str]]:
    """The registry of an allocator state document: cluster key -> (run id, store URL). Entries that are not
    one are left out; the form of older allocators (run id -> store URL) is read as well."""
    out = {}
    for key, value in dict_field(doc, "runs").items():
        if isinstance(value, dict):
            run_id, url = value.get("run_id"), value.get("store")
        else:
            run_id, url = key, value
        if isinstance(run_id, str) and is_run_id(run_id) and isinstance(url, str) and 0 < len(url) <= 4096:
            out[cluster_key(run_id, url) if not isinstance(value, dict) else key] = (run_id, url)
    return out


def registry_doc(entries: dict[str, tuple[str, str]]) -> dict[str, dict]:
    """:func:`registry_entries` as the state document stores them: cluster key -> {run_id, store}."""
    return {k: {"run_id": r, "store": u} for k, (r, u) in entries.items()}


class SkipRun(Exception):
    """A run left out of this decision: ``kind`` (unreadable, invalid, slow) and why."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


class AllocatorCore:
    """The allocator's logic, without Ray: ``capacity(cpus_per_worker, gpus_per_worker)`` says how many
    workers the cluster holds now (or, as :func:`ray_capacity`, that and how many fit in what is free);
    ``opener`` opens a run's store from its URL; ``policy`` decides (the default rules without one);
    ``publish`` gets the quarantined nodes at every decision (the actor's writes them to Ray's GCS)."""

    def __init__(self, state: RunStore, capacity: Callable[[float, float], int | tuple[int, int]], *, clock=time.time,
                 opener: Callable[[str], RunStore] = open_store, policy: SchedulingPolicy | None = None,
                 read_budget_s: float = READ_BUDGET_S, alive: Callable[[str, str], bool] = lambda run_id, url: False,
                 publish: Callable[[dict], object] = lambda quarantined: None):
        self.state = state
        self.publish = publish  # where the quarantined nodes go for placement to read (quarantine.publish on Ray)
        self.alive = alive  # whether the run's controller is live (a resumed run's status may still say SUSPENDED)
        self.policy = policy or default_policy()
        self.capacity = capacity
        self.clock = clock
        self.opener = opener
        self.read_budget_s = read_budget_s
        self._stores: dict[str, RunStore] = {state.url: state}
        self._sizes: dict[tuple[str, int], tuple] = {}
        self.lock = threading.Lock()
        self.last: dict = {}
        self.metrics = ClusterMetrics()
        self.phases: dict[str, str] = {}
        self.skipped: dict[str, str] = {}  # cluster key -> why the run was left out of the last decision
        self.cuts: dict[str, str] = {}  # cluster key -> what its owner's grant cut of its claims, last decision
        self.grants = None  # the owners' grants of the service store (None: claims taken as written)
        self.quarantined: dict[str, dict] = {}  # node id -> its entry, as last read (kept when a read fails)
        self._quarantine_error = ""
        # Reads of a run's documents run here, each bounded by read_budget_s: one run's store cannot stall a round.
        self._readers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="allocator-read")
        self._pending: dict[str, Future] = {}

    def runs(self) -> dict[str, tuple[str, str]]:
        """The registered runs: cluster key -> (run id, store URL)."""
        return registry_entries(read_doc(self.state, STATE_DOC)[0])

    def register(self, run_id: str, store_url: str) -> str:
        """Register ``run_id`` of ``store_url``; its cluster key (the run id and its store, :func:`cluster_key`)."""
        key = cluster_key(run_id, store_url)

        update_doc(self.state, STATE_DOC, lambda d: {
            **d, "runs": registry_doc({**registry_entries(d), key: (run_id, store_url)})})
        # On the run too: every start and resume of it says that the cluster's allocator sizes it (etrain events).
        self._event(store_url, run_id, {"kind": "allocator", "action": "registered", "key": key})
        return key

    def move_state(self, state: RunStore) -> None:
        """Keep the state in ``state`` from now on (the cluster's service store was named): the registry moves."""
        entries = self.runs()
        update_doc(state, STATE_DOC, lambda d: {**d, "runs": registry_doc({**registry_entries(d), **entries})})
        log.info("allocator: state moves to the service store %s (%d runs)", state.url, len(entries))
        self.state = state
        self._stores[state.url] = state

    def _forget(self, gone: set[str]) -> None:
        if gone:
            update_doc(self.state, STATE_DOC, lambda d: {**d, "runs": registry_doc(
                {k: v for k, v in registry_entries(d).items() if k not in gone})})

    def _store(self, url: str) -> RunStore:
        if url not in self._stores:
            self._stores[url] = self.opener(url)
        return self._stores[url]

    def _shape(self, spec: RunSpec) -> tuple:
        """(valid sizes in [min, max], global batch, total steps, cpus and gpus per worker) of the spec's
        config, parsed once per spec generation."""
        key = (spec.run_id, spec.generation, spec.min_workers, spec.max_workers)
        if key not in self._sizes:
            from trainer.config.load import config_from_dict

            from ..config import allowed_sizes

            if not 1 <= spec.min_workers <= spec.max_workers <= MAX_WORKERS or not 1 <= spec.workers <= MAX_WORKERS:
                raise SkipRun("invalid", f"its sizes (workers {spec.workers}, min {spec.min_workers}, max "
                                         f"{spec.max_workers}) are not 1 <= min <= max <= {MAX_WORKERS}")
            cfg = config_from_dict(spec.config)
            share = spec.sharing
            if not (math.isfinite(share.cpus_per_worker) and math.isfinite(share.gpus_per_worker)):
                raise SkipRun("invalid", "its cpus_per_worker or gpus_per_worker is not finite")
            if len(self._sizes) > 4096:
                self._sizes.clear()
            self._sizes[key] = (tuple(allowed_sizes(cfg, spec.min_workers, spec.max_workers)),
                                cfg.train.global_batch, cfg.train.steps, share.cpus_per_worker, share.gpus_per_worker)
        return self._sizes[key]

    def _read_run(self, key: str, run_id: str, url: str):
        """One run's demand from its documents, the run's store and spec, its phase, and whether it is gone.
        Raises SkipRun when its documents cannot be used this round."""
        st = self._store(url)
        try:
            spec = st.get_spec(run_id)
            # A run whose controller is gone holds nothing: marked INTERRUPTED here if no one did yet.
            status = liveness.notice(st, run_id, st.get_status(run_id), by="the cluster's allocator")
            phase = (status or {}).get("phase", "INITIALIZING")  # one of Phase: get_status checked it
            if phase == "INITIALIZING":
                return None  # neither holding nor queued yet: its gang is asked for (QUEUED in 2 s if not granted)
            events = st.events(run_id)
            sizes, batch, steps, cpw, gpw = self._shape(spec)
            d = demand_of(spec, status, st.get_history(run_id), events, sizes=sizes, global_batch=batch,
                          total_steps=steps)
            if d is None:  # ended, suspended or stopping; forgotten only once its controller is gone too
                return None if self.alive(run_id, url) else "gone"
            d, cut = clamp(replace(d, run_id=key, shown=run_id), spec.owner, self.grants)
        except (UnknownRun, FileNotFoundError):
            return "gone"  # deleted: nothing to allocate
        except SkipRun:
            raise
        except (StoreUnavailable, TimeoutError) as e:
            raise SkipRun("unreadable", str(e)) from None
        except (ConfigError, EtrainError, ValueError, TypeError, OverflowError, RecursionError) as e:
            raise SkipRun("invalid", str(e)) from None
        return d, st, spec, phase, cut, cpw, gpw

    def gather(self) -> tuple[list, dict[str, tuple[RunStore, RunSpec]], set[str], dict]:
        demands, specs, gone = [], {}, set()
        self.phases = {}
        skipped: dict[str, str] = {}
        cuts: dict[str, str] = {}
        per_worker = {"cpus": 0.0, "gpus": 0.0}
        entries = sorted(self.runs().items())
        for key, (run_id, url) in entries:  # a read still stuck from an earlier round is not started again
            if key not in self._pending or self._pending[key].done():
                self._pending[key] = self._readers.submit(self._read_run, key, run_id, url)
        deadline = time.monotonic() + self.read_budget_s
        for key, (run_id, url) in entries:
            try:
                got = self._pending[key].result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                got = SkipRun("slow", f"its documents took over {self.read_budget_s:g} s to read")
            except SkipRun as e:
                got = e
            except Exception as e:  # whatever one run's documents do, the others are decided on
                got = SkipRun("invalid", f"{type(e).__name__}: {e}")
            if isinstance(got, SkipRun):
                skipped[key] = str(got)[:500]
                self.metrics.skip(got.kind)
                if self.skipped.get(key) != skipped[key]:  # said once per new reason, not every round
                    log.warning("allocator: run %r (%s) left out of this decision: %s", run_id, url, skipped[key])
                    self._event(url, run_id, {"kind": "allocator", "action": "skipped", "reason": skipped[key]})
                continue
            if got is None:
                continue
            if got == "gone":
                gone.add(key)
                continue
            d, st, spec, phase, cut, cpw, gpw = got
            if cut:
                cuts[key] = cut
                if cut != self.cuts.get(key):  # said once per change, as a skip is
                    self._event(url, run_id, {"kind": "allocator", "action": "granted", "reason": cut})
            demands.append(d)
            specs[key] = (st, spec)
            self.phases[key] = phase
            per_worker["cpus"] = max(per_worker["cpus"], cpw)
            per_worker["gpus"] = max(per_worker["gpus"], gpw)
        self.skipped, self.cuts = skipped, cuts
        self._pending = {k: f for k, f in self._pending.items() if not f.done()}  # the stuck ones only
        return demands, specs, gone, per_worker

    def _event(self, url: str, run_id: str, event: dict) -> None:
        try:
            self._store(url).add_event(run_id, event)
        except Exception as e:  # a store that refuses the event refuses nothing else of the allocator
            log.info("allocator: event on run %r not written: %s", run_id, e)

    def tick(self) -> Plan:
        with self.lock:
            started = time.perf_counter()
            try:
                self.grants = grants_of(self.state)
            except Exception as e:  # the service store away: the grants of the last round stand
                log.warning("allocator: the grants could not be read (%s); the last ones apply", e)
            self._read_quarantine()  # before the capacity: it leaves these nodes out
            demands, specs, gone, pw = self.gather()
            self._forget(gone)
            cap = self.capacity(pw["cpus"] or 1.0, pw["gpus"])
            if isinstance(cap, tuple):  # (what the cluster holds, what is free now): see ray_capacity
                total, free = cap
                cap = min(total, sum(d.allocated for d in demands) + free)
            now = self.clock()
            held = {n: e["reason"] for n, e in self.quarantined.items()}
            plan = self.policy.decide(demands, ClusterView(capacity=cap, quotas=quotas(self.state), quarantined=held),
                                      now)
            applied = [a for d in plan.decisions if (a := self._apply(d, *specs[d.run_id]))]
            self.metrics.observe(demands, plan, self.phases, applied, time.perf_counter() - started, cap, now)
            self.metrics.quarantine(len(held))
            self.last = {"decided_unix": time.time(), "capacity": cap, "targets": plan.targets,
                         "waiting": plan.waiting, "teams": {d.run_id: d.team for d in demands},
                         "priorities": {d.run_id: d.priority for d in demands},
                         "skipped": self.skipped, "applied": applied, "quarantined": sorted(held)}
            update_doc(self.state, STATE_DOC, lambda doc: {**doc, **self.last})
            return plan

    def _read_quarantine(self) -> None:
        """The quarantined nodes of the state store, published to Ray's GCS (every decision: a release made
        without Ray, or a GCS restarted, is caught up within one); a document that cannot be read or is not
        etrain's leaves the last set standing, said once per new error."""
        try:
            self.quarantined, self._quarantine_error = quarantined_nodes(self.state), ""
        except Exception as e:
            if str(e) != self._quarantine_error:
                log.warning("allocator: the quarantined nodes could not be read (%s); the %d read last stand", e,
                            len(self.quarantined))
            self._quarantine_error = str(e)
        try:
            self.publish(self.quarantined)
        except Exception as e:  # the GCS away for a moment: written again at the next decision
            log.info("allocator: the quarantined nodes were not published: %s", e)

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
        # Why, kept beside the target for the run's own output (`size_reason`); "" once the target is withdrawn.
        held = changes.get("target") or changes.get("requeue")
        changes["target_cause"] = f"{cause}: {d.reason}"[:300] if held else ""
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


def controller_alive(run_id: str, store_url: str) -> bool:
    """Whether the run's controller actor lives on the connected cluster (a run being resumed, or one that
    has not written its status since its driver registered it)."""
    import ray

    try:
        ray.get_actor(controller_name(run_id, store_url), namespace="etrain")
    except ValueError:
        return False
    return True


class Allocator:
    """The Ray actor (``ensure_allocator``): an :class:`AllocatorCore` on the live cluster, ticking on a
    thread of its own. Its state is the cluster's service store once one is named (``etrain service init``,
    looked up at every decision), else the store of the run that started it."""

    def __init__(self, state_url: str, interval_s: float = INTERVAL_S):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s etrain-allocator %(levelname)s %(message)s")
        policy = policy_named(os.environ.get(POLICY_VAR) or "default")  # the cluster's environment names it
        log.info("allocator: scheduling policy %r", policy.name)
        self.core = AllocatorCore(open_store(service_url() or state_url), ray_capacity, policy=policy,
                                  alive=controller_alive, publish=publish)
        self.interval_s = interval_s
        self.endpoint = start_endpoint(self.core.metrics)
        threading.Thread(target=self._loop, name="allocator", daemon=True).start()

    @property
    def state_url(self) -> str:
        return self.core.state.url

    def _follow_service(self) -> None:
        """Move the state to the cluster's service store when one was named since."""
        url = service_url()
        if url and url != self.core.state.url:
            with self.core.lock:
                self.core.move_state(open_store(url))

    def _loop(self) -> None:
        while True:
            try:
                self._follow_service()
                self.core.tick()
            except Exception as e:  # an outage of the state store, a bug: log it and decide again later
                log.warning("allocator: decision failed: %s", e)
            time.sleep(self.interval_s)

    def register(self, run_id: str, store_url: str) -> str:
        self._follow_service()
        self.core.register(run_id, store_url)
        return self.state_url

    def state(self) -> dict:
        return {"state_url": self.state_url, "runs": registry_doc(self.core.runs()), **self.core.last,
                "metrics_url": self.endpoint.url if self.endpoint else None}

    def tick(self) -> dict:
        self._follow_service()
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
        handle = ensure_allocator(service_url() or store_url)
        return ray.get(handle.register.remote(spec.run_id, store_url), timeout=timeout_s)
    except Exception as e:
        log.warning("run %r: the cluster's allocator is not reachable (%s); the run is sized by its own spec",
                    spec.run_id, e)
        return None
