"""``etrain quota``: the teams' quotas of a shared cluster, kept in the run store (docs/service.md#quotas).

    etrain quota                               the quotas, and what each team's runs hold now
    etrain quota vision --max-workers 16       at most 16 workers for team "vision"'s runs together
    etrain quota vision --remove               no quota for "vision"
    etrain quota --json

Setting or removing a quota needs the store's admin token (``--token``, ``$ETRAIN_ADMIN_TOKEN`` or the
admin token file, ``etrain admin-token``). The cluster's allocator reads the quotas at every decision
(:mod:`orchestrator.service.allocator`): a team over its quota gives workers back first.
"""

from __future__ import annotations

import argparse
import json

from checkpointing.names import redact

from .control import open_store_of


def add_quota_parser(sub, add_store, add_token) -> None:
    p = sub.add_parser("quota", help="the teams' quotas of workers on a shared cluster (setting one needs the "
                                     "admin token)")
    p.add_argument("team", nargs="?", help="the team ([elastic] team of its runs)")
    p.add_argument("--max-workers", type=int, default=None, help="the most workers the team's runs hold together")
    p.add_argument("--remove", action="store_true", help="remove the team's quota")
    p.add_argument("--json", action="store_true", help="one JSON object")
    add_token(p)
    add_store(p)


def cmd_quota(args: argparse.Namespace) -> int:
    from checkpointing.errors import ConfigError

    from ..service.auth import authorize_admin
    from ..service.allocator import STATE_DOC, quotas, read_doc, set_quota

    store = open_store_of(args)
    if args.max_workers is not None or args.remove:
        if not args.team:
            raise ConfigError("etrain quota --max-workers/--remove needs a TEAM: etrain quota TEAM --max-workers N")
        if args.max_workers is not None and args.remove:
            raise ConfigError("give --max-workers N or --remove, not both")
        if args.max_workers is not None and args.max_workers < 0:
            raise ConfigError(f"--max-workers {args.max_workers} must be >= 0")
        authorize_admin(store, args.token, f"a quota for team {args.team!r}")
        set_quota(store, args.team, None if args.remove else args.max_workers)
    teams = quotas(store)
    state = read_doc(store, STATE_DOC)[0]
    held: dict[str, int] = {}
    for run_id, n in (state.get("targets") or {}).items():
        team = (state.get("teams") or {}).get(run_id, "default")
        held[team] = held.get(team, 0) + int(n)
    rows = {t: {"max_workers": teams.get(t), "held": held.get(t, 0)} for t in sorted({*teams, *held})}
    if args.team:
        rows = {args.team: rows.get(args.team, {"max_workers": None, "held": 0})}
    if args.json:
        print(json.dumps({"store": redact(store.url), "teams": rows}, sort_keys=True))
        return 0
    if not rows:
        print(f"etrain: no quotas in {redact(store.url)}; set one with etrain quota TEAM --max-workers N")
        return 0
    print(f"{'TEAM':<20} {'MAX_WORKERS':>11} {'HELD':>5}")
    for team, r in rows.items():
        limit = "-" if r["max_workers"] is None else str(r["max_workers"])
        print(f"{team:<20} {limit:>11} {r['held']:>5}")
    return 0
