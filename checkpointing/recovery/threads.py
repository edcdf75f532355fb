"""The memory tier's background threads: they yield the CPU to training."""

from __future__ import annotations

import threading


def lower_priority(niceness: int = 10) -> None:
    """Lower this thread's scheduling priority (Linux: a thread is a task of its own), best effort."""
    import os
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass
