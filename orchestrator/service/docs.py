"""The service's own documents in a store (the allocator's state, the quotas, the grants), read and
changed as compare-and-swap, each checked against the shape etrain writes.

    doc, version = read_doc(store, "quotas")            # {} when absent or not a JSON object
    update_doc(store, "quotas", lambda d: {**d, "teams": {"vision": 16}})
    quotas(store)                                       # {"vision": 16}: only entries that are quotas

Every reader of these documents takes what it reads as data: a field of the wrong type is left out,
never raised on, so one bad document can stop no decision of the allocator and no listing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from checkpointing.errors import ConfigError, EtrainError

from ..config import TEAM_NAME

STATE_DOC = "allocator"  # the registry of the cluster's runs, the last decision, why queued runs wait
QUOTAS_DOC = "quotas"
GRANTS_DOC = "grants"
SERVICE_DOC = "service"  # present in the cluster's service store (etrain service init)
# An owner's name: a login (letters, digits, _ . - and @ of a domain login).
OWNER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}")
MAX_WORKERS = 1_000_000  # the most workers a quota may name (as elastic.max_workers)


def read_doc(store, name: str) -> tuple[dict, object]:
    """A store document of the service's as a dict ({} when absent or not one) and its version."""
    raw, version = store.read_versioned(None, name)
    try:
        doc = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):  # not JSON, or nested too deep to parse
        doc = {}
    return (doc if isinstance(doc, dict) else {}), version


def update_doc(store, name: str, change: Callable[[dict], dict], attempts: int = 10) -> dict:
    """Apply ``change`` to a store document as a compare-and-swap, again when another writer got in between."""
    for _ in range(attempts):
        doc, version = read_doc(store, name)
        new = change(dict(doc))
        if store.write_if(None, name, json.dumps(new, sort_keys=True), version):
            return new
    raise EtrainError(f"the store's {name!r} document kept changing under {attempts} writes; try again")


def check_name(value: str, what: str) -> str:
    """``value`` if it is a team's name (``what`` names a team) or an owner's; ConfigError naming ``what``."""
    team = "team" in what
    if not isinstance(value, str) or not (TEAM_NAME if team else OWNER_NAME).fullmatch(value):
        raise ConfigError(f"{what} {value!r} must be 1-63 letters, digits, '_', '.'{'' if team else ', @'} or '-', "
                          "starting with a letter or digit")
    return value


def dict_field(doc: dict, key: str) -> dict:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def quotas(store) -> dict[str, int]:
    """The teams' quotas: team -> the most workers its runs may hold together (entries that are not one left out)."""
    teams = dict_field(read_doc(store, QUOTAS_DOC)[0], "teams")
    return {t: n for t, n in teams.items() if isinstance(t, str) and TEAM_NAME.fullmatch(t) and isinstance(n, int)
            and not isinstance(n, bool) and 0 <= n <= MAX_WORKERS}


def set_quota(store, team: str, max_workers: int | None) -> dict[str, int]:
    """Set (or, with None, remove) ``team``'s quota: the most workers its runs may hold together."""
    check_name(team, "the team")
    if max_workers is not None and (not isinstance(max_workers, int) or not 0 <= max_workers <= MAX_WORKERS):
        raise ConfigError(f"--max-workers {max_workers} must be an integer in [0, {MAX_WORKERS}]")

    def change(doc: dict) -> dict:
        teams = dict(dict_field(doc, "teams"))
        if max_workers is None:
            teams.pop(team, None)
        else:
            teams[team] = max_workers
        return {**doc, "teams": teams}

    return update_doc(store, QUOTAS_DOC, change)["teams"]
