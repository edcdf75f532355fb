"""This user's runs: run id -> run store URL, so that control commands find a run from any directory.

    record("tiny", "file:///home/me/proj/runs", token=t)   # etrain run, submit, etrain.submit (run.prepare_run_doc)
    lookup("tiny")                                # "file:///home/me/proj/runs", or None
    token_of("tiny")                              # the run's token, if this user started it (orchestrator.service.auth)
    runs_dir()                                    # $ETRAIN_HOME/runs, else ~/.etrain/runs
    pid, log, code = start_detached(["run", "tiny.toml"], "tiny")   # etrain run/resume --detach: in the background
    print_log("tiny", follow=True)                # etrain logs tiny -f
    statuses(["file:///home/me/proj/runs"])       # etrain status: every registered run, in its store

One small JSON file per run, ``<runs_dir>/<run_id>.json``, written whole and
moved into place (two runs started at once never lose each other's entry),
readable by its user only (mode 0600, in a directory of mode 0700, tightened
to 0700 when it was made wider before): it holds
the run's token, which authorizes control commands (:mod:`orchestrator.service.auth`).
``etrain status RUN`` and the other control commands look here only when
neither ``--store`` nor ``$ETRAIN_STORE`` names a store; an entry read back
is checked (a dict naming this run and a string URL) and ignored otherwise.
The registry is a convenience: failing to write it only logs a warning.

``etrain status`` with no run lists every run of this registry, each read
from its own store (several stores are read at once), beside the runs of
``./runs``: a store that cannot be reached shows its runs as ``unreachable``
with the reason, a run its store no longer holds as ``missing``, a run whose
documents are not etrain's as ``unreadable`` (that run alone: the others of
its store are read as usual); none of them stops the list. A store this user
may read but not write is shown as it is (a run found interrupted is shown
so, not marked: :mod:`orchestrator.store.liveness`).

``etrain run --detach`` runs the same ``etrain run`` as a process of its own
session, its output in ``<home>/logs/<run_id>.log`` and its pid beside it
(``<run_id>.pid``); ``etrain resume --detach`` does the same for ``etrain resume``,
appending to the run's log; ``etrain logs RUN [-f]`` prints (and follows) that log.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from checkpointing.errors import ConfigError, EtrainError
from checkpointing.names import check_url, etrain_home, redact, validate_run_id

from .documents import CorruptRunStore, StoreUnavailable, UnknownRun

log = logging.getLogger("etrain")


def runs_dir() -> str:
    return os.path.join(etrain_home(), "runs")


def _path(run_id: str) -> str:
    return os.path.join(runs_dir(), f"{validate_run_id(run_id, 'run_id')}.json")


def record(run_id: str, store_url: str, *, token: str | None = None) -> str | None:
    """Remember where ``run_id`` lives (the newest run of that id wins) and, for its owner, its run token
    (:mod:`orchestrator.service.auth`); the entry's path, or None."""
    path = _path(run_id)
    doc = {"run_id": run_id, "store": store_url, "updated_unix": time.time(), **({"token": token} if token else {})}
    try:
        _private_dir(os.path.dirname(path))
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the token is the owner's alone
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
        return path
    except OSError as e:
        log.warning("could not record run %r in %s (%s); control commands from other directories need "
                    "--store %s%s", run_id, runs_dir(), e, redact(store_url),
                    "; the run's token is lost: only an admin token ($ETRAIN_ADMIN_TOKEN) controls it" if token
                    else "")
        return None


def _private_dir(path: str) -> None:
    """``path`` made if missing, and readable by this user only (mode 0700) if it was made wider before."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
        os.chmod(path, 0o700)


def entry(run_id: str) -> dict | None:
    """The registry entry of ``run_id``, or None (no entry, or one that is not a valid entry)."""
    try:
        with open(_path(run_id)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("run_id") != run_id or not isinstance(doc.get("store"), str) \
            or not isinstance(doc.get("updated_unix", 0), (int, float)) or not isinstance(doc.get("token", ""), str):
        return None
    return doc


def token_of(run_id: str) -> str | None:
    """The run token this user's registry keeps for ``run_id`` (it started the run), or None."""
    return (entry(run_id) or {}).get("token") or None


def lookup(run_id: str) -> str | None:
    """The store URL recorded for ``run_id``, or None."""
    doc = entry(run_id)
    return (doc or {}).get("store") or None


def entries() -> list[dict]:
    """Every valid entry of the registry, newest first (files that are not one are left out)."""
    try:
        names = os.listdir(runs_dir())
    except OSError:
        return []
    found = []
    for name in names:
        try:
            doc = entry(name[:-len(".json")]) if name.endswith(".json") else None
        except ConfigError:  # not a run id: not an entry
            doc = None
        if doc:
            found.append(doc)
    return sorted(found, key=lambda d: -d.get("updated_unix", 0))


# Phases of a row of `etrain status` that is not a run's status: its store was not reached, no longer holds
# the run, or holds a status document that is not etrain's.
UNREACHABLE, MISSING, UNREADABLE = "unreachable", "missing", "unreadable"
NOT_A_STATUS = (UNREACHABLE, MISSING, UNREADABLE)


def statuses(stores: list[str], registered: bool = True, strict: bool = False) -> list[dict]:
    """The status of every run of ``stores`` (each listed whole) and, with ``registered``, of every run in the
    registry, read from its own store; each row with ``store``, the store's URL (redacted). Stores are read at
    once, each one's runs in id order; one that fails gives rows of phase :data:`UNREACHABLE` with a ``reason``
    (with ``strict``, the listing of one store named by the user: its error is raised instead)."""
    wanted: dict[str, list[str] | None] = {url: None for url in stores}  # None: every run of the store
    for e in entries() if registered else []:
        if wanted.get(e["store"], []) is not None:
            wanted.setdefault(e["store"], []).append(e["run_id"])
    with ThreadPoolExecutor(max_workers=min(8, len(wanted) or 1)) as pool:
        return [row for rows in pool.map(lambda kv: _store_rows(*kv, strict), wanted.items()) for row in rows]


def _store_rows(url: str, run_ids: list[str] | None, strict: bool) -> list[dict]:
    from .run_store import open_store

    where, rows = redact(url), []
    try:
        store = open_store(check_url(url, f"the run registry's store {redact(url)}"))
        for run_id in sorted(store.list_runs() if run_ids is None else set(run_ids)):
            rows.append({**_run_row(store, run_id, where), "run_id": run_id, "store": where})
    except (StoreUnavailable, EtrainError, OSError, ValueError, ImportError) as e:  # whatever stops this store
        if strict:
            raise
        done = {r["run_id"] for r in rows}
        reason = str(e) if isinstance(e, StoreUnavailable) else f"run store {where} is unreachable: {e}"
        rows += [{"run_id": r, "store": where, "phase": UNREACHABLE, "reason": reason}
                 for r in sorted(set(run_ids or ["-"]) - done)]
    return rows


def _run_row(store, run_id: str, where: str) -> dict:
    """One run's status row; a run whose documents are not etrain's is a row of its own (:data:`UNREADABLE`,
    with the reason), never an error that hides the other runs of its store. StoreUnavailable: the store."""
    from ..phase import Phase
    from .liveness import notice

    try:
        store.get_spec(run_id)
        status = notice(store, run_id, store.get_status(run_id), by="etrain status")  # controller gone?
        return status or {"phase": Phase.PENDING}
    except UnknownRun:
        return {"phase": MISSING, "reason": f"{where} no longer holds it (the run registry entry "
                                            f"{runs_dir()}/{run_id}.json names it)"}
    except StoreUnavailable:
        raise
    except (EtrainError, OSError, ValueError, TypeError, OverflowError, RecursionError) as e:
        return {"phase": UNREADABLE, "reason": str(e) if isinstance(e, CorruptRunStore) else
                f"run {run_id!r} of {where} cannot be read: {type(e).__name__}: {e}"}


def log_path(run_id: str) -> str:
    return os.path.join(etrain_home(), "logs", f"{validate_run_id(run_id, 'run_id')}.log")


def pid_path(run_id: str) -> str:
    """Where ``etrain run --detach`` keeps its driver's pid, beside :func:`log_path`."""
    return os.path.join(etrain_home(), "logs", f"{validate_run_id(run_id, 'run_id')}.pid")


def start_detached(argv: list[str], run_id: str, *, wait_s: float = 120.0,
                   env: dict[str, str] | None = None) -> tuple[int, str, int | None]:
    """``etrain ARGV`` (``run ...`` or ``resume RUN ...``) in a session of its own, with ``env`` added to this
    process's environment, its output appended to :func:`log_path`. Waits until the run is recorded in this
    registry (``etrain run`` records a run it is about to launch; ``etrain resume``, one it marked to
    continue) or the process ended; returns (pid, log, exit status or None if running)."""
    log = log_path(run_id)
    os.makedirs(os.path.dirname(log), exist_ok=True)
    started = time.time()
    with open(log, "a") as out:
        out.write(f"--- etrain {' '.join(argv)}  ({time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        out.flush()
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *argv], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    with open(pid_path(run_id), "w") as f:
        f.write(str(proc.pid))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        if (entry(run_id) or {}).get("updated_unix", 0) >= started:
            break
        time.sleep(0.2)
    return proc.pid, log, proc.poll()


def _alive(run_id: str) -> bool:
    """Whether the detached driver of ``run_id`` still runs (its pid file names a live process)."""
    try:
        with open(pid_path(run_id)) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    try:  # a zombie (ended, not yet reaped by its parent) has ended too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def print_log(run_id: str, follow: bool = False, out=None, poll_s: float = 0.5) -> bool:
    """Print the detached run's log (False when there is none); with ``follow``, until its driver ends."""
    out = out or sys.stdout
    try:
        f = open(log_path(run_id))  # noqa: SIM115  (closed by the `with f` below)
    except OSError:
        return False
    with f:
        while True:
            alive = follow and _alive(run_id)  # looked at before the last read: nothing written after is lost
            chunk = f.read()
            if chunk:
                out.write(chunk)
                out.flush()
            if not alive:
                return True
            time.sleep(poll_s)
