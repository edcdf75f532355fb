"""``etrain queue [--json]``: the runs that are QUEUED or admitted, with their share of the cluster.

    etrain queue                 # a table: run, phase, priority, team, owner, min..max, allocated, target, waiting
    etrain queue --json          # the same rows as JSON, with why each queued run waits

It lists the runs ``etrain status`` lists (the store of ``--store`` or
``$ETRAIN_STORE``, else ``./runs`` and every store of the run registry), keeping
those in phases QUEUED to FINISHING (:mod:`orchestrator.queueing`).
"""

from __future__ import annotations

import json
import os
import time

from checkpointing.names import redact

from .cli_control import store_url
from .queueing import queue_rows


def cmd_queue(args) -> int:
    from rich.table import Table

    from . import registry
    from .progress import listing_console

    explicit = bool(args.store or os.environ.get("ETRAIN_STORE"))
    rows = queue_rows(registry.statuses([store_url(args)], registered=not explicit, strict=explicit), time.time())
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
