"""This user's runs: run id -> run store URL, so that control commands find a run from any directory.

    record("tiny", "file:///home/me/proj/runs")   # etrain run and etrain.submit (orchestrator.run.prepare_run_doc)
    lookup("tiny")                                # "file:///home/me/proj/runs", or None
    runs_dir()                                    # $ETRAIN_HOME/runs, else ~/.etrain/runs

One small JSON file per run, ``<runs_dir>/<run_id>.json``, written whole and
moved into place (two runs started at once never lose each other's entry).
``etrain status RUN`` and the other control commands look here only when
neither ``--store`` nor ``$ETRAIN_STORE`` names a store; an entry read back
is checked (a dict naming this run and a string URL) and ignored otherwise.
The registry is a convenience: failing to write it only logs a warning.
"""

from __future__ import annotations

import json
import logging
import os
import time

from checkpointing.names import validate_run_id

log = logging.getLogger("etrain")


def home() -> str:
    """$ETRAIN_HOME, else ~/.etrain: where etrain keeps per-user state (this registry, Prometheus targets)."""
    return os.environ.get("ETRAIN_HOME") or os.path.join(os.path.expanduser("~"), ".etrain")


def runs_dir() -> str:
    return os.path.join(home(), "runs")


def _path(run_id: str) -> str:
    return os.path.join(runs_dir(), f"{validate_run_id(run_id, 'run_id')}.json")


def record(run_id: str, store_url: str) -> str | None:
    """Remember where ``run_id`` lives (the newest run of that id wins); the entry's path, or None."""
    path = _path(run_id)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"run_id": run_id, "store": store_url, "updated_unix": time.time()}, f)
        os.replace(tmp, path)
        return path
    except OSError as e:
        log.warning("could not record run %r in %s (%s); control commands from other directories need "
                    "--store %s", run_id, runs_dir(), e, store_url)
        return None


def lookup(run_id: str) -> str | None:
    """The store URL recorded for ``run_id``, or None (no entry, or one that is not a valid entry)."""
    try:
        with open(_path(run_id)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("run_id") != run_id or not isinstance(doc.get("store"), str):
        return None
    return doc["store"] or None
