"""``etrain nodes``: the cluster's nodes, and the quarantine of bad ones (docs/operations.md#node-quarantine).

    etrain nodes [--json]                       every node: id, address, state (alive, draining, quarantined), CPUs,
                                                GPUs; a quarantined one's reason, run, rank, step and since when
    etrain nodes release NODE                   let runs use a quarantined node again (admin token; NODE: its id
                                                or a unique prefix of at least 4 hex digits)
    etrain nodes release --all                  every quarantined node (also the repair of a document that is not
                                                etrain's)
    etrain nodes limits [--max-fraction F] [--per-run N]    the bounds of quarantines (setting them: admin token)

It joins the cluster at ``--address`` / ``$RAY_ADDRESS`` (it lists Ray's nodes; it never starts a Ray of
its own) and finds the quarantine where the cluster's allocator keeps its state: the service store, else
the running allocator's state store (:func:`orchestrator.service.nodes.cluster_store`); ``--store`` names
it instead. It loads Ray, never torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from checkpointing.errors import ConfigError
from checkpointing.names import check_url, redact


def add_nodes_parser(sub) -> None:
    p = sub.add_parser("nodes", help="the cluster's nodes (alive, draining, quarantined); release a quarantined "
                                     "one (admin token)")
    p.add_argument("action", nargs="?", choices=("list", "release", "limits"), default="list",
                   help="list (the default), release NODE, limits")
    p.add_argument("node", nargs="?", help="release: the node's id, or a unique prefix of it")
    p.add_argument("--all", action="store_true", help="release: every quarantined node")
    p.add_argument("--max-fraction", type=float, default=None, help="limits: the most of the cluster's nodes "
                   "quarantines may take together (default 0.25; at least one node)")
    p.add_argument("--per-run", type=int, default=None, help="limits: the most nodes one run may quarantine "
                   "(default 2)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--address", default=None, help="the cluster's GCS address HOST:6379 (default: $RAY_ADDRESS)")
    p.add_argument("--store", default=None, help="the store the quarantine is kept in (default: the cluster's "
                                                 "service store, else its allocator's state store)")
    p.add_argument("--token", default=None, help="release, limits: the store's admin token (default: "
                                                 "$ETRAIN_ADMIN_TOKEN, else the store's admin token file)")


def _join(args) -> None:
    """Join the cluster; a release or limits on a --store given proceeds without one (the allocator writes the
    quarantine to Ray's GCS at its next decision)."""
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address and args.store and args.action != "list":
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # the Python API's process, joined already
        return
    if not address:
        raise ConfigError(f"etrain nodes {args.action} needs the Ray cluster: --address HEAD:6379 (the GCS address) "
                          "or $RAY_ADDRESS" + ("" if args.action == "list" else "; or --store URL of the quarantine"))
    from ..driver.cluster import connect

    connect(address, 0)


def _store(args, required: bool = True):
    """The store the quarantine is kept in: --store, else the cluster's (None when it has none and not
    ``required``: then no node is quarantined)."""
    from ..service.nodes import cluster_store, require_store
    from ..store.run_store import open_store

    if args.store:
        return open_store(check_url(args.store, "--store"))
    store = cluster_store()
    return require_store(store) if required else store


def cmd_nodes(args: argparse.Namespace) -> int:
    from ..driver.progress import printable
    from ..service import quarantine as q
    from ..store.documents import writing

    if args.action != "release" and (args.node or args.all):
        raise ConfigError(f"etrain nodes {args.action} takes no NODE or --all; release one with etrain nodes "
                          "release NODE")
    if args.action != "limits" and (args.max_fraction is not None or args.per_run is not None):
        raise ConfigError("--max-fraction and --per-run are for etrain nodes limits")
    _join(args)
    store = _store(args, required=args.action != "list")
    if args.action == "release":
        if bool(args.node) == bool(args.all):
            raise ConfigError("etrain nodes release needs a NODE (its id, or a unique prefix) or --all")
        with writing(store):
            if args.all:
                n = q.release_all(store, args.token)
                q.publish({})
                what = "every quarantined node" if n < 0 else f"{n} quarantined node{'s' if n != 1 else ''}"
                print(printable(f"etrain: released {what} in {redact(store.url)}"))
                return 0
            from ..service.nodes import release_on_cluster

            node_id, entry = release_on_cluster(args.node, args.token, store)
        print(printable(f"etrain: node {node_id} released (quarantined {_ago(entry.get('since'))} for "
                        f"{entry.get('reason')!r}); runs may be placed there again"))
        return 0
    if args.action == "limits":
        if args.max_fraction is not None or args.per_run is not None:
            with writing(store):
                limits = q.set_limits(store, args.token, max_fraction=args.max_fraction, per_run=args.per_run)
        else:
            limits = q.limits_of(store)
        print(json.dumps(limits.as_doc(), sort_keys=True) if args.json else
              printable(f"etrain: quarantines may take {limits.max_fraction:g} of the cluster's nodes (at least one), "
                        f"{limits.per_run} by any one run; store {redact(store.url)}"))
        return 0
    from ..service.nodes import node_rows

    rows = node_rows(store)
    if args.json:
        print(json.dumps({"store": redact(store.url) if store else None, "nodes": rows}, sort_keys=True))
        return 0
    from ..driver.progress import listing_console

    listing_console().print(node_table(rows))
    held = sum(r.get("reason") is not None for r in rows)
    if held:
        print(printable(f"{held} quarantined; `etrain nodes release NODE` (admin token) lets runs use one again"))
    return 0


def _ago(since) -> str:
    if not isinstance(since, int | float):
        return "-"
    s = max(0.0, time.time() - since)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def node_table(rows: list[dict]):
    """``etrain nodes``: a row per node; stored text (a quarantine's reason and run) as :func:`cell`."""
    from rich.table import Table

    from ..driver.progress import cell

    t = Table("node", "address", "state", "CPUs", "GPUs", "reason", "run", "rank", "step", "since")
    for r in rows:
        held = r.get("reason") is not None
        t.add_row(cell(r["node_id"][:12]), cell(r.get("address") or "-"), cell(r["state"]), f"{r['cpus']:g}",
                  f"{r['gpus']:g}", cell(r["reason"] if held else "-", 60), cell(r.get("run") or "-"),
                  cell("-" if r.get("rank") is None else r["rank"]), cell("-" if r.get("step") is None else r["step"]),
                  _ago(r.get("since")) if held else "-")
    return t
