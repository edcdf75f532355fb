"""The run store: a run's durable truth, reachable from any machine.

    store = open_store("etcd://10.0.0.5:2379/etrain")   # or file:///…/runs, s3://bucket/runs
    store.create_run(RunSpec(...))                     # refuses a run id in use
    store.update_spec(run_id, workers=4)               # compare-and-swap on the spec read; the controller reconciles
    store.update_spec(run_id, expected=7, workers=4)   # SpecConflict unless the spec is still at generation 7
    lease = store.acquire(run_id, controller_id)       # one controller per run
    store.put_status(run_id, {...}, lease)             # only the leader may
    store.bump_epoch(run_id, lease, expected=3)        # compare-and-swap: fencing token 4

*Desired* state (the spec: workers, suspended, stop) is written by the CLI;
*observed* state (status, events) by the run's controller, which holds a
leadership lease. Two backends:

* ``etcd://host:port[/prefix]``: etcd through its HTTP gateway (etcd3gw);
  ``etcds://`` the same over HTTPS (:mod:`orchestrator.store.etcd_client`).
  Leadership is a key bound to a lease; status writes and epoch bumps are
  transactions that compare the leader key first, so a stale or second
  controller is refused (:class:`FencedError`) and cannot change anything.
* the embedded ``storage`` backend, on any fsspec URL: JSON documents beside
  the checkpoints (``<root>/<run_id>/control/``). It has no transactions:
  meant for one controller per run (the default, single-job case). The
  epoch is the run's ``FENCE`` object, which checkpoint commits check.

Spec writes (and creating a run) are compare-and-swap on both: an etcd
transaction on the key's mod_revision; on storage, a conditional write
(:meth:`checkpointing.storage.base.Storage.write_if`: S3 If-Match on the ETag, a lock
file on local disks, best effort elsewhere), so a user's resize and another writer's
change never overwrite each other. Credentials for etcd come from the
environment (:mod:`orchestrator.store.etcd_client`). Who may change a run is
checked above the store (:mod:`orchestrator.service.auth`).

An unreachable store raises :class:`StoreUnavailable`, a clear error for the
CLI; the controller keeps training and writes again when the store is back.
Every run id is checked (:func:`checkpointing.names.validate_run_id`) before it
becomes part of a key or a path, and every document read back is checked
against the shape etrain writes: a document that is not valid JSON or has the
wrong shape raises :class:`CorruptRunStore`, naming its key or URL.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from abc import ABC, abstractmethod
from urllib.parse import urlsplit

from checkpointing.errors import EtrainError, FencedError
from checkpointing.layout import RunRoot, fence_blob, parse_fence
from checkpointing.names import redact, validate_run_id
from checkpointing.storage.retry import RetryPolicy
from checkpointing.storage.base import Storage

from . import etcd_client
from .documents import (  # noqa: F401  (HistoryRow, CorruptRunStore, ...: callers import them from here too)
    SPEC_TYPES,
    CorruptRunStore,
    HistoryRow,
    Lease,
    RunConflict,
    RunSpec,
    SpecConflict,
    StoreUnavailable,
    UnknownRun,
    event_problem,
    history_problem,
    is_run_id,
    key_text,
    leader_problem,
    load_doc,
    status_problem,
)
from ..phase import Phase

SPEC_ATTEMPTS = 20  # writes of one update_spec while other writers keep getting in between


class RunStore(ABC):
    """Spec, status, events, leadership and epoch of runs."""

    url: str

    # --- spec ------------------------------------------------------------------

    def create_run(self, spec: RunSpec) -> None:
        """Record a new run; an id already in the store is refused, saying how to continue it."""
        if self.write_if(spec.run_id, "spec", spec.to_json(), None):  # only if no spec is there
            return
        phase = Phase.of(self.get_status(spec.run_id))
        if phase == Phase.SUSPENDED:
            raise RunConflict(f"run {spec.run_id!r} is suspended; continue it with `etrain resume "
                              f"{spec.run_id}`, or choose another --run-id")
        if phase == Phase.FINISHED:
            raise RunConflict(f"run {spec.run_id!r} has already FINISHED; choose another --run-id")
        if phase in (Phase.FAILED, Phase.INTERRUPTED):
            raise RunConflict(f"run {spec.run_id!r} {'FAILED' if phase == Phase.FAILED else 'was interrupted'}; "
                              f"continue it from its last checkpoint with `etrain resume {spec.run_id}`, or "
                              "choose another --run-id")
        if self.leader_alive(spec.run_id):
            raise RunConflict(f"run {spec.run_id!r} already exists (phase {phase}) and its controller is "
                              f"alive; watch it with `etrain status {spec.run_id}`, or choose another --run-id")
        raise RunConflict(f"run {spec.run_id!r} was interrupted (phase {phase}, its controller is gone); "
                          f"continue it with `etrain resume {spec.run_id}`, or choose another --run-id")

    def check_resumable(self, run_id: str) -> None:
        """RunConflict unless the run can be continued: suspended, interrupted, or ended FAILED."""
        phase = Phase.of(self.get_status(run_id))
        if phase == Phase.FINISHED:
            raise RunConflict(f"run {run_id!r} has FINISHED; there is nothing to resume")
        if phase not in (Phase.SUSPENDED, Phase.FAILED, Phase.INTERRUPTED) and self.leader_alive(run_id):
            raise RunConflict(f"run {run_id!r} is {phase} and its controller is alive; "
                              f"`etrain suspend {run_id}` first, or `etrain resize {run_id} --workers N`")

    def get_spec(self, run_id: str) -> RunSpec:
        raw = self._read(run_id, "spec")
        if raw is None:
            raise UnknownRun(f"no run {run_id!r} in the store {redact(self.url)}; `etrain status` lists the runs")
        return RunSpec.from_json(raw, self._where(run_id, "spec"))

    def update_spec(self, run_id: str, expected: int | None = None, **changes) -> RunSpec:
        """Set fields of the run's spec, as a compare-and-swap on the spec read: a writer that changed it in
        between is never overwritten. ``expected``: the ``generation`` the caller read and decided on;
        SpecConflict if another writer changed the spec since (read it again and decide again). Without
        it, the changes (plain values) are applied to a fresh read each time another writer gets in between."""
        bad = [k for k in changes if k not in SPEC_TYPES]
        if bad:
            raise ValueError(f"RunSpec has no field {bad[0]!r}")
        for attempt in range(SPEC_ATTEMPTS):
            raw, version = self.read_versioned(run_id, "spec")
            if raw is None:
                raise UnknownRun(f"no run {run_id!r} in the store {redact(self.url)}")
            spec = RunSpec.from_json(raw, self._where(run_id, "spec"))
            if expected is not None and spec.generation != expected:
                raise SpecConflict(f"run {run_id!r}'s spec changed (generation {expected} -> {spec.generation}) "
                                   "since it was read; read it again")
            for k, v in changes.items():
                setattr(spec, k, v)
            spec.generation += 1
            spec.updated_unix = time.time()
            if self.write_if(run_id, "spec", spec.to_json(), version):
                return spec
            if expected is not None:
                raise SpecConflict(f"run {run_id!r}'s spec was changed by another writer meanwhile; read it again")
            time.sleep(random.uniform(0.0, 0.02 * (attempt + 1)))
        raise SpecConflict(f"run {run_id!r}'s spec kept changing under {SPEC_ATTEMPTS} attempts; try again")

    # --- status and events -------------------------------------------------------

    def get_status(self, run_id: str) -> dict | None:
        raw = self._read(run_id, "status")
        return load_doc(raw, self._where(run_id, "status"), status_problem) if raw else None

    def put_history(self, run_id: str, rows: list[HistoryRow]) -> None:
        """Every step the run trained (:class:`HistoryRow`), in order (a step redone after a restore
        appears again). The controller writes it."""
        self._write(run_id, "history", json.dumps(rows))

    def get_history(self, run_id: str) -> list[HistoryRow]:
        raw = self._read(run_id, "history")
        rows = load_doc(raw, self._where(run_id, "history"), history_problem) if raw else []
        return [HistoryRow.of(r) for r in rows]

    @abstractmethod
    def put_status(self, run_id: str, status: dict, lease: Lease) -> None:
        """Write the observed status; FencedError unless ``lease`` still leads the run."""

    def add_event(self, run_id: str, event: dict) -> None:
        event = {"time": time.time(), **event}
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:6]}"
        self._write(run_id, f"events/{name}", json.dumps(event, sort_keys=True))

    @abstractmethod
    def events(self, run_id: str) -> list[dict]:
        """Every event of the run, oldest first."""

    @abstractmethod
    def list_runs(self) -> list[str]:
        ...

    # --- leadership and epoch --------------------------------------------------------

    @abstractmethod
    def acquire(self, run_id: str, controller_id: str, ttl_s: float = 15.0) -> Lease:
        """Become the run's controller; RunConflict if a live controller leads it."""

    @abstractmethod
    def renew(self, lease: Lease) -> bool:
        """Keep leading; False if the lease was lost (another controller may lead now)."""

    @abstractmethod
    def release(self, lease: Lease) -> None:
        """End the lease (one without its backend handle: a controller known to be gone, if it still leads)."""

    @abstractmethod
    def leader_alive(self, run_id: str) -> bool:
        """Whether some controller holds a live lease on the run."""

    @abstractmethod
    def current_epoch(self, run_id: str) -> int:
        ...

    @abstractmethod
    def bump_epoch(self, run_id: str, lease: Lease, expected: int) -> int:
        """Compare-and-swap ``expected`` -> ``expected + 1``; FencedError if not the leader or stale."""

    # --- raw documents -------------------------------------------------------------

    @abstractmethod
    def _where(self, run_id: str, name: str) -> str:
        """The document's key or URL, for messages."""

    @abstractmethod
    def _read(self, run_id: str, name: str) -> str | None:
        ...

    @abstractmethod
    def _write(self, run_id: str, name: str, value: str) -> None:
        ...

    # Compare-and-swap. run_id None: a document of the store itself, not of a run (orchestrator.service.auth's admin).

    @abstractmethod
    def read_versioned(self, run_id: str | None, name: str) -> tuple[str | None, object]:
        """The document and its version (the backend's: etcd's mod_revision, an ETag, a digest); (None, None)."""

    @abstractmethod
    def write_if(self, run_id: str | None, name: str, value: str, version: object) -> bool:
        """Write the document only if its version is still ``version`` (None: only if it does not exist)."""


class StorageRunStore(RunStore):
    """JSON documents under ``<root>/<run_id>/control/`` on any fsspec URL, read bounded. One controller per run."""

    SPEC_CAP, HISTORY_CAP, DOC_CAP = 16 << 20, 64 << 20, 1 << 20  # bytes: a spec or the store's own, a history, other
    MAX_EVENTS, EVENTS_BYTES = 1000, 64 << 20  # events() reads the newest, this many bytes in all (docs/security.md)

    def __init__(self, url: str):
        self.url = url
        # Short bounds: the CLI must answer promptly when the storage is away.
        self.storage = Storage(url, retry=RetryPolicy(attempts=3, backoff_s=0.1, request_timeout_s=10,
                                                      deadline_s=15))

    def _rel(self, run_id: str | None, name: str) -> str:
        # A document of the store, not of a run (run_id None): at the root, under a name no run id can take.
        return f"{RunRoot(run_id).control}/{name}.json" if run_id is not None else f"_etrain-{name}.json"

    def _where(self, run_id, name):
        return redact(self.storage.join(self._rel(run_id, name)))

    def _guard(self, fn):
        from checkpointing.storage.base import DocumentRefused, LockHeld
        try:
            return fn()
        except FileNotFoundError:
            return None
        except (DocumentRefused, LockHeld) as e:  # a link, a FIFO, over its cap; another writer is in (reachable)
            raise (CorruptRunStore if isinstance(e, DocumentRefused) else StoreUnavailable)(
                f"run store {redact(self.url)}: {e}") from None
        except (EtrainError, TimeoutError) as e:
            raise StoreUnavailable(f"run store {redact(self.url)} is unreachable: {e}") from None

    def _cap(self, run_id: str | None, name: str) -> int:
        return {"spec": self.SPEC_CAP, "history": self.HISTORY_CAP}.get(name, self.DOC_CAP if run_id else self.SPEC_CAP)

    def _read(self, run_id, name):
        rel = self._rel(run_id, name)  # outside _guard: a bad run id is a ConfigError, not an outage
        data = self._guard(lambda: self.storage.get_bounded(rel, self._cap(run_id, name)))
        return data.decode(errors="replace") if data is not None else None

    def _write(self, run_id, name, value):
        rel = self._rel(run_id, name)
        self._guard(lambda: self.storage.write(rel, value.encode()))  # readers never see half of it

    def read_versioned(self, run_id, name):
        rel, limit = self._rel(run_id, name), self._cap(run_id, name)
        data, version = self._guard(lambda: self.storage.read_versioned(rel, limit=limit)) or (None, None)
        return (data.decode(errors="replace") if data is not None else None), version

    def write_if(self, run_id, name, value, version):
        rel = self._rel(run_id, name)
        return bool(self._guard(lambda: self.storage.write_if(rel, value.encode(), version)))

    def put_status(self, run_id, status, lease):
        holder = self._leader(run_id)
        if holder is not None and holder["id"] != lease.controller_id:
            raise FencedError(f"controller {lease.controller_id} no longer leads run {run_id!r} "
                              f"({holder['id']} does)")
        self._write(run_id, "status", json.dumps({**status, "updated_unix": time.time()}, sort_keys=True))

    def events(self, run_id):
        events = f"{RunRoot(run_id).control}/events"  # named by the time written; not a write's temporary file
        blobs = self._guard(lambda: self.storage.get_last_bounded(events, ".json", count=self.MAX_EVENTS,
                                                                   limit=self.DOC_CAP, total=self.EVENTS_BYTES))
        return [load_doc(b, redact(self.storage.join(p)), event_problem) for p, b in (blobs or {}).items()]

    def list_runs(self):
        names = self._guard(lambda: self.storage.list_dir("")) or {}
        return sorted(n for n, size in names.items() if size is None and is_run_id(n)  # with a spec, even one refused
                      and "spec.json" in (self._guard(lambda n=n: self.storage.list_dir(RunRoot(n).control)) or {}))

    def _leader(self, run_id) -> dict | None:
        raw = self._read(run_id, "leader")
        return load_doc(raw, self._where(run_id, "leader"), leader_problem) if raw else None

    def acquire(self, run_id, controller_id, ttl_s=15.0):
        holder = self._leader(run_id)
        if holder and holder["id"] != controller_id and holder["expires_unix"] > time.time():
            raise RunConflict(f"run {run_id!r} is led by controller {holder['id']} (lease valid for "
                              f"{holder['expires_unix'] - time.time():.0f} s more)")
        lease = Lease(run_id, controller_id, ttl_s)
        self.renew(lease)
        return lease

    def renew(self, lease):
        holder = self._leader(lease.run_id)
        if holder and holder["id"] != lease.controller_id and holder["expires_unix"] > time.time():
            return False
        self._write(lease.run_id, "leader", json.dumps({"id": lease.controller_id,
                                                         "expires_unix": time.time() + lease.ttl_s}))
        return True

    def release(self, lease):
        holder = self._leader(lease.run_id)
        if holder and holder["id"] == lease.controller_id:
            self._write(lease.run_id, "leader", json.dumps({"id": lease.controller_id, "expires_unix": 0}))

    def leader_alive(self, run_id):
        holder = self._leader(run_id)
        return bool(holder) and holder["expires_unix"] > time.time()

    def current_epoch(self, run_id):
        rel = RunRoot(run_id).fence
        # A local file being rewritten reads empty or half written for a moment: read again.
        for attempt in range(20):
            data = self._guard(lambda: self.storage.get_bounded(rel, self.DOC_CAP))
            if data is None:
                return 0
            try:
                return parse_fence(bytes(data))
            except ValueError as e:
                if attempt == 19:
                    raise CorruptRunStore(f"{redact(self.storage.join(rel))} is corrupt: {e}") from None
                time.sleep(0.01)

    def bump_epoch(self, run_id, lease, expected):
        holder = self._leader(run_id)
        if holder is None or holder["id"] != lease.controller_id:
            raise FencedError(f"controller {lease.controller_id} does not lead run {run_id!r}")
        now = self.current_epoch(run_id)
        if now != expected:
            raise FencedError(f"epoch of run {run_id!r} is {now}, not {expected}: another controller moved it")
        self._guard(lambda: self.storage.write(RunRoot(run_id).fence, fence_blob(expected + 1)))
        return expected + 1


class EtcdRunStore(RunStore):
    """etcd v3 through its HTTP gateway. Leadership by lease; fenced writes by transaction."""

    def __init__(self, host: str, port: int, prefix: str = "etrain", timeout_s: float = 5.0, tls: bool = False):
        self.url = f"{'etcds' if tls else 'etcd'}://{host}:{port}/{prefix}"
        self.prefix = prefix.strip("/")
        # user, password, CA and client certificate: from the environment; HTTPS for etcds:// (or as it says)
        self.client = etcd_client.connect(host, port, timeout_s, tls=tls)

    def _key(self, run_id: str | None, name: str) -> str:
        return f"/{self.prefix}/runs/{validate_run_id(run_id)}/{name}" if run_id is not None else \
            f"/{self.prefix}/{name}"  # a document of the store, not of a run

    def _where(self, run_id, name):
        return f"etcd key {self._key(run_id, name)} at {redact(self.url)}"

    def _call(self, fn):
        return etcd_client.call(self.url, fn)  # StoreUnavailable when etcd cannot be reached or refuses

    def _read(self, run_id, name):
        values = self._call(lambda: self.client.get(self._key(run_id, name)))
        return values[0].decode(errors="replace") if values else None

    def _write(self, run_id, name, value):
        self._call(lambda: self.client.put(self._key(run_id, name), value))

    def read_versioned(self, run_id, name):
        found = self._call(lambda: self.client.get(self._key(run_id, name), metadata=True))
        if not found:
            return None, None
        value, meta = found[0]
        return value.decode(errors="replace"), int(meta["mod_revision"])

    def write_if(self, run_id, name, value, version):
        from etcd3gw.utils import _encode

        key = _encode(self._key(run_id, name))
        compare = ({"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0} if version is None
                   else {"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": version})
        txn = {"compare": [compare], "success": [{"request_put": {"key": key, "value": _encode(value)}}],
               "failure": []}
        return bool(self._call(lambda: self.client.transaction(txn)).get("succeeded"))

    def _leader_txn(self, lease: Lease, requests_: list[dict]) -> bool:
        """Run ``requests_`` only if ``lease``'s controller still holds the leader key."""
        from etcd3gw.utils import _encode

        txn = {"compare": [{"key": _encode(self._key(lease.run_id, "leader")), "result": "EQUAL",
                            "target": "VALUE", "value": _encode(lease.controller_id)}],
               "success": requests_, "failure": []}
        result = self._call(lambda: self.client.transaction(txn))
        return bool(result.get("succeeded"))

    def put_status(self, run_id, status, lease):
        from etcd3gw.utils import _encode

        body = json.dumps({**status, "updated_unix": time.time()}, sort_keys=True)
        put = {"request_put": {"key": _encode(self._key(run_id, "status")), "value": _encode(body)}}
        if not self._leader_txn(lease, [put]):
            raise FencedError(f"controller {lease.controller_id} no longer leads run {run_id!r}; status not written")

    def events(self, run_id):
        items = self._call(lambda: self.client.get_prefix(self._key(run_id, "events/")))
        rows = sorted(((key_text(meta["key"]), value) for value, meta in items), key=lambda kv: kv[0])
        return [load_doc(value, f"etcd key {key} at {redact(self.url)}", event_problem) for key, value in rows]

    def list_runs(self):
        items = self._call(lambda: self.client.get_prefix(f"/{self.prefix}/runs/"))
        runs = set()
        for _, meta in items:
            parts = key_text(meta["key"]).split("/")
            if len(parts) >= 5 and parts[-1] == "spec" and is_run_id(parts[-2]):
                runs.add(parts[-2])
        return sorted(runs)

    def acquire(self, run_id, controller_id, ttl_s=15.0):
        key = self._key(run_id, "leader")  # checks run_id before a lease is granted
        lease_handle = self._call(lambda: self.client.lease(int(max(2, ttl_s))))
        if not self._call(lambda: self.client.create(key, controller_id, lease=lease_handle)):
            holder = self._read(run_id, "leader")
            self._call(lease_handle.revoke)
            raise RunConflict(f"run {run_id!r} is led by controller {holder} (its etcd lease is alive)")
        return Lease(run_id, controller_id, ttl_s, lease_handle)

    def renew(self, lease):
        validate_run_id(lease.run_id)
        ttl = self._call(lease.handle.refresh)
        if ttl <= 0:
            return False
        return self._read(lease.run_id, "leader") == lease.controller_id

    def release(self, lease):
        if lease.handle is not None:
            return self._call(lease.handle.revoke)
        from etcd3gw.utils import _encode  # a controller known to be gone (no handle): its key, if it still leads

        key = _encode(self._key(lease.run_id, "leader"))
        self._call(lambda: self.client.transaction({"compare": [{"key": key, "result": "EQUAL", "target": "VALUE",
                                                                 "value": _encode(lease.controller_id)}],
                                                    "success": [{"request_delete_range": {"key": key}}],
                                                    "failure": []}))

    def leader_alive(self, run_id):
        return self._read(run_id, "leader") is not None  # the key dies with its lease

    def current_epoch(self, run_id):
        raw = self._read(run_id, "epoch")
        if not raw:
            return 0
        if not raw.isascii() or not raw.isdigit():
            raise CorruptRunStore(f"{self._where(run_id, 'epoch')} holds {raw[:40]!r}, not an epoch (an integer "
                                  ">= 0); repair or delete it")
        return int(raw)

    def bump_epoch(self, run_id, lease, expected):
        from etcd3gw.utils import _encode

        key = _encode(self._key(run_id, "epoch"))
        compare_epoch = ({"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0} if expected == 0
                         else {"key": key, "result": "EQUAL", "target": "VALUE", "value": _encode(str(expected))})
        txn = {"compare": [{"key": _encode(self._key(run_id, "leader")), "result": "EQUAL", "target": "VALUE",
                            "value": _encode(lease.controller_id)}, compare_epoch],
               "success": [{"request_put": {"key": key, "value": _encode(str(expected + 1))}}], "failure": []}
        result = self._call(lambda: self.client.transaction(txn))
        if not result.get("succeeded"):
            raise FencedError(f"controller {lease.controller_id} cannot move run {run_id!r} past epoch {expected}: "
                              f"it no longer leads, or another controller moved the epoch")
        return expected + 1


def open_store(url: str) -> RunStore:
    """``etcd://host:port[/prefix]``, ``etcds://`` for etcd over HTTPS, or any fsspec URL (the embedded
    storage backend)."""
    if url.startswith(etcd_client.SCHEMES):
        parts = urlsplit(url)
        if not parts.hostname:
            raise EtrainError(f"--store {redact(url)!r}: use {parts.scheme}://host:port[/prefix]")
        return EtcdRunStore(parts.hostname, parts.port or 2379, parts.path.strip("/") or "etrain",
                            tls=parts.scheme == "etcds")
    return StorageRunStore(url)
