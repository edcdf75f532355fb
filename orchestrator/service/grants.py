"""The cluster's service store and its admin's grants: who may claim a priority, a team, or not to be
preempted, on a shared cluster.

    etrain service init --store etcd://10.0.0.5:2379/etrain     # the operator, once per cluster
    url = service_url()                       # the cluster's service store (Ray's GCS key-value store), or None
    set_grant(store, "ana", Grant(max_priority=10, teams=("vision",), nonpreemptible=True))   # etrain grant
    refuse_ungranted("ana", spec.sharing, grants_of(store))    # ConfigError naming the key and the grant
    demand, cut = clamp(demand, "ana", grants_of(store))       # the allocator: what was granted, no more

A cluster's **service store** holds the allocator's state, the teams' quotas and the grants. The
operator names it once (``etrain service init --store URL``): the store gets an admin token if it
has none, a ``service`` document, and its URL is recorded in Ray's GCS key-value store, where every
run's driver and the allocator find it. The allocator then keeps its state there and nowhere else,
and ``etrain quota`` and ``etrain grant`` act there only.

On a service with an admin token, a run's claims beyond the defaults need its owner's grant: a
priority above 0 (``max_priority``), a team other than ``default`` (``teams``), ``preemptible =
false`` (``nonpreemptible``). A run asking more is refused before it starts (exit 2, naming the key
and the grant), and the allocator decides every round on what was granted, whatever the run's spec
says since (a spec edited by hand gets what was granted). Without a service store, or on one without
an admin (one user's own cluster), every claim is taken as written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from checkpointing.errors import ConfigError
from checkpointing.names import redact

from ..config import TEAM_NAME, Sharing
from . import auth
from .docs import GRANTS_DOC, SERVICE_DOC, check_name, dict_field, read_doc, update_doc
from .policy import RunDemand

log = logging.getLogger("etrain")

KV_NAMESPACE = "etrain"
KV_KEY = b"service_store"
DEFAULT_TEAM = "default"
MAX_PRIORITY = 1_000_000  # as elastic.priority


@dataclass(frozen=True)
class Grant:
    """What one owner's runs may claim beyond the defaults."""

    max_priority: int = 0
    teams: tuple[str, ...] = ()
    nonpreemptible: bool = False

    def as_doc(self) -> dict:
        return {"max_priority": self.max_priority, "teams": list(self.teams), "nonpreemptible": self.nonpreemptible}

    @classmethod
    def of(cls, doc: object) -> Grant | None:
        """The grant a stored entry holds, or None if it is not one (then nothing is granted)."""
        if not isinstance(doc, dict):
            return None
        p, teams, nonp = doc.get("max_priority", 0), doc.get("teams", []), doc.get("nonpreemptible", False)
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= MAX_PRIORITY or not isinstance(nonp, bool):
            return None
        if not isinstance(teams, list) or not all(isinstance(t, str) and TEAM_NAME.fullmatch(t) for t in teams):
            return None
        return cls(p, tuple(teams), nonp)


NOTHING = Grant()


# --- the service store -----------------------------------------------------------------


def service_url() -> str | None:
    """The connected Ray cluster's service store, or None (no service, or Ray not connected here)."""
    import ray

    if not ray.is_initialized():
        return None
    from ray.experimental import internal_kv

    try:
        raw = internal_kv._internal_kv_get(KV_KEY, namespace=KV_NAMESPACE)
    except Exception as e:  # the GCS away for a moment: no service this time, said once in the log
        log.warning("the cluster's service store could not be read from Ray's GCS: %s", e)
        return None
    return raw.decode(errors="replace") if raw else None


def record_service_url(url: str) -> None:
    """Make ``url`` the connected cluster's service store (Ray must be connected)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(KV_KEY, url.encode(), overwrite=True, namespace=KV_NAMESPACE)


def is_service(store) -> bool:
    """Whether ``store`` is a cluster's service store (``etrain service init`` marked it)."""
    return bool(read_doc(store, SERVICE_DOC)[0].get("service"))


def init_service(store) -> str | None:
    """Mark ``store`` as a service store and give it an admin token if it has none: the admin token file's
    path when one was made, else None (the store's admin keeps the one it has)."""
    update_doc(store, SERVICE_DOC, lambda d: {**d, "service": "etrain", "initialized_unix":
                                              d.get("initialized_unix") or time.time()})
    if auth.admin_hash(store) is None:
        return auth.new_admin_token(store)
    return None


# --- grants ---------------------------------------------------------------------------


def grants_of(store) -> dict[str, Grant] | None:
    """Every owner's grant in the service store ``store``, or None when grants do not apply there (a store
    that is not a service store, or one without an admin: every claim is taken as written)."""
    if not is_service(store) or auth.admin_hash(store) is None:
        return None
    owners = dict_field(read_doc(store, GRANTS_DOC)[0], "owners")
    return {o: g for o, g in ((o, Grant.of(d)) for o, d in owners.items() if isinstance(o, str)) if g is not None}


def set_grant(store, owner: str, grant: Grant | None) -> dict[str, Grant]:
    """Grant ``owner`` what ``grant`` says (None: revoke); the grants after. The caller checked the admin token."""
    check_name(owner, "the owner")
    if grant is not None:
        if not 0 <= grant.max_priority <= MAX_PRIORITY:
            raise ConfigError(f"--max-priority {grant.max_priority} must be in [0, {MAX_PRIORITY}]")
        for t in grant.teams:
            check_name(t, "the team")

    def change(doc: dict) -> dict:
        owners = dict(dict_field(doc, "owners"))
        if grant is None:
            owners.pop(owner, None)
        else:
            owners[owner] = grant.as_doc()
        return {**doc, "owners": owners}

    owners = update_doc(store, GRANTS_DOC, change)["owners"]
    return {o: g for o, d in owners.items() if (g := Grant.of(d)) is not None}


def problems(owner: str, share: Sharing, grants: dict[str, Grant]) -> list[str]:
    """What ``share`` claims beyond ``owner``'s grant, each naming the key, the grant and the fix."""
    g = grants.get(owner, NOTHING)
    who = f"owner {owner!r}"
    out = []
    if share.priority > 0 and share.priority > g.max_priority:
        out.append(f"elastic.priority = {share.priority} is above what {who} was granted (max_priority "
                   f"{g.max_priority}): lower it, or ask the cluster's admin for `etrain grant {owner} "
                   f"--max-priority {share.priority}`")
    if share.team != DEFAULT_TEAM and share.team not in g.teams:
        granted = ", ".join(g.teams) or "none"
        out.append(f"elastic.team = {share.team!r} is not one of the teams {who} was granted ({granted}): use one "
                   f"of them or {DEFAULT_TEAM!r}, or ask the admin for `etrain grant {owner} --teams {share.team}`")
    if not share.preemptible and not g.nonpreemptible:
        out.append(f"elastic.preemptible = false needs a grant {who} does not have: set it true, or ask the "
                   f"admin for `etrain grant {owner} --nonpreemptible`")
    return out


def refuse_ungranted(owner: str, share: Sharing, grants: dict[str, Grant] | None) -> None:
    """ConfigError (exit 2) when the run claims more than its owner's grant (nothing when grants do not apply)."""
    if grants is None:
        return
    found = problems(owner, share, grants)
    if found:
        raise ConfigError("; ".join(found))


def check_on_cluster(owner: str, share: Sharing) -> None:
    """:func:`refuse_ungranted` against the connected cluster's service store, if it has one."""
    url = service_url()
    if url is None:
        return
    from ..store.run_store import open_store

    try:
        grants = grants_of(open_store(url))
    except Exception as e:  # the allocator applies the grants all the same: starting is not refused for this
        log.warning("the service store %s could not be read (%s); the allocator applies the grants", redact(url), e)
        return
    refuse_ungranted(owner, share, grants)


def clamp(d: RunDemand, owner: str, grants: dict[str, Grant] | None) -> tuple[RunDemand, str]:
    """``d`` with what ``owner`` was granted in place of what it claims beyond (grants None: ``d`` as it is),
    and what was cut ("" for nothing)."""
    if grants is None:
        return d, ""
    g = grants.get(owner, NOTHING)
    priority = min(d.priority, max(0, g.max_priority))
    team = d.team if d.team in (DEFAULT_TEAM, *g.teams) else DEFAULT_TEAM
    preemptible = d.preemptible or not g.nonpreemptible
    cut = [f"priority {d.priority} -> {priority}" if priority != d.priority else "",
           f"team {d.team!r} -> {team!r}" if team != d.team else "",
           "preemptible" if preemptible != d.preemptible else ""]
    cut = [c for c in cut if c]
    if not cut:
        return d, ""
    return replace(d, priority=priority, team=team, preemptible=preemptible), \
        f"beyond owner {owner!r}'s grant: " + ", ".join(cut)


