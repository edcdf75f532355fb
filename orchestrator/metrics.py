"""The run's Prometheus metrics as the controller imports them; the code lives in the trainer.

    from orchestrator.metrics import MetricsEndpoint, RunMetrics
    m = RunMetrics(run_id)
    endpoint = MetricsEndpoint(m, addr="127.0.0.1", port=0, file_sd_dir="")

The exporter (every metric name, :class:`RunMetrics`) is :mod:`trainer.metrics`
and its HTTP endpoint :mod:`trainer.metrics_endpoint`: rank 0 serves the same
ones under torchrun (:mod:`trainer.launcher_metrics`), and the trainer never
imports the orchestrator. The controller feeds them (``orchestrator.run``).
"""

from __future__ import annotations

from trainer.metrics import RunMetrics
from trainer.metrics_endpoint import MetricsEndpoint

__all__ = ["MetricsEndpoint", "RunMetrics"]
