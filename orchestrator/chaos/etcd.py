"""The etcd behind a run store, stopped and started again: the ``etcd_outage`` fault.

    etcd = EtcdControl("etcd://127.0.0.1:2379")   # ConfigError for a store that is not etcd
    etcd.stop("stop")                             # SIGSTOP: it stops answering, connections stay open
    etcd.start("stop")                            # SIGCONT
    etcd.stop("restart"); etcd.start("restart")   # SIGTERM, then the same command line started again

Only an etcd that runs on this machine (the one where ``etrain chaos`` runs) can be controlled: it is
found as the process listening on the store's port. ``start(mode)`` undoes ``stop(mode)`` of the same mode.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from checkpointing.errors import ConfigError
from checkpointing.names import redact

from ..store.etcd_client import SCHEMES
from . import procfs


def pid_listening_on(port: int) -> int | None:
    """The local process that listens on TCP ``port`` (from /proc/net/tcp and the processes' fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(cols[9])
        except OSError:
            pass
    for pid in procfs.pids():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return pid
        except OSError:
            continue
    return None


class EtcdControl:
    """Stops and restarts the etcd behind an ``etcd://host:port`` (or ``etcds://``) run store, when it runs
    on this machine."""

    def __init__(self, store_url: str):
        if not store_url.startswith(SCHEMES):
            raise ConfigError(f"etcd_outage needs an etcd run store (--store etcd://host:port); this run's is "
                              f"{redact(store_url)}")
        hostport = store_url.split("://", 1)[1].split("/", 1)[0]
        self.port = int(hostport.rsplit(":", 1)[1]) if ":" in hostport else 2379
        self.pid: int | None = None
        self.cmdline: list[str] = []
        self.cwd = "/"

    def _find(self) -> int:
        pid = pid_listening_on(self.port)
        if pid is None:
            raise RuntimeError(f"no process on this machine listens on port {self.port}: etcd_outage can only "
                               "stop an etcd that runs where `etrain chaos` runs")
        return pid

    def stop(self, mode: str) -> None:
        self.pid = self._find()
        if mode == "stop":
            os.kill(self.pid, signal.SIGSTOP)
            return
        self.cmdline = procfs.cmdline(self.pid)
        self.cwd = os.readlink(f"/proc/{self.pid}/cwd")
        os.kill(self.pid, signal.SIGTERM)
        for _ in range(100):
            if not os.path.exists(f"/proc/{self.pid}"):
                break
            time.sleep(0.1)

    def start(self, mode: str) -> None:
        if mode == "stop":
            os.kill(self.pid, signal.SIGCONT)
            return
        subprocess.Popen(self.cmdline, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
