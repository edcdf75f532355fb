"""``etrain queue [--json]``: the runs that are QUEUED or admitted, with their share of the cluster.

    etrain queue                 # a table: run, phase, priority, team, owner, min..max, allocated, target, waiting
    etrain queue --json          # the same rows as JSON, with why each queued run waits

It lists the runs ``etrain status`` lists (the store of ``--store`` or
``$ETRAIN_STORE``, else ``./runs`` and every store of the run registry), keeping
those in phases QUEUED to FINISHING (:mod:`orchestrator.service.queueing`).
A run whose documents are not etrain's is left out and named on stderr; every
stored text is shown through :func:`orchestrator.driver.progress.printable`.
"""

from __future__ import annotations

import json
import os
import time

from checkpointing.errors import EtrainError
from checkpointing.names import redact

from ..service.queueing import queue_rows
from ..store.cluster_names import cluster_key
from .control import store_url


def cmd_queue(args) -> int:
    from rich.table import Table

    from ..driver.progress import cell, listing_console, printable
    from ..store import user_runs as registry
    from .control import unreadable_runs

    explicit = bool(args.store or os.environ.get("ETRAIN_STORE"))
    statuses = registry.statuses([store_url(args)], registered=not explicit, strict=explicit)
    rows = queue_rows(statuses, time.time())
    add_allocator_reasons(rows)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    elif not rows:
        print(printable(f"no queued or admitted runs in {redact(store_url(args))}"
                        + ("" if explicit else f" or in the run registry {registry.runs_dir()}")))
    else:
        t = Table("run", "phase", "priority", "team", "owner", "min..max", "allocated", "target", "waiting", "store")
        for r in rows:
            t.add_row(cell(r["run_id"]), cell(r["phase"]), cell(r["priority"]), cell(r["team"]),
                      cell(r["owner"] or "-"), cell(f"{r['min_workers']}..{r['max_workers']}"), cell(r["allocated"]),
                      cell(r["target"] or "-"), f"{r['waiting_s']:.0f} s", cell(r["store"] or "-"))
        listing_console().print(t)
        for r in rows:
            if r["waits_for"]:
                print(printable(f"{r['run_id']} waits for {r['waits_for']}"))
    unreadable_runs(statuses)  # named on stderr; the queue of the others stands
    return 0


def add_allocator_reasons(rows: list[dict]) -> None:
    """Where the cluster's allocator keeps its state in a listed store, a queued run's row also says why the
    allocator does not admit it yet (``allocator``), beside why its gang waits (docs/service.md). A state
    document that is not etrain's (:data:`orchestrator.store.documents.ALLOCATOR_MAPS`) is passed over."""
    docs: dict = {}
    for r in rows:
        url = r.get("store")
        if not url or r["phase"] != "QUEUED":
            continue
        if url not in docs:
            docs[url] = allocator_waiting(url)
        why = docs[url].get(cluster_key(r["run_id"], url)) or docs[url].get(r["run_id"])  # keyed by id and store
        if why:
            r["allocator"] = why
            r["waits_for"] = f"{r['waits_for']}; the allocator: {why}" if r["waits_for"] else f"the allocator: {why}"


def allocator_waiting(url: str) -> dict[str, str]:
    """Why the allocator of the store at ``url`` keeps each queued run waiting; {} when it keeps no state there,
    the store is not reached, or its state is not etrain's (the gang's reason then stands alone)."""
    from ..service.allocator import STATE_DOC
    from ..store.documents import ALLOCATOR_MAPS, StoreUnavailable, load_doc, maps_problem
    from ..store.run_store import open_store

    try:
        raw, _ = open_store(url).read_versioned(None, STATE_DOC)
        doc = load_doc(raw, STATE_DOC, lambda d: maps_problem(d, {"waiting": ALLOCATOR_MAPS["waiting"]})) if raw else {}
    except (StoreUnavailable, EtrainError, OSError, ValueError):
        return {}
    return doc.get("waiting") or {}

