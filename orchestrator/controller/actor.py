"""The run's controller inside Ray: the actor the driver starts, and the run's metrics endpoint.

    cls = ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(ControllerActor)
    actor = cls.remote(spec, store_url, cfg, resources, opts)   # what orchestrator.driver.run.start_controller does
    final = ray.get(actor.run.remote())        # the final status, once the run is terminal
    ray.get(actor.snapshot.remote())           # meanwhile, from other threads of the actor: the live view

The actor owns the worker group (:class:`orchestrator.workers.group.RayWorkerGroup`)
and the :class:`orchestrator.controller.controller.Controller` that drives it. It gets
the run's config parsed once by the driver (``trainer.config.RunConfig``,
pickled through Ray) and hands it on to the controller and to every worker.
When ``[metrics]`` is enabled it serves the run's Prometheus endpoint, fed
by a :class:`orchestrator.controller.observers.MetricsObserver`; the controller does not
know whether there is one. The experiment trackers of ``[logging]`` are fed the
same way (:class:`orchestrator.controller.observers.TrackerObserver`), and each held-out
evaluation becomes an ``eval`` event (:class:`orchestrator.controller.observers.EvalEvents`).
"""

from __future__ import annotations

import logging
from functools import partial

from trainer.config import RunConfig
from trainer.heap import freeze_boot_heap

from ..service.auth import job_env
from .autoscale import AutoscaleObserver, DemandBoard
from .controller import Controller, ControllerOptions
from ..service.drains import ray_draining_nodes
from ..service.nodes import quarantine_on_cluster
from .drain import DrainWatch
from .health import FaultWatch
from .observers import ControllerObserver, EvalEvents, MetricsObserver, TrackerObserver
from ..store.run_store import RunSpec, open_store

log = logging.getLogger("etrain")


class ControllerActor:
    """The run's controller inside Ray (wrapped with ``ray.remote`` by ``orchestrator.driver.run.start_controller``)."""

    def __init__(self, spec: RunSpec, store_url: str, config: RunConfig, resources: dict, opts: ControllerOptions):
        from ..workers.group import RayWorkerGroup

        logging.basicConfig(level=logging.INFO, format="%(asctime)s etrain-controller %(levelname)s %(message)s")
        store = open_store(store_url)
        group = RayWorkerGroup(config, spec.run_id, store_url, resources=resources, env=job_env(),
                               gang_labels=spec.sharing.gang_labels, elastic_labels=spec.sharing.elastic_labels)
        self.endpoint, observers = start_metrics(spec.run_id, config)
        observers = [*observers, EvalEvents(), *start_trackers(spec.run_id, config), AutoscaleObserver(DemandBoard())]
        self.ctl = Controller(spec, store, group, opts, config=config, observers=observers,
                              drains=DrainWatch(source=ray_draining_nodes),
                              faults=FaultWatch(quarantine=partial(quarantine_on_cluster, store_url=store_url)))
        freeze_boot_heap()  # no 150 ms garbage collection while it notices a failure

    def run(self) -> dict:
        try:
            return self.ctl.run()
        finally:
            if self.endpoint is not None:
                self.endpoint.close()

    def snapshot(self) -> dict:
        return self.ctl.snapshot()

    def suspend(self, cause: str) -> None:
        """Suspend at the next step boundary, ``cause`` named in the event (the driver got SIGTERM)."""
        self.ctl.request_suspend(cause)

    def events_since(self, n: int) -> list[dict]:
        return self.ctl.status.events_log[n:]

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def set_health_faults(self, faults: list | None, rank: int) -> str | None:
        """Chaos: bitflip / poison_batch faults in the worker that is rank ``rank`` now; its id."""
        return self.ctl.set_health_faults(faults, rank)

    def set_storage_faults(self, faults: dict | None) -> int:
        """Chaos: storage faults on every started worker (members and spares); returns how many."""
        return self.ctl.set_storage_faults(faults)


def start_metrics(run_id: str, config: RunConfig) -> tuple[object | None, list[ControllerObserver]]:
    """The run's Prometheus endpoint per ``[metrics]`` (docs/metrics.md) and the observer that feeds it;
    (None, []) when disabled. Listening on every interface, the endpoint advertises this node's
    address for discovery."""
    import ray

    m = config.metrics
    if not m.enabled:
        return None, []
    from trainer.observe.endpoint import MetricsEndpoint
    from trainer.observe.metrics import RunMetrics

    metrics = RunMetrics(run_id)
    try:
        endpoint = MetricsEndpoint(metrics, addr=m.addr, port=m.port, file_sd_dir=m.file_sd_dir,
                                   advertise=ray.util.get_node_ip_address())
    except OSError as e:  # the port is taken: the run goes on without an endpoint, and says so
        log.error("metrics: cannot listen on %s:%d (%s); set metrics.port to a free port or 0", m.addr, m.port, e)
        return None, []
    return endpoint, [MetricsObserver(metrics, url=endpoint.url, file_sd=endpoint.file_sd_path)]


def start_trackers(run_id: str, config: RunConfig) -> list[ControllerObserver]:
    """The observer that feeds the trackers ``[logging]`` asks for (docs/metrics.md#trackers); [] for none."""
    from trainer.observe.trackers import open_trackers, wanted

    if not wanted(config):
        return []
    return [TrackerObserver(open_trackers(config, run_id), flush_timeout_s=config.logging.flush_timeout_s)]
