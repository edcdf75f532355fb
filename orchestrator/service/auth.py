"""Who may change a run: run tokens, the admin token, and the check every control action passes.

    token = mint()                                   # etrain run / submit / etrain.submit: the new run's token
    spec.token_hash = digest(token)                  # all the run store keeps of it
    registry.record(run_id, url, token=token)        # the owner keeps it: $ETRAIN_HOME/runs/RUN.json, mode 0600
    spec = change_run(store, "tiny", {"suspended": True})              # the token found for this user, or
    spec = change_run(store, "tiny", lambda s: {"workers": 4}, token)  # NotAuthorized naming why (exit 2)
    path = new_admin_token(store)                    # etrain admin-token: kept in admin_token_file(store)
    grant = mint_grant()                             # etrain resume --submit: one use, for an hour

Every run has an owner (the user who started it) and a token (``etr_`` and 256 random bits, URL-safe)
that only the owner's registry holds; the store keeps its sha256. Suspend, resume, resize and stop need
the run's token or the store's admin token, tried in this order: ``--token`` (the caller's argument),
``$ETRAIN_RUN_TOKEN``, this user's run registry, ``$ETRAIN_ADMIN_TOKEN``, the store's admin token file
(``$ETRAIN_HOME/admin_tokens/<store>``, one per store), and last the single ``$ETRAIN_HOME/admin_token``
of earlier versions (read, never written). The admin token's sha256 is a document of the store
(``etrain admin-token`` writes it; replacing it needs the current one). Tokens are never written to the
store, an event, a status or a log line.

A resume grant (``etrain resume --submit`` hands one to the job it submits) resumes one run once, and
only until the expiry it carries (``etr_g_<unix seconds>_<256 random bits>``, :data:`GRANT_LIFETIME_S`
after it was made); the store keeps its sha256, which covers the expiry, so it cannot be extended.

What this is, and is not: the check runs in the process that makes the change (the CLI, the Python API,
the allocator), against hashes the store holds. It keeps users of a shared store from changing each
other's runs through etrain; it cannot stop someone who writes the store's raw documents (they can
rewrite the hashes too). Access to the store itself (etcd users and roles, bucket policies) is that gate.
"""

from __future__ import annotations

import getpass
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from checkpointing.errors import EtrainError
from checkpointing.names import etrain_home, redact

from ..store.documents import TOKEN_HASH, RunSpec, SpecConflict

RUN_TOKEN_ENV, ADMIN_TOKEN_ENV = "ETRAIN_RUN_TOKEN", "ETRAIN_ADMIN_TOKEN"
# Secrets of the process that runs a command: never forwarded to a Ray job's environment or to workers.
SECRET_ENV = (RUN_TOKEN_ENV, ADMIN_TOKEN_ENV, "ETRAIN_RESUME_GRANT")
HASH_PATTERN = TOKEN_HASH
ADMIN_DOC = "admin"  # the store's document holding the admin token's hash
GRANT_LIFETIME_S = 3600  # how long a resume grant may be used after it was made
_GRANT = re.compile(r"etr_g_([0-9]{1,12})_[A-Za-z0-9_-]{32,}")


class NotAuthorized(EtrainError):
    """The caller holds neither the run's token nor the admin token; the message says whose run it is."""


def mint() -> str:
    """A new secret token: 256 random bits, URL-safe, behind a prefix (it never starts with "-", which a
    command line would take for an option, and secret scanners can find it)."""
    return "etr_" + secrets.token_urlsafe(32)


def digest(token: str) -> str:
    """What the store keeps of a token."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def matches(token: str | None, hashed: str) -> bool:
    return bool(token) and bool(hashed) and hmac.compare_digest(digest(token), hashed)


def current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def mint_grant(lifetime_s: float = GRANT_LIFETIME_S, now: float | None = None) -> str:
    """A one-use resume grant that expires ``lifetime_s`` after ``now``: the expiry in the clear, then 256
    random bits; its :func:`digest` covers both."""
    expires = int((time.time() if now is None else now) + lifetime_s)
    return f"etr_g_{expires}_{secrets.token_urlsafe(32)}"


def grant_expiry(grant: str | None) -> int | None:
    """The unix time a resume grant made by :func:`mint_grant` expires, or None for one that carries none."""
    m = _GRANT.fullmatch(grant or "")
    return int(m.group(1)) if m else None


def admin_token_file(store=None) -> str:
    """Where this user keeps the admin token of ``store`` (a run store, or its URL): one file per store,
    ``$ETRAIN_HOME/admin_tokens/<slug>-<hash>``: the end of its redacted URL made a file name, and the first
    16 hex digits of that URL's sha256 (``etcds://`` counted as ``etcd://``: one server, one store). Without a
    store, the single file of earlier versions, ``$ETRAIN_HOME/admin_token``: read, never written."""
    if store is None:
        return os.path.join(etrain_home(), "admin_token")
    url = redact(store if isinstance(store, str) else store.url)
    if url.startswith("etcds://"):
        url = "etcd://" + url.removeprefix("etcds://")
    slug = re.sub(r"[^A-Za-z0-9.-]+", "_", url.split("://", 1)[-1])[-60:].strip("._-") or "store"
    return os.path.join(etrain_home(), "admin_tokens", f"{slug}-{hashlib.sha256(url.encode()).hexdigest()[:16]}")


def _read_token(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _admin_from_file(store=None) -> list[tuple[str, str]]:
    """The admin tokens this user keeps for ``store``, with their files: its own file, then the single file
    of earlier versions (which may hold this store's)."""
    paths = ([admin_token_file(store)] if store is not None else []) + [admin_token_file()]
    return [(t, path) for t, path in ((_read_token(path), path) for path in paths) if t]


def _admin_held(store, token: str | None = None) -> list[tuple[str, str]]:
    """The admin tokens this caller holds for ``store``, with where each came from, in the order tried."""
    found = [(token, "--token"), (os.environ.get(ADMIN_TOKEN_ENV), f"${ADMIN_TOKEN_ENV}"), *_admin_from_file(store)]
    return [(t, where) for t, where in found if t]


def candidates(run_id: str, token: str | None = None, store=None) -> list[tuple[str, str]]:
    """The tokens this caller holds for ``run_id`` (of ``store``: its admin token file), with where each
    came from, in the order they are tried."""
    from ..store import user_runs as registry

    found = [(token, "--token"), (os.environ.get(RUN_TOKEN_ENV), f"${RUN_TOKEN_ENV}"),
             (registry.token_of(run_id), f"the run registry {registry.runs_dir()}"),
             *_admin_held(store)]
    return [(t, where) for t, where in found if t]


def admin_hash(store) -> str | None:
    """The store's admin token hash, or None when the store has none (or a document that is not one)."""
    raw, _ = store.read_versioned(None, ADMIN_DOC)
    return _admin_doc_hash(raw)


def _admin_doc_hash(raw: str | None) -> str | None:
    try:
        doc = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        return None
    value = doc.get("token_hash") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and HASH_PATTERN.fullmatch(value) else None


def authorize(store, spec: RunSpec, token: str | None = None, *, grant: str | None = None,
              now: float | None = None) -> str:
    """How the caller may change ``spec``'s run: "owner", "admin", "grant" (a resume handed to a new job,
    before its expiry) or "open" (a run recorded before tokens); NotAuthorized naming whose run it is and
    what to pass."""
    if not spec.token_hash:
        return "open"
    stale = ""
    if grant is not None and matches(grant, spec.resume_grant):
        expires = grant_expiry(grant)
        if expires is not None and (time.time() if now is None else now) <= expires:
            return "grant"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(expires)) if expires is not None else ""
        stale = f"; the resume grant it was given expired at {when} " if when else \
            "; the resume grant it was given carries no expiry "
        stale += f"(grants last {GRANT_LIFETIME_S // 60} minutes): resume it again with `etrain resume --submit`"
    held = candidates(spec.run_id, token, store)
    if any(matches(t, spec.token_hash) for t, _ in held):
        return "owner"
    admin = admin_hash(store) if held else None
    if admin and any(matches(t, admin) for t, _ in held):
        return "admin"
    owner = spec.owner or "another user"
    tried = "; tried " + ", ".join(where for _, where in held) if held else ""
    raise NotAuthorized(f"run {spec.run_id!r} belongs to {owner}; pass --token TOKEN (or ${RUN_TOKEN_ENV}) or run "
                        f"as its owner (its token is in the owner's run registry), or use an admin token "
                        f"(${ADMIN_TOKEN_ENV}){tried}{stale}")


def authorize_admin(store, token: str | None = None, what: str = "this change") -> None:
    """Cluster-wide changes (team quotas) need the store's admin token (``--token``, $ETRAIN_ADMIN_TOKEN or
    the store's admin token file); NotAuthorized naming what to do otherwise."""
    admin = admin_hash(store)
    if admin is None:
        raise NotAuthorized(f"{what} needs the store's admin token, and {redact(store.url)} has none yet: make it "
                            "with `etrain admin-token`")
    if not any(matches(t, admin) for t, _ in _admin_held(store, token)):
        raise NotAuthorized(f"{what} needs the admin token of {redact(store.url)}: pass --token TOKEN or set "
                            f"${ADMIN_TOKEN_ENV} (or keep it in {admin_token_file(store)})")


def change_run(store, run_id: str, changes: dict | Callable[[RunSpec], dict], token: str | None = None, *,
               grant: str | None = None, attempts: int = 5) -> RunSpec:
    """Authorize the caller for ``run_id`` and apply ``changes`` (a dict, or a function of the spec read
    that returns one and may refuse by raising) as a compare-and-swap on that read; when another writer
    changed the spec in between, read it again, authorize and decide again (at most ``attempts`` times)."""
    for attempt in range(attempts):
        spec = store.get_spec(run_id)
        how = authorize(store, spec, token, grant=grant)
        wanted = dict(changes(spec) if callable(changes) else changes)
        if how == "grant":
            wanted["resume_grant"] = ""  # one use
        try:
            return store.update_spec(run_id, expected=spec.generation, **wanted)
        except SpecConflict:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def init_admin(store, token: str) -> None:
    """Make ``token`` the admin token of ``store`` (its hash written there). Replacing an admin token needs
    the current one ($ETRAIN_ADMIN_TOKEN or the store's admin token file); NotAuthorized otherwise."""
    raw, version = store.read_versioned(None, ADMIN_DOC)
    existing = _admin_doc_hash(raw) if raw else None
    if raw and existing is None:
        raise EtrainError(f"the store {redact(store.url)} holds an admin document that is not etrain's; "
                          "repair or delete it")
    if existing and not any(matches(t, existing) for t, _ in _admin_held(store)):
        raise NotAuthorized(f"the store {redact(store.url)} has an admin token already; replacing it needs the "
                            f"current one (${ADMIN_TOKEN_ENV} or {admin_token_file(store)})")
    if not store.write_if(None, ADMIN_DOC, json.dumps({"token_hash": digest(token)}), version):
        raise SpecConflict(f"the admin token of {redact(store.url)} was changed meanwhile; try again")


def new_admin_token(store) -> str:
    """``etrain admin-token``: a new admin token for ``store``, kept in the store's own
    :func:`admin_token_file` (mode 0600 in a 0700 directory, written before the store takes its hash, moved
    into place after: another store's file is never touched); the file's path."""
    path = admin_token_file(store)
    for d in (etrain_home(), os.path.dirname(path)):
        os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o700)
    token, staged = mint(), f"{path}.{os.getpid()}.new"
    with os.fdopen(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(token + "\n")
    try:
        init_admin(store, token)
    except BaseException:
        os.remove(staged)
        raise
    os.replace(staged, path)
    return path


def job_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a run's Ray job and workers get from this process: ``AWS_*`` and ``ETRAIN_*``, less
    the tokens (:data:`SECRET_ENV`)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith(("AWS_", "ETRAIN_")) and k not in SECRET_ENV}


@contextmanager
def secrets_withheld(env: dict[str, str] | None = None) -> Iterator[None]:
    """:data:`SECRET_ENV` out of ``env`` (this process's environment) while the block runs, back after: a
    local Ray started in the block, and every worker it starts, inherits the environment without them."""
    env = os.environ if env is None else env
    held = {k: env.pop(k) for k in SECRET_ENV if k in env}
    try:
        yield
    finally:
        env.update(held)
