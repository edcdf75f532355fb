"""Start a run on Ray and follow it: what ``etrain run`` and ``etrain resume`` do.

    spec, store = prepare_run("examples/tiny.toml", overrides, workers=4)
    final = launch(spec, store, address=None)       # local Ray on 127.0.0.1 unless RAY_ADDRESS is set
    sys.exit(exit_code(final))

    run = BackgroundRun(spec, store)                # the same in a thread (Ray connected already) ...
    run.wait(lambda s: s["step"] >= 6)             # ... with live snapshots from the run's controller
    final = run.join()

The driver (this process; under ``ray job submit``, the job's entrypoint)
starts one :class:`orchestrator.controller.actor.ControllerActor` per run,
which owns the worker group and drives the state machine of
:mod:`orchestrator.controller.controller`. The driver only watches: it polls the
controller for a live view (the run store has the same figures for any other
machine) and prints events as they happen.

The run's document (``RunSpec.config``, the TOML as JSON in the run store) is
parsed once where it is read (:func:`parse_spec`) into the trainer's
``RunConfig`` and the orchestrator's ``ElasticConfig``; from there on only
those typed objects travel: to the controller actor, the controller and,
through the worker group, every worker.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable

from checkpointing.errors import ConfigError, EtrainError
from checkpointing.names import check_url, redact, redact_text, validate_run_id
from trainer.config import RunConfig
from trainer.config.load import config_from_dict, load_raw

from ..service import auth, grants
# Imported with this module, not when a run launches: a Ray job's driver that joined its cluster (ray.init)
# may no longer find the job's working directory's modules it had not imported yet.
from ..service.allocator import register as register_with_allocator
from ..store import liveness
from ..store import user_runs as registry
from ..config import ElasticConfig, check_sizes, elastic_from_raw, recovery_from_raw
from ..controller.controller import ControllerOptions
from ..controller.actor import ControllerActor
from ..phase import Phase
from ..controller.run_policy import FailurePolicy
from ..store.cluster_names import controller_name
from ..store.documents import writing
from ..store.run_store import RunSpec, RunStore, UnknownRun, open_store
from ..store.urls import default_root, store_url_for
from .cluster import TOKEN_HELP, connect, use_ray_token
from .cluster import first_line as _first_line
from .progress import Follower

log = logging.getLogger("etrain")


def prepare_run(config_path: str, overrides: list[str], *, workers: int | None = None,
                min_workers: int | None = None, max_workers: int | None = None, run_id: str | None = None,
                store: str | None = None, token_hash: str | None = None, owner: str | None = None,
                join: Callable[[], object] | None = None) -> tuple[RunSpec, RunStore]:
    """Validate everything a run needs (ConfigError on any mistake) and record it in the store."""
    return prepare_run_doc(load_raw(config_path, overrides), workers=workers, min_workers=min_workers,
                           max_workers=max_workers, run_id=run_id, store=store, token_hash=token_hash, owner=owner,
                           join=join)


def prepare_run_doc(raw: dict, *, workers: int | None = None, min_workers: int | None = None,
                    max_workers: int | None = None, run_id: str | None = None, store: str | None = None,
                    token: str | None = None, token_hash: str | None = None, owner: str | None = None,
                    join: Callable[[], object] | None = None) -> tuple[RunSpec, RunStore]:
    """:func:`prepare_run` for a run document already read (the Python API's dicts and RunConfigs).

    The run gets an owner (``owner``, else this user) and a token (``token``, else a new one) that this
    user's run registry keeps and whose sha256 the store keeps (:mod:`orchestrator.service.auth`). With
    ``token_hash`` (the job of a run that `etrain submit` started and whose token it kept) only the
    hash is known here. ``join``: joins the run's Ray cluster (called once everything else is checked), so
    that the cluster's grants (:mod:`orchestrator.service.grants`) are checked before the run is recorded."""
    if token_hash is not None and not auth.HASH_PATTERN.fullmatch(token_hash):
        raise ConfigError("--token-hash must be sha256:<64 hex digits> (etrain submit passes it)")
    if run_id is not None:
        raw["run_id"] = validate_run_id(run_id, "--run-id")
    raw = with_durable_checkpoints(raw)
    cfg, ecfg = parse_config(raw, workers=workers, min_workers=min_workers, max_workers=max_workers)
    check_sizes(cfg, ecfg)
    from trainer.preflight import preflight  # torch: only when a run really starts

    # The checks `etrain train` makes too, as rank 0 at the requested size: its offload share is checked
    # here where the job's driver runs; the device is the workers', so its features are theirs to check.
    preflight(cfg, world_size=ecfg.workers)
    if cfg.data.tokenizer != "bytes" or cfg.data.source == "python":
        from trainer.data.corpus import prepare  # tokenize once here, not in every worker's start-up

        prepare(cfg)
    url = store_url_for(store, ecfg, cfg.checkpoint.url)
    st = open_store(url)
    if token_hash is None:
        token = token or auth.mint()
    spec = RunSpec(run_id=cfg.run_id, config=raw, workers=ecfg.workers, min_workers=ecfg.min_workers,
                   max_workers=ecfg.max_workers, owner=owner or auth.current_user(),
                   token_hash=token_hash or auth.digest(token))
    try:
        st.get_spec(cfg.run_id)  # a run the store knows: create_run says how to continue it
    except UnknownRun:
        from trainer.checkpoints import checkpoint_preflight  # torch: only when a run really starts

        checkpoint_preflight(cfg, resume=False, fix="they were written by another run of that id")
    if join is not None:  # the cluster joined last: a job's driver imports nothing of etrain's after ray.init
        join()
    grants.check_on_cluster(spec.owner, spec.sharing)  # a claim beyond the owner's grant: exit 2, nothing recorded
    st.create_run(spec)
    if token is None:  # submitted: keep the token `etrain submit` recorded, if this machine shares its registry
        kept = registry.token_of(cfg.run_id)
        token = kept if auth.matches(kept, spec.token_hash) else None
    registry.record(cfg.run_id, url, token=token)  # control commands from any directory find it, and its token
    return spec, st


def with_durable_checkpoints(raw: dict) -> dict:
    """The run document with the checkpoint defaults a run under the orchestrator needs (a copy).

    Recovery needs a durable tier: without ``checkpoint.url`` the run keeps its
    checkpoints under :func:`default_root`, every 10 steps unless the document
    sets ``checkpoint.interval_steps``. They go into the document, not only the
    parsed config, because the run store keeps the document (a resume from
    another directory must find the same root) and because the checkpoint
    section is validated as a whole when it is parsed.
    """
    ckpt = raw.get("checkpoint", {})
    if not isinstance(ckpt, dict):
        return raw  # the parser names the mistake
    ckpt = {**ckpt, "url": ckpt.get("url") or default_root()}
    ckpt.setdefault("interval_steps", 10)
    return {**raw, "checkpoint": ckpt}


def parse_config(doc: dict, *, workers: int | None = None, min_workers: int | None = None,
                 max_workers: int | None = None) -> tuple[RunConfig, ElasticConfig]:
    """A run document parsed: the trainer's config, and ``[elastic]`` with the given sizes taking precedence."""
    recovery_from_raw(doc)  # checked with the rest, before anything starts
    return config_from_dict(doc), elastic_from_raw(doc, workers=workers, min_workers=min_workers,
                                                   max_workers=max_workers)


def parse_spec(spec: RunSpec) -> tuple[RunConfig, ElasticConfig]:
    """The run's document parsed, with the sizes the spec holds now."""
    return parse_config(spec.config, workers=spec.workers, min_workers=spec.min_workers,
                        max_workers=spec.max_workers)


def prepare_resume(run_id: str, store_url: str, workers: int | None, *, token: str | None = None,
                   grant: str | None = None) -> tuple[RunSpec, RunStore]:
    """Mark a suspended (or interrupted) run to continue, optionally on another size. Needs the run's
    token or the admin token (``token``, else found as :func:`orchestrator.service.auth.candidates` says), or the
    one-use ``grant`` that `etrain resume --submit` handed to this job."""
    validate_run_id(run_id, "run_id")
    st = open_store(check_url(store_url, "--store"))
    liveness.notice(st, run_id, st.get_status(run_id), by="etrain resume")

    def changes(spec: RunSpec) -> dict:
        st.check_resumable(run_id)
        # A run the allocator had requeued (and that waited past queue_timeout_s) rejoins the queue afresh.
        out: dict = {"suspended": False, "stop": False, "requeue": False, "target": 0}
        if workers is not None:
            cfg, ecfg = parse_config(spec.config, workers=workers, min_workers=min(spec.min_workers, workers),
                                     max_workers=max(spec.max_workers, workers))
            check_sizes(cfg, ecfg)
            out.update(workers=workers, min_workers=ecfg.min_workers, max_workers=ecfg.max_workers)
        from trainer.checkpoints import checkpoint_preflight  # torch: only when a run really resumes

        checkpoint_preflight(parse_spec(spec)[0], resume=True)  # its checkpoints must still be writable
        return out

    return auth.change_run(st, run_id, changes, token, grant=grant), st


# --- Ray ---------------------------------------------------------------------------


def controller_options(e: ElasticConfig) -> ControllerOptions:
    """The controller's timings and failure policy as ``[elastic]`` sets them."""
    return ControllerOptions(hang_timeout_s=e.hang_timeout_s, replace_wait_s=e.replace_wait_s,
                             boot_timeout_s=e.boot_timeout_s, standby=e.standby, queue_timeout_s=e.queue_timeout_s,
                             failure=FailurePolicy(max_failures=e.max_failures, backoff_s=e.backoff_s))


def worker_resources(e: ElasticConfig) -> dict:
    """One worker's Ray resources; ``gpus_per_worker=-1``: one GPU each when the cluster has GPUs."""
    import ray

    gpus = e.gpus_per_worker
    if gpus < 0:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    return {"CPU": e.cpus_per_worker, "GPU": gpus}


def start_controller(spec: RunSpec, store_url: str, cfg: RunConfig, ecfg: ElasticConfig):
    """The run's controller, on this process's node: the driver's (the head node under ``ray job
    submit``), which the job cannot outlive anyway. Never on a worker's node, whose loss it must
    survive."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    cls = ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(ControllerActor)
    name = controller_name(spec.run_id, store_url)
    return cls.options(name=name, get_if_exists=False, scheduling_strategy=here).remote(
        spec, store_url, cfg, worker_resources(ecfg), controller_options(ecfg))


def launch(spec: RunSpec, store: RunStore, *, address: str | None = None, progress: bool = True,
           num_cpus: int | None = None) -> dict:
    """Run ``spec`` to a terminal phase on Ray and return the final status.

    SIGTERM (``ray job stop``, a scheduler, ``kill``) suspends the run: the controller stops at the next
    step boundary, commits a checkpoint and ends SUSPENDED (event ``suspended`` with ``cause: "SIGTERM"``);
    this returns then. If the controller dies, or this process kills it (Ctrl-C), the run is marked
    INTERRUPTED (:mod:`orchestrator.store.liveness`) rather than left looking alive."""
    import ray

    cfg, e = parse_spec(spec)
    # A local Ray holds what the run may grow to, and at least this machine's cores: a user's resize beyond
    # max_workers (which raises it) finds room, as it would on a cluster with free nodes.
    need = int((max(spec.max_workers, spec.workers) + e.standby) * e.cpus_per_worker) or 1
    cpus = num_cpus or max(need, os.cpu_count() or 1)
    local = connect(address, cpus)
    actor, final, snap = None, None, None
    terminated = threading.Event()
    restore = _on_sigterm(terminated.set)  # after connect: ray.init installs a SIGTERM handler of its own
    try:
        actor = start_controller(spec, store.url, cfg, e)
        register_with_allocator(spec, store.url)  # the cluster's allocator sizes the run among the others
        done = actor.run.remote()
        follower = Follower(spec.run_id, cfg.train.steps, live=progress)
        seen, asked = 0, False
        with follower:
            while True:
                if terminated.is_set() and not asked:
                    asked = True
                    actor.suspend.remote("SIGTERM")
                    log.warning("SIGTERM: run %r suspends at its next step boundary, after a checkpoint; `etrain "
                                "resume %s` continues it%s", spec.run_id, spec.run_id, _grace_note())
                ready, _ = ray.wait([done], timeout=0.5)
                try:
                    live = ray.get(actor.snapshot.remote(), timeout=5)
                    new = ray.get(actor.events_since.remote(seen), timeout=5)
                except Exception:  # the controller is gone; its run() result says why
                    live, new = None, []
                snap = live or snap
                seen += len(new)
                follower.update(live, new)
                if ready:
                    final = ray.get(done)
                    follower.update(final, [])
                    return final
    except ray.exceptions.RayActorError as err:  # the controller died: the run is interrupted, not running
        final = _interrupted(store, spec.run_id, snap, f"its controller died ({_first_line(str(err))})")
        if final is None:
            raise
        return final
    finally:
        restore()
        if actor is not None:  # its name is free at once for a resume of the same run
            ray.kill(actor, no_restart=True)
            if final is None:  # Ctrl-C, or an error here: the controller dies with this process
                _interrupted(store, spec.run_id, snap, "its driver (etrain run) ended before the run did")
        if actor is not None and not local:  # a killed controller's workers' reservations outlive it
            from ..workers.group import remove_orphaned_placement_groups

            remove_orphaned_placement_groups(spec.run_id)
        if local:
            ray.shutdown()


def _on_sigterm(handler: Callable[[], None]) -> Callable[[], object]:
    """Call ``handler()`` on SIGTERM (main thread only; elsewhere nothing); returns what restores the old one."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: handler())
    return lambda: signal.signal(signal.SIGTERM, previous)


def _grace_note() -> str:
    """Under a Ray job: how long Ray waits before its SIGKILL (``RAY_JOB_STOP_WAIT_TIME_S``, default 3 s)."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return ""
    wait = os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "3")
    return (f" (Ray sends SIGKILL after {wait} s, RAY_JOB_STOP_WAIT_TIME_S; a run killed before its checkpoint "
            "commits is resumed from the one before)")


def _interrupted(store: RunStore, run_id: str, snap: dict | None, why: str) -> dict | None:
    """Mark the run INTERRUPTED after its controller (``snap``'s) is gone; the status written, or None."""
    controller = (snap or {}).get("controller_id")
    if not controller:
        return None
    try:
        return liveness.mark(store, run_id, f"interrupted: {why} at step {snap.get('step')}; `etrain resume "
                             f"{run_id}` continues it from its last checkpoint (step {snap.get('latest_checkpoint')})",
                             by="etrain run", controller=controller)
    except EtrainError as e:  # the store is away: the next etrain command that reads the status marks it
        log.warning("run %r could not be marked interrupted: %s", run_id, e)
        return None


def mark_start_failed(store: RunStore, run_id: str, why: str, *, by: str = "etrain run") -> dict | None:
    """After a start of ``run_id`` that failed before its controller ever ran (no status written, no
    controller leads it): the run marked FAILED, with ``why`` and what continues it (`etrain resume`, from
    its last checkpoint, if any, else from step 0), rather than left PENDING, which `etrain run` refuses and
    nothing would ever end. The status written, or None when a controller got there (then it is its to say)."""
    if store.get_status(run_id) is not None or store.leader_alive(run_id):
        return None
    status = {"run_id": run_id, "phase": Phase.FAILED.value, "step": 0, "updated_unix": time.time(),
              "reason": f"did not start: {why}; its controller never ran. `etrain resume {run_id}` starts it "
                        "with the config it was recorded with"}
    with writing(store):
        if not store.write_if(run_id, "status", json.dumps(status, sort_keys=True), None):  # only if none is there
            return None
        store.add_event(run_id, {"kind": "start_failed", "step": 0, "noticed_by": by, "reason": status["reason"]})
    return status


def exit_code(final: dict) -> int:
    return 0 if Phase.of(final) in (Phase.FINISHED, Phase.SUSPENDED) else 1


def controller_actor(run_id: str, store_url: str):
    """The live controller actor of ``run_id`` of ``store_url`` in the connected cluster, or None."""
    import ray

    try:
        return ray.get_actor(controller_name(run_id, store_url), namespace="etrain")
    except ValueError:
        return None


class BackgroundRun:
    """``launch(spec, store)`` in a thread of this process, with the controller's live view.

    Ray must already be initialized (``connect``). Used by ``etrain demo``,
    the benchmarks and the tests to act on a run while it goes on.
    """

    def __init__(self, spec: RunSpec, store: RunStore, progress: bool = False):
        self.spec = spec
        self.store = store
        self.result: dict = {}
        self.error: BaseException | None = None

        def go():
            try:
                self.result.update(launch(spec, store, progress=progress))
            except BaseException as e:  # surfaced by join()
                self.error = e

        self.thread = threading.Thread(target=go, name=f"run-{spec.run_id}", daemon=True)
        self.thread.start()
        self.actor = self._wait_actor()

    def _wait_actor(self, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            actor = controller_actor(self.spec.run_id, self.store.url)
            if actor is not None:
                return actor
            if not self.thread.is_alive():
                raise AssertionError(f"the run ended before its controller started: {self.error or self.result}")
            time.sleep(0.1)
        raise AssertionError("the controller actor did not start")

    def snapshot(self) -> dict | None:
        import ray

        try:
            return ray.get(self.actor.snapshot.remote(), timeout=10)
        except Exception:  # the controller has ended
            return None

    def events(self, kind: str | None = None) -> list[dict]:
        import ray

        try:
            rows = ray.get(self.actor.events_since.remote(0), timeout=10)
        except Exception:
            return []
        return [e for e in rows if kind is None or e["kind"] == kind]

    def wait(self, pred, timeout: float = 300.0, what: str = "the condition") -> dict:
        """Poll the live snapshot until ``pred(snapshot)`` holds; returns that snapshot."""
        deadline = time.monotonic() + timeout
        snap = None
        while time.monotonic() < deadline:
            snap = self.snapshot()
            if snap is not None and pred(snap):
                return snap
            if not self.thread.is_alive():
                raise AssertionError(f"the run ended before {what}: {self.error or self.result}")
            time.sleep(0.1)
        raise AssertionError(f"{what} did not happen within {timeout:.0f} s; last snapshot {snap}")

    def wait_event(self, kind: str, count: int = 1, timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(kind)
            if len(found) >= count:
                return found[count - 1]
            if not self.thread.is_alive():
                raise AssertionError(f"the run ended before event {kind!r} #{count}: {self.error or self.result}")
            time.sleep(0.1)
        raise AssertionError(f"no event {kind!r} #{count} within {timeout:.0f} s; events {self.events()}")

    def close(self) -> None:
        """End the run if it is still going (a test that failed half-way), so that nothing outlives the test."""
        import ray

        if self.thread.is_alive():
            ray.kill(self.actor, no_restart=True)
            self.thread.join(30)

    def join(self, timeout: float = 600.0) -> dict:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"the run did not end within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.result


# How long Ray waits between the SIGTERM of `ray job stop` and its SIGKILL, for the jobs etrain submits: the
# run suspends in between (a step and a checkpoint). Ray's own default, 3 s, fits only the smallest models.
STOP_WAIT_S = 120


def submit_job(address: str, entrypoint: list[str], working_dir: str = ".", env: dict | None = None) -> str:
    """Submit ``entrypoint`` as a new Ray job on the cluster whose dashboard is ``address``, with this
    process's ``AWS_*`` and ``ETRAIN_*`` variables (never its tokens: :func:`orchestrator.service.auth.job_env`),
    ``env`` and ``RAY_JOB_STOP_WAIT_TIME_S`` (this process's, else :data:`STOP_WAIT_S`)."""
    import shlex

    from ray.job_submission import JobSubmissionClient

    env = {**auth.job_env(), "RAY_JOB_STOP_WAIT_TIME_S": os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", str(STOP_WAIT_S)),
           **(env or {})}
    python = os.environ.get("ETRAIN_JOB_PYTHON", "python")  # the cluster's interpreter that has etrain's deps
    use_ray_token()  # the dashboard of a cluster with token authentication wants it too
    try:
        client = JobSubmissionClient(address)
        return client.submit_job(entrypoint=shlex.join([python, *entrypoint]),
                                 runtime_env={"working_dir": working_dir, "env_vars": env})
    except (ConnectionError, RuntimeError, ValueError) as e:  # their text repeats the address
        text = redact_text(str(e), address)
        hint = f"; {TOKEN_HELP}" if "Authentication" in text else ""
        raise EtrainError(f"cannot submit to the Ray dashboard at {redact(address)}: {_first_line(text)}{hint}") \
            from None
