"""``etrain service``, ``etrain grant`` and ``etrain quota``: a shared cluster's service store, the
claims its admin grants, and the teams' quotas (docs/service.md#a-shared-cluster).

    etrain service init --store URL [--address GCS]   the cluster's service store (its admin token if none)
    etrain service show                               which store it is, its admin, grants and quotas
    etrain grant OWNER --max-priority 10 --teams vision,nlp --nonpreemptible    (admin token)
    etrain grant OWNER --revoke                       etrain grant --list [--json]
    etrain quota                                      a table: each team's quota, and what its runs hold now
    etrain quota vision --max-workers 16              at most 16 workers for team "vision"'s runs together
    etrain quota vision --remove                      etrain quota --json

Quotas and grants live in the cluster's service store only (:mod:`orchestrator.service.grants`),
found as :func:`service_store` says; a ``--store`` that is not it is refused, naming it. On a cluster
without a service store, ``etrain quota`` acts on the store it is given (one user's own cluster).
Changing a quota or a grant needs the store's admin token (``--token``, ``$ETRAIN_ADMIN_TOKEN`` or the
admin token file of that store, ``etrain admin-token``).
"""

from __future__ import annotations

import argparse
import json
import os

from rich.table import Table

from checkpointing.errors import ConfigError
from checkpointing.names import check_url, etrain_home, redact

from ..driver.progress import cell, listing_console, printable
from ..service.docs import check_name
from ..store.documents import writing
from .control import store_url

SERVICE_ENV = "ETRAIN_SERVICE_STORE"


def add_service_parsers(sub, add_store, add_token) -> None:
    def common(p, what: str) -> None:
        p.add_argument("--json", action="store_true", help=f"one JSON object{what}")
        add_token(p)
        add_store(p)

    p = sub.add_parser("service", help="a shared cluster's service store: where its allocator, quotas and grants "
                                       "live (init needs the cluster)")
    p.add_argument("action", choices=("init", "show"))
    p.add_argument("--address", default=None, help="the cluster's GCS address HOST:6379 (default: $RAY_ADDRESS)")
    common(p, " (show)")
    p = sub.add_parser("grant", help="what an owner's runs may claim on a shared cluster: a priority above 0, "
                                     "teams, not being preempted (admin token)")
    p.add_argument("owner", nargs="?", help="the owner (the login `etrain status` shows for its runs)")
    p.add_argument("--max-priority", type=int, default=None, help="the highest elastic.priority its runs may ask")
    p.add_argument("--teams", default=None, help="comma-separated teams its runs may count against")
    p.add_argument("--nonpreemptible", action="store_true", help="its runs may set elastic.preemptible = false")
    p.add_argument("--revoke", action="store_true", help="remove the owner's grant")
    p.add_argument("--list", action="store_true", help="every owner's grant")
    common(p, "")
    p = sub.add_parser("quota", help="the teams' quotas of workers on a shared cluster (setting one needs the "
                                     "admin token)")
    p.add_argument("team", nargs="?", help="the team ([elastic] team of its runs)")
    p.add_argument("--max-workers", type=int, default=None, help="the most workers the team's runs hold together")
    p.add_argument("--remove", action="store_true", help="remove the team's quota")
    common(p, "")


def service_file() -> str:
    """Where ``etrain service init`` notes the service store on this machine."""
    return os.path.join(etrain_home(), "service_store")


def known_service() -> tuple[str, str] | None:
    """The service store this machine knows of, and where from: ``$ETRAIN_SERVICE_STORE``, else the note
    ``etrain service init`` left here."""
    if os.environ.get(SERVICE_ENV):
        return check_url(os.environ[SERVICE_ENV], f"${SERVICE_ENV}"), f"${SERVICE_ENV}"
    try:
        with open(service_file()) as f:
            url = f.read(4096).strip()
    except OSError:
        return None
    return (check_url(url, service_file()), service_file()) if url else None


def service_store(args, *, required: bool):
    """The store quotas and grants are read and changed in: the cluster's service store. A ``--store`` (or
    ``$ETRAIN_STORE``) that is not it is refused naming it; without a known service store, the store given
    (``required``: ConfigError saying how to make one)."""
    from ..service.grants import is_service
    from ..store.run_store import open_store

    known = known_service()
    given = args.store or os.environ.get("ETRAIN_STORE")
    if known and given and check_url(given, "--store").rstrip("/") != known[0].rstrip("/"):
        store = open_store(check_url(given, "--store"))
        if not is_service(store):
            raise ConfigError(f"{redact(given)} is not the cluster's service store: quotas and grants live in "
                              f"{redact(known[0])} (from {known[1]}); pass --store {redact(known[0])}")
        return store
    store = open_store(known[0] if known and not given else store_url(args))
    if is_service(store):
        return store
    if required:
        raise ConfigError(f"{redact(store.url)} is not a service store: grants need the cluster's service store; "
                          "make one with `etrain service init --store URL --address HEAD:6379` (or name it with "
                          f"--store / ${SERVICE_ENV})")
    return store


def cmd_service(args: argparse.Namespace) -> int:
    from ..driver.run import connect
    from ..service.auth import admin_hash
    from ..service.docs import quotas
    from ..service.grants import grants_of, init_service, is_service, record_service_url, service_url
    from ..store.run_store import open_store

    if args.action == "show":
        store = service_store(args, required=True)
        out = {"store": redact(store.url), "service": is_service(store), "admin": admin_hash(store) is not None,
               "grants": {o: g.as_doc() for o, g in (grants_of(store) or {}).items()}, "quotas": quotas(store)}
        print(json.dumps(out, sort_keys=True) if args.json else "\n".join(
            printable(f"{k}: {v}") for k, v in out.items()))
        return 0
    if not args.store:
        raise ConfigError("etrain service init needs --store URL: the store the cluster's allocator, quotas and "
                          "grants will live in (etcd://HOST:2379/etrain, s3://bucket/service, file:///shared/service)")
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ConfigError("etrain service init records the service store in the cluster: --address HEAD:6379 "
                          "(the GCS address) or $RAY_ADDRESS")
    url = check_url(args.store, "--store")
    store = open_store(url)
    import ray

    if ray.is_initialized():  # this process joined a cluster before (the Python API): only that one is recorded
        here = ray.get_runtime_context().gcs_address
        if address.removeprefix("ray://") != here:
            raise ConfigError(f"--address {address} is not the cluster this process is connected to ({here}); "
                              "run etrain service init from a shell")
    connect(address, 0)  # the cluster first: a store is marked only for a cluster that records it
    with writing(store):
        made = init_service(store)
    before = service_url()
    record_service_url(url)
    os.makedirs(etrain_home(), mode=0o700, exist_ok=True)
    with open(service_file(), "w") as f:
        f.write(url + "\n")
    print(f"etrain: {redact(url)} is the cluster's service store"
          + (f" (it was {redact(before)})" if before and before != url else "")
          + (f"; its admin token is in {made} (keep it: quotas and grants need it)" if made else
             "; it keeps the admin token it had"))
    return 0


def cmd_grant(args: argparse.Namespace) -> int:
    from ..service.auth import authorize_admin
    from ..service.grants import Grant, grants_of, set_grant

    if args.owner is not None:
        check_name(args.owner, "the owner")
    store = service_store(args, required=True)
    if args.list or not args.owner:
        rows = {o: g.as_doc() for o, g in sorted((grants_of(store) or {}).items())}
        if args.json:
            print(json.dumps({"store": redact(store.url), "grants": rows}, sort_keys=True))
        elif not rows:
            print(printable(f"etrain: no grants in {redact(store.url)}; every run claims the defaults (priority <= 0, "
                            "team default, preemptible); grant more with etrain grant OWNER --max-priority N"))
        else:
            listing_console().print(grant_table(rows))
        return 0
    if args.revoke and (args.max_priority is not None or args.teams or args.nonpreemptible):
        raise ConfigError("give --revoke alone, or what to grant (--max-priority, --teams, --nonpreemptible)")
    teams = tuple(t.strip() for t in (args.teams or "").split(",") if t.strip())
    grant = None if args.revoke else Grant(max_priority=args.max_priority or 0, teams=teams,
                                           nonpreemptible=args.nonpreemptible)
    authorize_admin(store, args.token, f"a grant for owner {args.owner!r}")
    with writing(store):
        set_grant(store, args.owner, grant)
    what = "revoked" if grant is None else (f"max_priority {grant.max_priority}, teams {','.join(teams) or '-'}, "
                                            f"nonpreemptible {str(grant.nonpreemptible).lower()}")
    print(printable(f"etrain: owner {args.owner!r} in {redact(store.url)}: {what}"))
    return 0


def cmd_quota(args: argparse.Namespace) -> int:
    from ..service.auth import authorize_admin
    from ..service.docs import STATE_DOC, dict_field, quotas, read_doc, set_quota

    if args.team is not None:
        check_name(args.team, "the team")
    store = service_store(args, required=False)
    if args.max_workers is not None or args.remove:
        if not args.team:
            raise ConfigError("etrain quota --max-workers/--remove needs a TEAM: etrain quota TEAM --max-workers N")
        if args.max_workers is not None and args.remove:
            raise ConfigError("give --max-workers N or --remove, not both")
        if args.max_workers is not None and args.max_workers < 0:
            raise ConfigError(f"--max-workers {args.max_workers} must be >= 0")
        authorize_admin(store, args.token, f"a quota for team {args.team!r}")
        with writing(store):  # a store this user may only read: refused naming it (exit 2)
            set_quota(store, args.team, None if args.remove else args.max_workers)
    teams = quotas(store)
    state = read_doc(store, STATE_DOC)[0]
    held: dict[str, int] = {}
    team_of = dict_field(state, "teams")
    for key, n in dict_field(state, "targets").items():
        team = team_of.get(key, "default")
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0 and isinstance(team, str):
            held[team] = held.get(team, 0) + n
    rows = {t: {"max_workers": teams.get(t), "held": held.get(t, 0)} for t in sorted({*teams, *held})}
    if args.team:
        rows = {args.team: rows.get(args.team, {"max_workers": None, "held": 0})}
    if args.json:
        print(json.dumps({"store": redact(store.url), "teams": rows}, sort_keys=True))
        return 0
    if not rows:
        print(printable(f"etrain: no quotas in {redact(store.url)}; set one with etrain quota TEAM --max-workers N"))
        return 0
    listing_console().print(quota_table(rows))
    return 0


def quota_table(rows: dict[str, dict]) -> Table:
    """``etrain quota``: a row per team, as ``etrain status`` and ``etrain queue`` list theirs; the team, stored
    text, is a :func:`cell`; no quota is ``-``."""
    t = Table("team", "max workers", "held")
    for team, r in rows.items():
        t.add_row(cell(team), "-" if r["max_workers"] is None else cell(r["max_workers"]), cell(r["held"]))
    return t


def grant_table(rows: dict[str, dict]) -> Table:
    """``etrain grant --list``: a row per owner (stored text as :func:`cell`)."""
    t = Table("owner", "max priority", "nonpreemptible", "teams")
    for owner, g in rows.items():
        t.add_row(cell(owner), cell(g["max_priority"]), str(g["nonpreemptible"]).lower(),
                  cell(",".join(g["teams"]) or "-"))
    return t
