"""What the run store holds: its documents, their shapes, and the check every document read back passes.

    spec = RunSpec.from_json(blob, where="file:///runs/tiny/control/spec.json")   # CorruptRunStore if not one
    rows = [HistoryRow.of(r) for r in history]                                      # step, loss, world_size, ...
    status = load_doc(raw, where, status_problem)

The run store (:mod:`orchestrator.store.run_store`) keeps a run's spec (desired state,
written by the CLI), status, events and step history (observed state, written
by the controller) and its leader lease, as JSON documents in etcd or beside
the checkpoints. Stored bytes are data: every document is checked against the
shape etrain writes before use, and anything else raises
:class:`CorruptRunStore` naming the document's key or URL.
"""

from __future__ import annotations

import errno
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any, NamedTuple

from checkpointing.errors import ConfigError, EtrainError
from checkpointing.names import redact, validate_run_id

from ..config import TEAM_NAME, Sharing, sharing_from_raw
from ..phase import Phase

PHASES = tuple(p.value for p in Phase)


class CorruptRunStore(EtrainError):
    """A run-store document is not valid JSON or not the shape etrain writes; the message names it."""


class UnknownRun(EtrainError):
    """No run with this id in the store."""


class RunConflict(EtrainError):
    """The request contradicts the run's state (a live run id reused, suspend of a suspended run, ...)."""


class SpecConflict(RunConflict):
    """The spec changed between the read a change was based on and its write (compare-and-swap refused)."""


class StoreUnavailable(EtrainError):
    """The run store cannot be reached right now."""


class StoreNotWritable(EtrainError):
    """This user may read the run store but not write it (a read-only disk, a directory of another user)."""


@contextmanager
def writing(store) -> Iterator[None]:
    """Writes to ``store`` inside; one that the operating system refuses (no permission, a read-only file
    system) raises StoreNotWritable naming the store, not an OSError."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise StoreNotWritable(f"the run store {redact(store.url)} is not writable by this user ({e.strerror}: "
                               f"{e.filename or 'a document'}); ask its owner, or use a store you may write") from None


# --- document shapes ---------------------------------------------------------------

_NUMBER = (int, float)
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a JSON object",
               list: "a JSON list"}


def _is(value: Any, types: tuple) -> bool:
    """isinstance, except that a bool is not an int or a float (JSON tells them apart)."""
    return isinstance(value, bool) == (bool in types) and isinstance(value, types)


def _object_problem(doc: Any, types: dict[str, tuple], required: tuple[str, ...] = (),
                    none_ok: bool = False) -> str | None:
    """What is wrong with ``doc`` as a JSON object whose fields have ``types``, or None."""
    if not isinstance(doc, dict):
        return f"is not a JSON object (it holds {json.dumps(doc)[:40]})"
    for key in required:
        if key not in doc:
            return f"lacks the field {key!r}"
    for key, tps in types.items():
        if key in doc and not (_is(doc[key], tps) or (none_ok and doc[key] is None)):
            expected = "a number" if tps == _NUMBER else " or ".join(_TYPE_NAMES[t] for t in tps)
            return f"has {key}={json.dumps(doc[key])[:40]}, not {expected}"
    return None


# RunSpec's fields, as JSON types.
SPEC_TYPES: dict[str, tuple] = {"run_id": (str,), "config": (dict,), "workers": (int,), "min_workers": (int,),
                                "max_workers": (int,), "suspended": (bool,), "stop": (bool,), "generation": (int,),
                                "created_unix": _NUMBER, "updated_unix": _NUMBER, "ray_address": (str,),
                                "owner": (str,), "token_hash": (str,), "resume_grant": (str,), "target": (int,),
                                "requeue": (bool,), "pinned": (bool,), "target_cause": (str,)}


# What the store keeps of a token (orchestrator.service.auth.digest), or "" for none.
TOKEN_HASH = re.compile(r"sha256:[0-9a-f]{64}")


def _spec_problem(doc: Any) -> str | None:
    problem = _object_problem(doc, SPEC_TYPES, required=("run_id", "config", "workers", "min_workers",
                                                         "max_workers"))
    for key in ("token_hash", "resume_grant"):
        if problem is None and doc.get(key) and not TOKEN_HASH.fullmatch(doc[key]):
            return f"has {key}={json.dumps(doc[key])[:40]}, not sha256:<64 hex digits>"
    if problem is None:
        try:
            validate_run_id(doc["run_id"])
        except ConfigError:
            return f"has run_id={json.dumps(doc['run_id'])[:40]}, which is not a valid run id"
    return problem


# What a status (and an event) may hold in the fields etrain reads back and shows: counts are integers
# >= 0, times and figures finite numbers (an integer beyond 2**63 is not one), ``phase`` a Phase.
_COUNT, _FINITE, _TIME, _SIGNED = "count", "finite", "time", "signed"
MAX_INT = 2**63
STATUS_FIELDS: dict[str, Any] = {
    "run_id": (str,), "phase": (str,), "reason": (str,), "metrics_url": (str,), "team": (str,), "owner": (str,),
    "queue_reason": (str,), "controller_id": (str,), "memory_tier": (dict,), "requeue": (bool,),
    "preemptible": (bool,), "priority": _SIGNED, "loss": _FINITE, "eval_loss": _FINITE, "goodput": _FINITE,
    "tokens_per_s": _FINITE, "updated_unix": _TIME, "queued_unix": _TIME, "queue_wait_s": _TIME,
    "skipped_ranges": (list,),
    **{k: _COUNT for k in ("step", "total_steps", "world_size", "epoch", "latest_checkpoint", "recoveries",
                           "verified_step", "steps_lost", "min_workers", "max_workers", "target", "failures",
                           "resizes")}}


def finite(value: Any) -> bool:
    """Whether ``value`` is a JSON number a float holds: not a bool, not nan or inf, an integer below 2**63."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return -MAX_INT < value < MAX_INT if isinstance(value, int) else math.isfinite(value)


def _field_problem(key: str, value: Any, kind: Any) -> str | None:
    if isinstance(kind, tuple):
        ok = _is(value, kind)
        expected = " or ".join(_TYPE_NAMES[t] for t in kind)
    elif isinstance(kind, re.Pattern):
        ok = isinstance(value, str) and bool(kind.fullmatch(value))
        expected = "a valid name"
    else:
        ok = finite(value) and (kind != _SIGNED or isinstance(value, int)) and \
            (kind not in (_COUNT, _TIME) or value >= 0) and (kind != _COUNT or isinstance(value, int))
        expected = {_COUNT: "an integer >= 0", _SIGNED: "an integer", _FINITE: "a finite number",
                    _TIME: "a finite number >= 0"}[kind]
    return None if ok else f"has {key}={json.dumps(value)[:40]}, not {expected}"


def status_problem(doc: Any) -> str | None:
    """What is wrong with ``doc`` as a run's status (any field may be null), or None."""
    if not isinstance(doc, dict):
        return f"is not a JSON object (it holds {json.dumps(doc)[:40]})"
    for key, kind in STATUS_FIELDS.items():
        found = _field_problem(key, doc[key], kind) if doc.get(key) is not None else None
        if found:
            return found
    if doc.get("phase") is not None and doc["phase"] not in PHASES:
        return f"has phase={json.dumps(doc['phase'])[:40]}, not one of {', '.join(PHASES)}"
    return None


def event_problem(doc: Any) -> str | None:
    return _object_problem(doc, {"kind": (str,)}) or (
        _field_problem("time", doc["time"], _TIME) if "time" in doc else None)


# The fields of the cluster allocator's state document (orchestrator.service.allocator) that `etrain queue`
# and `etrain quota` show: maps from a run to why it waits, its team, the workers it is to hold.
ALLOCATOR_MAPS = {"waiting": (str,), "teams": TEAM_NAME, "targets": _COUNT}


def maps_problem(doc: Any, maps: dict[str, Any]) -> str | None:
    """What is wrong with ``doc`` as a JSON object whose fields ``maps`` are objects of values of one kind, or None."""
    found = _object_problem(doc, {key: (dict,) for key in maps})
    for key, kind in maps.items() if found is None else ():
        for name, value in doc.get(key, {}).items():
            found = _field_problem(f"{key}[{json.dumps(name)[:40]}]", value, kind)
            if found:
                return found
    return found


def history_problem(doc: Any) -> str | None:
    ok = isinstance(doc, list) and all(
        isinstance(row, list) and len(row) >= 6  # rows written before tokens_per_s and eval_loss: 6 long
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row[:6])
        and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in row[6:8])
        for row in doc)
    if not ok:
        return f"is not a JSON list of rows ({', '.join(HistoryRow._fields)}: numbers; the last two may be null)"
    return None


def leader_problem(doc: Any) -> str | None:
    return _object_problem(doc, {"id": (str,), "expires_unix": _NUMBER}, required=("id", "expires_unix"))


def load_doc(raw: str | bytes, where: str, problem: Callable[[Any], str | None]) -> Any:
    """The JSON document ``raw`` read from ``where``; CorruptRunStore naming ``where`` if it is not
    valid JSON or ``problem(doc)`` finds something wrong with its shape."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; nested past Python's limit
        raise CorruptRunStore(f"{where} is not valid JSON: {str(e)[:200]}; repair or delete it") from None
    found = problem(doc)
    if found:
        raise CorruptRunStore(f"{where} {found}; repair or delete it")
    return doc


class HistoryRow(NamedTuple):
    """One trained step in a run's history (``RunStore.put_history``), stored as a JSON list in this
    order. A step redone after a restore appears again, later."""

    step: int
    loss: float
    world_size: int
    samples_consumed: int
    unix: float  # when the step ended
    step_s: float  # how long it took
    tokens_per_s: float | None = None  # the step's throughput (None in rows of older runs)
    eval_loss: float | None = None  # the held-out loss after this step, on the steps that evaluated

    @classmethod
    def of(cls, row) -> HistoryRow:
        return row if isinstance(row, cls) else cls(*row[:8])


@dataclass
class RunSpec:
    """What the user asked for. Written by the CLI, read by the controller."""

    run_id: str
    config: dict[str, Any]  # the whole run config (TOML as a dict)
    workers: int
    min_workers: int
    max_workers: int
    suspended: bool = False
    stop: bool = False
    generation: int = 0  # bumped by every change, so the controller can tell a new request
    created_unix: float = field(default_factory=time.time)
    updated_unix: float = 0.0  # when the last change was requested (the requester's clock)
    ray_address: str = ""  # the cluster that ran it last ("" = a local Ray)
    # Who started it (informational: the token authorizes) and the sha256 of its run token, never the token
    # (orchestrator.service.auth). "" in runs recorded before tokens: those take control commands from anyone.
    owner: str = ""
    token_hash: str = ""
    resume_grant: str = ""  # the sha256 of a one-use grant: `etrain resume --submit` hands it to the new job
    # Written by the cluster's allocator (docs/service.md), never by a user: the size the controller should
    # have (0: no decision, ``workers`` is the desired size) and whether to give every worker back and wait
    # in QUEUED (suspended for a higher-priority run, resumed by the controller itself when re-admitted).
    # A user's resize sets ``workers`` and clears ``target``.
    target: int = 0
    requeue: bool = False
    target_cause: str = ""  # the allocator's why of ``target`` ("preempted: ..."), shown where the size changes
    # An explicit resize (`etrain resize`, Run.resize) pins the run at its ``workers``: the allocator may still
    # shrink it (preemption, quotas, capacity) and gives that size back, but never grows it beyond it into idle
    # capacity until its user allows growth again (`etrain resize RUN --allow-growth`).
    pinned: bool = False

    @cached_property
    def sharing(self) -> Sharing:
        """The run's claims on a shared cluster (``[elastic]`` priority, team, ...), parsed once from its
        config (:func:`orchestrator.config.sharing_from_raw`); ConfigError naming the key if they are invalid."""
        return sharing_from_raw(self.config)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "spec.json") -> RunSpec:
        """The spec stored at ``where``; CorruptRunStore if it is not one (its ``[elastic]`` claims included)."""
        d = load_doc(text, where, _spec_problem)
        known = {f.name for f in fields(cls)}
        spec = cls(**{k: v for k, v in d.items() if k in known})
        try:
            spec.sharing  # noqa: B018  (parsed and kept: a spec whose claims do not parse is not one)
        except ConfigError as e:
            raise CorruptRunStore(f"{where} has a config whose {e}; repair or delete it") from None
        return spec


@dataclass
class Lease:
    run_id: str
    controller_id: str
    ttl_s: float
    handle: Any = None  # backend's own lease object


def is_run_id(name: str) -> bool:
    """Whether ``name`` (a directory or key found in the store) is a valid run id; others are not runs."""
    try:
        validate_run_id(name)
        return True
    except ConfigError:
        return False


def key_text(key: str | bytes) -> str:
    """An etcd key as text."""
    return key.decode(errors="replace") if isinstance(key, bytes) else key
