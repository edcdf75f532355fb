"""``etrain queue [--json]``: the runs that are QUEUED or admitted, with their share of the cluster.

    etrain queue                 # a table: run, phase, priority, team, owner, min..max, allocated, target, waiting
    etrain queue --json          # the same rows as JSON, with why each queued run waits

It lists the runs ``etrain status`` lists (the store of ``--store`` or
``$ETRAIN_STORE``, else ``./runs`` and every store of the run registry), keeping
those in phases QUEUED to FINISHING (:mod:`orchestrator.service.queueing`).
"""

from __future__ import annotations

import json
import os
import time

from checkpointing.names import redact

from .control import store_url
from ..service.queueing import queue_rows


def cmd_queue(args) -> int:
    from rich.table import Table

    from ..store import user_runs as registry
    from ..driver.progress import listing_console

    explicit = bool(args.store or os.environ.get("ETRAIN_STORE"))
    rows = queue_rows(registry.statuses([store_url(args)], registered=not explicit, strict=explicit), time.time())
    add_allocator_reasons(rows)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    if not rows:
        print(f"no queued or admitted runs in {redact(store_url(args))}"
              + ("" if explicit else f" or in the run registry {registry.runs_dir()}"))
        return 0
    t = Table("run", "phase", "priority", "team", "owner", "min..max", "allocated", "target", "waiting", "store")
    for r in rows:
        t.add_row(str(r["run_id"]), str(r["phase"]), str(r["priority"]), str(r["team"]), r["owner"] or "-",
                  f"{r['min_workers']}..{r['max_workers']}", str(r["allocated"]), str(r["target"] or "-"),
                  f"{r['waiting_s']:.0f} s", str(r["store"] or "-"))
    listing_console().print(t)
    for r in rows:
        if r["waits_for"]:
            print(f"{r['run_id']} waits for {r['waits_for']}")
    return 0


def add_allocator_reasons(rows: list[dict]) -> None:
    """Where the cluster's allocator keeps its state in a listed store, a queued run's row also says why the
    allocator does not admit it yet (``allocator``), beside why its gang waits (docs/service.md)."""
    from ..service.allocator import STATE_DOC, read_doc
    from ..store.run_store import open_store

    docs: dict = {}
    for r in rows:
        url = r.get("store")
        if not url or r["phase"] != "QUEUED":
            continue
        if url not in docs:
            try:
                docs[url] = read_doc(open_store(url), STATE_DOC)[0].get("waiting") or {}
            except Exception:  # unreachable, or not etrain's: the gang's reason stands alone
                docs[url] = {}
        why = docs[url].get(r["run_id"])
        if why:
            r["allocator"] = why
            r["waits_for"] = f"{r['waits_for']}; the allocator: {why}" if r["waits_for"] else f"the allocator: {why}"
