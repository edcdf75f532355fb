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

A process that ends without :meth:`MetricsEndpoint.close` (killed, or an allocator whose Ray was stopped)
leaves its file behind; every new endpoint first sweeps the directory of such stale files
(:func:`sweep_stale_targets`): a file whose process is gone and whose target, an address of this machine,
no longer answers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import uuid

from prometheus_client import CollectorRegistry, start_http_server

from checkpointing.storage.backend import DocumentRefused
from checkpointing.storage.doc_lock import process_gone
from checkpointing.storage.local import read_regular

from .metrics import RunMetrics

log = logging.getLogger("etrain")


def default_file_sd_dir() -> str:
    """Where target files go when ``metrics.file_sd_dir`` is empty: $ETRAIN_PROMETHEUS_DIR, else
    $ETRAIN_HOME/prometheus, else ~/.etrain/prometheus."""
    from checkpointing.names import etrain_home

    return os.environ.get("ETRAIN_PROMETHEUS_DIR") or os.path.join(etrain_home(), "prometheus")


# ``<run_id>-<pid>.json``: the name of a target file and the id of the process that serves its endpoint.
TARGET_NAME = re.compile(r"(?P<run>.+)-(?P<pid>[0-9]{1,10})\.json")
_MAX_TARGET_FILE = 64 * 1024


def sweep_stale_targets(directory: str) -> list[str]:
    """Remove the target files in ``directory`` whose endpoint is gone (:func:`stale_target`); the paths
    removed. Files of other names, and what cannot be read or removed (another user's), are left alone."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = TARGET_NAME.fullmatch(name)
        path = os.path.join(directory, name)
        if m and stale_target(path, int(m["pid"])):
            try:
                os.remove(path)
                removed.append(path)
            except OSError:
                pass
    if removed:
        log.info("metrics: removed %d stale Prometheus target file(s) in %s", len(removed), directory)
    return removed


def stale_target(path: str, pid: int) -> bool:
    """Whether the target file ``path`` of process ``pid`` is stale: that process is not alive here, and each
    of its targets is an address of this machine on which nothing listens. A target elsewhere (a shared
    directory: another node's run) is never judged stale from here, nor is a file that is not a target file."""
    if pid == os.getpid() or (pid > 0 and not process_gone(pid)):
        return False
    targets = _targets(path)
    return bool(targets) and all(_local(host) and not _answers(host, port) for host, port in targets)


def _targets(path: str) -> list[tuple[str, int]]:
    """The ``host:port`` targets of a file_sd file (a plain file of at most 64 KiB); [] when it is not one."""
    try:
        groups = json.loads(read_regular(path, os.path.basename(path), _MAX_TARGET_FILE))
    except (OSError, DocumentRefused, ValueError):  # gone, not a regular file, over the cap, not JSON
        return []
    out = []
    for group in groups if isinstance(groups, list) else []:
        for target in group.get("targets", []) if isinstance(group, dict) else []:
            host, _, port = str(target).rpartition(":")
            if not port.isdigit() or not host:
                return []
            out.append((host.strip("[]"), int(port)))
    return out


def _local(host: str) -> bool:
    """Whether ``host`` is an address of this machine: one a socket here can bind to."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except (OSError, UnicodeError, ValueError):
        return False


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


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
            sweep_stale_targets(directory)  # the files of endpoints that ended without removing theirs
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
