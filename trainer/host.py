"""The host a training process runs on, as far as the process may use it (light: no torch).

    n = usable_cpus()      # the cores this process may run on
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup (v2) CPU quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)
