"""The run's ``/metrics`` endpoint over HTTP, registered for Prometheus file_sd discovery.

    endpoint = MetricsEndpoint(RunMetrics(run_id), addr="127.0.0.1", port=0, file_sd_dir="")
    endpoint.url               # http://127.0.0.1:PORT/metrics
    endpoint.file_sd_path      # <dir>/<run_id>-<pid>.json, or None ("-", or it could not be written)
    endpoint.close()           # stops serving and removes the target file

``file_sd_dir`` "" means $ETRAIN_PROMETHEUS_DIR, else $ETRAIN_HOME/prometheus,
else ~/.etrain/prometheus (where ``deploy/prometheus.yml``, copied to
$ETRAIN_HOME, looks); "-" writes no target file. The file name carries the
serving process's id, so two runs of the same id (two ``python -m trainer``
runs of the default ``run_id``) never overwrite each other's target. Served by the controller on Ray and by rank 0
under torchrun (``[metrics]`` in the run config, docs/metrics.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid

from prometheus_client import CollectorRegistry, start_http_server

from .metrics import RunMetrics

log = logging.getLogger("etrain")


def default_file_sd_dir() -> str:
    """Where target files go when ``metrics.file_sd_dir`` is empty: $ETRAIN_PROMETHEUS_DIR, else
    $ETRAIN_HOME/prometheus, else ~/.etrain/prometheus."""
    from checkpointing.names import etrain_home

    return os.environ.get("ETRAIN_PROMETHEUS_DIR") or os.path.join(etrain_home(), "prometheus")


class MetricsEndpoint:
    """Serves a :class:`RunMetrics` over HTTP and registers it for Prometheus file_sd discovery."""

    def __init__(self, metrics: RunMetrics, *, addr: str = "127.0.0.1", port: int = 0, file_sd_dir: str = "",
                 advertise: str | None = None):
        self.metrics = metrics
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(metrics)
        self.server, self.thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self.server.server_address[1]
        host = addr
        if host in ("0.0.0.0", "::", ""):  # listening everywhere: tell Prometheus this node's address
            host = advertise or socket.gethostbyname(socket.gethostname())
        self.target = f"{host}:{self.port}"
        self.url = f"http://{self.target}/metrics"
        self.file_sd_path: str | None = None
        if file_sd_dir != "-":
            self.file_sd_path = self._register(file_sd_dir or default_file_sd_dir())

    def _register(self, directory: str) -> str | None:
        """``<dir>/<run_id>-<pid>.json`` in Prometheus file_sd format; written whole to a temporary file
        (made exclusively under a random name, never through a link planted there), then moved into
        place so that Prometheus never reads half a file."""
        tmp = None
        try:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"{self.metrics.run_id}-{os.getpid()}.json")
            name = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            tmp = name  # ours: removed if anything fails
            with os.fdopen(fd, "w") as f:
                json.dump([{"targets": [self.target], "labels": {"etrain_run": self.metrics.run_id}}], f)
            os.replace(tmp, path)  # a link at ``path`` itself is replaced, not followed
            return path
        except OSError as e:
            if tmp is not None:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
            log.warning("metrics: could not write the Prometheus target file in %s: %s", directory, e)
            return None

    def close(self) -> None:
        if self.file_sd_path:
            try:
                os.remove(self.file_sd_path)
            except OSError:
                pass
        self.server.shutdown()
        self.server.server_close()
