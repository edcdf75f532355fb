"""Quarantined nodes: nodes a run's detector found bad (silent corruption, fail-slow, a failure attributed to
the node), on which nothing of any run is placed until an admin releases them.

    quarantine_node(store, node_id, reason="sdc", run="tiny.3f2a9c1d", rank=1, step=120,
                    evidence={"digest_mismatch": 3}, nodes=16)    # True if new; QuarantineRefused past a bound
    quarantined_nodes(store)            # {node id: {"reason", "run", "rank", "step", "since", "evidence", "address"}}
    release_node(store, "3f2a9c", token)      # the admin token; a unique prefix of the id; the entry released
    release_all(store, token)           # every node (also what repairs a document that is not etrain's)
    set_limits(store, token, max_fraction=0.25, per_run=2)      # the bounds below (admin)
    ctl.event(**quarantine_event(node_id, reason="sdc", rank=1, step=120))     # the run's event
    publish(ids); placement_exclusions()        # the set in Ray's GCS, where placement reads it
    avoiding(labels, excluded)          # a bundle label selector that keeps off the excluded nodes

The quarantine is the document ``quarantine`` of the store the cluster's allocator keeps its state in (the
service store, ``etrain service init``; else the store of the run that started the allocator:
:func:`orchestrator.service.nodes.cluster_store` finds it): ``{"nodes": {node id: entry}, "limits":
{"max_fraction", "per_run"}}``. It is read back as data: a document that is not this shape is refused
whole (:class:`CorruptQuarantine`, naming the store and the fix), never half-used and never overwritten
by a quarantine; the allocator keeps the set it read last and decides on.

Where it acts: the allocator leaves quarantined nodes out of the cluster's capacity
(:mod:`orchestrator.service.capacity`) and writes the set, every decision, to Ray's GCS key-value store
(:func:`publish`; namespace ``etrain``, key ``quarantined_nodes``), from which the worker groups read it
(:func:`placement_exclusions`) and keep every placement group off those nodes with Ray's default label
``ray.io/node-id`` (:func:`avoiding`: ``"!in(id1,id2)"``). A quarantine or a release made where Ray is
connected publishes at once.

Bounds (what a tenant, or a detector gone wrong, could do with it): quarantines take at most
``max_fraction`` of the cluster's nodes together (at least one node; default a quarter), and one run
(``run``) holds at most ``per_run`` of them (default 2). Beyond either a quarantine is refused with
:class:`QuarantineRefused`, which the run records; only the admin token releases nodes or changes the
bounds. A run's own quarantine is checked further (that the run is live and formed on the node) by
:func:`orchestrator.service.nodes.quarantine_on_cluster`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from checkpointing.errors import ConfigError, EtrainError
from checkpointing.names import redact

from ..store.documents import CorruptRunStore, finite, load_doc
from . import auth

log = logging.getLogger("etrain")

QUARANTINE_DOC = "quarantine"
KV_NAMESPACE, KV_KEY = "etrain", b"quarantined_nodes"
NODE_ID_LABEL = "ray.io/node-id"  # Ray's default label of every node (ray.util.placement_group.NODE_ID_LABEL_KEY)
NODE_ID = re.compile(r"[0-9a-f]{56}")  # a Ray node id in hex (28 bytes)
RUN_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a run id, or its cluster key (run id and store digest)
MAX_NODES = 4096  # entries a document may hold
MAX_REASON = 300  # characters of a reason
MAX_EVIDENCE_BYTES = 2048  # an entry's evidence, as JSON
MAX_FRACTION, PER_RUN = 0.25, 2
MIN_PREFIX = 4  # hex digits a node id may be shortened to on the command line


class CorruptQuarantine(CorruptRunStore):
    """The quarantine document is not the shape etrain writes; the message names the store and the fix."""


class QuarantineRefused(EtrainError):
    """A quarantine past a bound (the cluster's fraction, the run's share), or asked by a run that may not."""


class UnknownNode(EtrainError):
    """No quarantined node (or no node of the cluster) has this id or prefix."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """How much of the cluster quarantines may take: ``max_fraction`` of its nodes together (at least one
    node), ``per_run`` nodes by any one run."""

    max_fraction: float = MAX_FRACTION
    per_run: int = PER_RUN

    def __post_init__(self):
        if isinstance(self.max_fraction, bool) or not finite(self.max_fraction) or not 0 < self.max_fraction <= 1:
            raise ConfigError(f"--max-fraction {self.max_fraction!r:.40} must be a number in (0, 1]")
        if isinstance(self.per_run, bool) or not isinstance(self.per_run, int) or not 1 <= self.per_run <= MAX_NODES:
            raise ConfigError(f"--per-run {self.per_run!r:.40} must be an integer in [1, {MAX_NODES}]")

    def cap(self, nodes: int) -> int:
        """The most nodes quarantined together on a cluster of ``nodes`` nodes."""
        return max(1, math.floor(self.max_fraction * max(0, nodes)))

    def as_doc(self) -> dict:
        return {"max_fraction": self.max_fraction, "per_run": self.per_run}


# --- the document --------------------------------------------------------------------------

# An entry's fields: their kind (a JSON type, "count": an integer >= 0, "time": a finite number >= 0), required.
ENTRY_FIELDS = {"reason": (str, True), "since": ("time", True), "run": (str, False), "rank": ("count", False),
                "step": ("count", False), "evidence": (dict, False), "address": (str, False)}
KIND_NAMES = {str: "a string", dict: "a JSON object", "count": "an integer >= 0", "time": "a finite number >= 0"}


def _is(value: object, kind) -> bool:
    if kind == "count":
        return finite(value) and isinstance(value, int) and value >= 0
    if kind == "time":
        return finite(value) and value >= 0
    return isinstance(value, kind)


def entry_problem(node_id: object, entry: object) -> str | None:
    """What is wrong with one entry of the document (``node_id`` its key), or None."""
    name = f"nodes[{json.dumps(node_id)[:64]}]"
    if not isinstance(node_id, str) or not NODE_ID.fullmatch(node_id):
        return f"has {name}: not a Ray node id (56 hex digits)"
    if not isinstance(entry, dict):
        return f"has {name} = {json.dumps(entry)[:40]}, not a JSON object"
    for key, (kind, required) in ENTRY_FIELDS.items():
        if entry.get(key) is None:
            if required:
                return f"has {name} without its {key!r}"
        elif not _is(entry[key], kind):
            return f"has {name}.{key} = {json.dumps(entry[key])[:40]}, not {KIND_NAMES[kind]}"
    if not 0 < len(entry["reason"]) <= MAX_REASON:
        return f"has {name}.reason of {len(entry['reason'])} characters, not 1-{MAX_REASON}"
    if entry.get("run") is not None and not RUN_KEY.fullmatch(entry["run"]):
        return f"has {name}.run = {json.dumps(entry['run'])[:40]}, not a run id"
    if entry.get("address") is not None and len(entry["address"]) > 255:
        return f"has {name}.address longer than 255 characters"
    if entry.get("evidence") is not None and len(json.dumps(entry["evidence"])) > MAX_EVIDENCE_BYTES:
        return f"has {name}.evidence over {MAX_EVIDENCE_BYTES} bytes"
    return None


def quarantine_problem(doc: object) -> str | None:
    """What is wrong with ``doc`` as the quarantine document, or None."""
    if not isinstance(doc, dict):
        return f"is not a JSON object (it holds {json.dumps(doc)[:40]})"
    nodes, limits = doc.get("nodes", {}), doc.get("limits", {})
    if not isinstance(nodes, dict) or not isinstance(limits, dict):
        return "has nodes or limits that is not a JSON object"
    if len(nodes) > MAX_NODES:
        return f"holds {len(nodes)} nodes, more than {MAX_NODES}"
    try:
        Limits(**_limits(limits))
    except ConfigError as e:
        return f"has limits that are not limits ({str(e).removeprefix('--')})"
    return next((p for n, e in nodes.items() if (p := entry_problem(n, e))), None)


def _limits(doc: dict) -> dict:
    return {k: doc[k] for k in ("max_fraction", "per_run") if k in doc}


def _where(store) -> str:
    return f"the quarantine document of {redact(store.url)}"


def read_quarantine(store) -> tuple[dict, object]:
    """The quarantine document of ``store`` ({"nodes": {}, "limits": {}} when absent), checked, and its version;
    CorruptQuarantine naming the store and the fix when it is not etrain's."""
    raw, version = store.read_versioned(None, QUARANTINE_DOC)
    if not raw:
        return {"nodes": {}, "limits": {}}, version
    try:
        doc = load_doc(raw, _where(store), quarantine_problem)
    except CorruptRunStore as e:
        raise CorruptQuarantine(f"{str(e).removesuffix('; repair or delete it')}; repair it, or release every node "
                                "with `etrain nodes release --all` (admin token)") from None
    entries = {n: {k: e.get(k) for k in ENTRY_FIELDS} for n, e in doc.get("nodes", {}).items()}
    return {"nodes": entries, "limits": _limits(doc.get("limits", {}))}, version


def quarantined_nodes(store) -> dict[str, dict]:
    """The quarantined nodes of ``store``: node id -> its entry (every field of :data:`ENTRY_FIELDS`, None
    where not known). CorruptQuarantine when the document is not etrain's."""
    return read_quarantine(store)[0]["nodes"]


def limits_of(store) -> Limits:
    return Limits(**read_quarantine(store)[0]["limits"])


def _change(store, change, attempts: int = 10):
    """Apply ``change(doc) -> (new doc or None: nothing to write, result)`` as a compare-and-swap on the checked
    document; again when another writer got in between. The result of the change that was written."""
    for _ in range(attempts):
        doc, version = read_quarantine(store)
        new, result = change(doc)
        if new is None or store.write_if(None, QUARANTINE_DOC, json.dumps(new, sort_keys=True), version):
            return result
    raise EtrainError(f"{_where(store)} kept changing under {attempts} writes; try again")


def bounded_evidence(evidence: Mapping | None) -> dict:
    """``evidence`` as an entry keeps it: JSON (what is not, as its text; non-finite numbers as text), at most
    :data:`MAX_EVIDENCE_BYTES`: keys in order while they fit, then ``"truncated": true``."""
    if evidence is None:
        return {}
    if not isinstance(evidence, Mapping):
        raise ValueError(f"evidence must be a dict, not {type(evidence).__name__}")

    def plain(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v if v is None or isinstance(v, str | int | float | bool) else str(v)

    full = plain(evidence)
    out: dict = {}
    for key in sorted(full):
        trial = {**out, key: full[key]}
        if len(json.dumps({**trial, "truncated": True})) > MAX_EVIDENCE_BYTES:
            out["truncated"] = True
            break
        out = trial
    return out


def quarantine_node(store, node_id: str, *, reason: str, run: str | None = None, rank: int | None = None,
                    step: int | None = None, evidence: Mapping | None = None, address: str | None = None,
                    nodes: int, now: float | None = None) -> bool:
    """Quarantine ``node_id`` in ``store`` for ``reason`` (found by ``run`` at ``rank`` and ``step``, with its
    ``evidence``), on a cluster of ``nodes`` nodes; whether it is new (a node quarantined already keeps its
    first entry). QuarantineRefused past the document's :class:`Limits`; ValueError for an argument that is
    not one; CorruptQuarantine for a document that is not etrain's (which it never overwrites)."""
    if not isinstance(node_id, str) or not NODE_ID.fullmatch(node_id):
        raise ValueError(f"node_id {node_id!r:.70} is not a Ray node id (56 hex digits)")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("reason must be a non-empty string (what the detector found)")
    if run is not None and not (isinstance(run, str) and RUN_KEY.fullmatch(run)):
        raise ValueError(f"run {run!r:.70} is not a run id")
    for name, value in (("rank", rank), ("step", step)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} {value!r:.40} must be an integer >= 0 or None")
    entry = {"reason": reason.strip()[:MAX_REASON], "since": time.time() if now is None else now, "run": run,
             "rank": rank, "step": step, "evidence": bounded_evidence(evidence),
             "address": address[:255] if isinstance(address, str) else None}

    def change(doc: dict):
        held = doc["nodes"]
        if node_id in held:
            return None, False
        limits = Limits(**doc["limits"])
        cap = limits.cap(nodes)
        if len(held) + 1 > cap:
            raise QuarantineRefused(
                f"node {node_id[:12]} not quarantined: {len(held)} of the cluster's {nodes} nodes are already, and "
                f"quarantines may take {cap} ({limits.max_fraction:g} of them); an admin looks at them "
                "(`etrain nodes`) and releases some (`etrain nodes release NODE`) or raises the bound "
                "(`etrain nodes limits --max-fraction F`)")
        mine = [n for n, e in held.items() if run is not None and e.get("run") == run]
        if len(mine) + 1 > limits.per_run:
            raise QuarantineRefused(
                f"node {node_id[:12]} not quarantined: run {run} holds {len(mine)} quarantined nodes already "
                f"({', '.join(n[:12] for n in mine)}), the most one run may (per_run {limits.per_run}); an admin "
                "releases them (`etrain nodes release NODE`) or raises the bound (`etrain nodes limits --per-run N`)")
        return {**doc, "nodes": {**held, node_id: entry}}, True

    return _change(store, change)


def resolve_node(given: str, ids: Iterable[str], what: str = "quarantined node") -> str:
    """The one of ``ids`` that ``given`` names: the id itself or a unique prefix of at least
    :data:`MIN_PREFIX` hex digits; UnknownNode naming the candidates otherwise."""
    ids = sorted(ids)
    text = str(given).strip().lower()
    if text in ids:
        return text
    found = [n for n in ids if len(text) >= MIN_PREFIX and n.startswith(text)] if re.fullmatch(r"[0-9a-f]+", text) \
        else []
    if len(found) == 1:
        return found[0]
    listed = ", ".join(n[:12] for n in (found or ids)[:8]) + (" ..." if len(found or ids) > 8 else "")
    if found:
        raise UnknownNode(f"{given!r:.70} names {len(found)} {what}s ({listed}); give more of the id")
    short = f" (give at least {MIN_PREFIX} hex digits)" if len(text) < MIN_PREFIX else ""
    raise UnknownNode(f"no {what} {given!r:.70}{short}; " + (f"they are: {listed}" if ids else "there is none"))


def release_node(store, node_id: str, token: str | None = None) -> tuple[str, dict]:
    """Release the quarantined node ``node_id`` (its id or a unique prefix) of ``store``: the admin token of
    ``store`` needed (``token``, $ETRAIN_ADMIN_TOKEN or the store's admin token file). Its full id and the
    entry released; UnknownNode (naming the quarantined ones) when it is not quarantined."""
    auth.authorize_admin(store, token, f"releasing node {str(node_id)[:12]!r}")

    def change(doc: dict):
        key = resolve_node(node_id, doc["nodes"])
        held = dict(doc["nodes"])
        entry = held.pop(key)
        return {**doc, "nodes": held}, (key, entry)

    return _change(store, change)


def release_all(store, token: str | None = None) -> int:
    """Release every quarantined node of ``store`` (admin token): how many were. A document that is not
    etrain's is replaced by an empty one (this is its repair; how many it held is then unknown: -1)."""
    auth.authorize_admin(store, token, "releasing every quarantined node")
    for _ in range(10):
        raw, version = store.read_versioned(None, QUARANTINE_DOC)
        try:
            doc = read_quarantine(store)[0] if raw else {"nodes": {}, "limits": {}}
            held, limits = len(doc["nodes"]), doc["limits"]
        except CorruptQuarantine:
            held, limits = -1, {}
        if store.write_if(None, QUARANTINE_DOC, json.dumps({"nodes": {}, "limits": limits}, sort_keys=True), version):
            return held
    raise EtrainError(f"{_where(store)} kept changing; try again")


def set_limits(store, token: str | None = None, *, max_fraction: float | None = None,
               per_run: int | None = None) -> Limits:
    """Change the bounds of ``store``'s quarantine (admin token); the bounds after. Nodes quarantined already
    stay, even beyond new bounds."""
    auth.authorize_admin(store, token, "the quarantine's bounds")

    def change(doc: dict):
        old = Limits(**doc["limits"])
        new = Limits(max_fraction=old.max_fraction if max_fraction is None else max_fraction,
                     per_run=old.per_run if per_run is None else per_run)
        return {**doc, "limits": new.as_doc()}, new

    return _change(store, change)


def quarantine_event(node_id: str, *, reason: str, rank: int | None = None, step: int | None = None,
                     refused: str | None = None) -> dict:
    """The run event of a quarantine its detector asked for: ``ctl.event(**quarantine_event(...))``. With
    ``refused`` (a QuarantineRefused's text) the node was not quarantined, and the event says why."""
    event = {"kind": "quarantine", "node": node_id, "reason": reason, "rank": rank, "step": step}
    return {**event, "refused": refused[:500]} if refused else event


# --- the set in Ray's GCS, where placement reads it --------------------------------------------


def _ray():
    """The ray module when this process has joined a cluster, else None (without importing Ray)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def publish(ids: Iterable[str]) -> bool:
    """Write the quarantined node ids to the connected cluster's GCS (nothing without Ray); whether written."""
    if _ray() is None:
        return False
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(KV_KEY, json.dumps(sorted(ids)).encode(), overwrite=True, namespace=KV_NAMESPACE)
    return True


def placement_exclusions() -> frozenset[str]:
    """The quarantined node ids the connected cluster's GCS holds (empty without Ray, or when what it holds
    is not a list of node ids: logged; the allocator writes it again at its next decision)."""
    if _ray() is None:
        return frozenset()
    from ray.experimental import internal_kv

    try:
        raw = internal_kv._internal_kv_get(KV_KEY, namespace=KV_NAMESPACE)
        ids = json.loads(raw) if raw else []
    except Exception as e:  # the GCS away for a moment, or bytes that are not JSON
        log.warning("the quarantined nodes could not be read from Ray's GCS: %s", e)
        return frozenset()
    if not isinstance(ids, list) or len(ids) > MAX_NODES or not all(isinstance(n, str) and NODE_ID.fullmatch(n)
                                                                    for n in ids):
        log.warning("the quarantined nodes in Ray's GCS are not a list of node ids; none are avoided until the "
                    "allocator writes them again")
        return frozenset()
    return frozenset(ids)


def avoiding(labels: Mapping[str, str], excluded: Iterable[str]) -> dict[str, str]:
    """Ray's label selector ``labels`` that also keeps off the ``excluded`` nodes (``ray.io/node-id`` =
    ``!in(...)``). A selector of its own on ``ray.io/node-id`` names its nodes itself: kept as it is, and said."""
    out, excluded = dict(labels), sorted(excluded)
    if not excluded:
        return out
    if NODE_ID_LABEL in out:
        log.warning("a placement selects on %s itself (%s): the quarantined nodes are not added to it",
                    NODE_ID_LABEL, out[NODE_ID_LABEL][:80])
        return out
    out[NODE_ID_LABEL] = f"!in({','.join(excluded)})"
    return out
