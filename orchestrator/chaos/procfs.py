"""The processes of this machine, read from /proc: the one place etrain walks the process table.

    from orchestrator.chaos import procfs
    for pid in procfs.children(agent_pid):                 # torchrun's rank processes
        if procfs.environ(pid).get("RANK") == "1": ...
    procfs.kill_tree(raylet)                               # its children (SIGKILL), then the raylet
    procfs.gone(pid)                                       # ended, or a zombie

Linux only. Every process can end between two reads: the walks (:func:`pids`, :func:`children`) skip a
process that is gone or unreadable, and the signal helpers skip one that is gone. The reads of one named
process (:func:`parent`, :func:`cmdline`) raise OSError when it is gone; :func:`environ` answers ``{}``.
This process is never signalled by :func:`kill_tree`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable


def pids() -> list[int]:
    """Every process of this machine (of this pid namespace)."""
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: [state, ppid, ...]. The name, in
    parentheses, may hold spaces and parentheses itself: the fields start after the last ')'."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def parent(pid: int) -> int:
    return int(_stat(pid)[1])


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (not their children)."""
    out = []
    for p in pids():
        try:
            if parent(p) == pid:
                out.append(p)
        except (OSError, ValueError, IndexError):
            pass
    return out


def cmdline(pid: int) -> list[str]:
    """The arguments ``pid`` runs with (decoded as the OS decodes argv: they round-trip to exec)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [os.fsdecode(a) for a in f.read().split(b"\0") if a]


def environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with; ``{}`` when it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(os.fsdecode(kv).split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (no such process, or a zombie waiting for its parent)."""
    try:
        return _stat(pid)[0] == "Z"
    except OSError:
        return True


def signal_each(targets: Iterable[int], sig: int) -> list[int]:
    """Send ``sig`` to each of ``targets``, skipping those that are gone; returns the pids signalled."""
    out = []
    for pid in targets:
        try:
            os.kill(pid, sig)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL, *, root: bool = True) -> list[int]:
    """Send ``sig`` to the children of ``pid``, then (``root``) to ``pid`` itself; returns the pids
    signalled. The children go first, so that none outlives its parent to be re-parented out of reach.
    Only the children: their own children are left to the children's ends. ProcessLookupError when
    ``pid`` itself is gone (with ``root``)."""
    out = signal_each((c for c in children(pid) if c != os.getpid()), sig)
    if root:
        os.kill(pid, sig)
        out.append(pid)
    return out
