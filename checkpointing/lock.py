"""The run's writer lock: exactly one process writes a run's checkpoints at a time.

    lock = WriterLock(storage, "tiny", epoch=0)     # owner: who may take over by epoch (see below)
    lock.acquire()          # WriterLockHeld naming the holder if another live writer has the run
    ...                     # a thread renews it every ttl_s / 3
    lock.check()            # before each commit: FencedError once another writer took it over
    lock.release()

The lock lives beside the checkpoints, in ``<root>/<run_id>/LOCK/``, as
numbered generations ``000000000001.json``, ``000000000002.json``, ...; the
newest one holds the run. A generation is created exclusively (``O_EXCL``, an
S3 conditional put), so of two writers racing for the next generation exactly
one wins. The holder rewrites its own generation to renew it; nobody else
ever writes it. A generation is taken over (by creating the next one) when

- its holder's lease expired (``expires_unix`` passed: the holder is gone
  or cut off), or its holder ran on this host and its process is gone;
- or the taker belongs to the same owner (the same run store, or the same
  torchrun job) with a newer epoch: the orchestrator formed a new group, or
  torchrun restarted its workers, and the old holder is fenced off.

Anything else is a second writer of the same run: it is refused with a
message naming the holder. A holder that finds a newer generation than its
own has lost the run: ``check()`` raises and its saves fail loudly.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from .errors import CheckpointError, FencedError
from .layout import RunRoot
from .storage.retry import describe
from .storage.base import Storage

log = logging.getLogger("etrain")

class WriterLockHeld(CheckpointError):
    """Another live writer holds the run."""


@dataclass(frozen=True)
class Holder:
    holder_id: str  # unique per acquisition
    host: str
    pid: int
    owner: str  # takeover by epoch only within one owner
    epoch: int
    acquired_unix: float
    expires_unix: float

    def describe(self, now: float) -> str:
        return (f"pid {self.pid} on {self.host} (epoch {self.epoch}, owner {self.owner or 'standalone'}), "
                f"lease expires in {max(0.0, self.expires_unix - now):.0f} s")

    @classmethod
    def parse(cls, blob: bytes, where: str) -> Holder:
        try:
            d = json.loads(blob)
            h = cls(**d)
            if not (isinstance(h.holder_id, str) and isinstance(h.host, str) and isinstance(h.owner, str)
                    and all(isinstance(getattr(h, k), int) and not isinstance(getattr(h, k), bool)
                            for k in ("pid", "epoch"))
                    and all(isinstance(getattr(h, k), (int, float)) for k in ("acquired_unix", "expires_unix"))):
                raise TypeError("a field has the wrong type")
            return h
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"the writer lock {where} is unreadable ({str(e)[:80]}); if no writer is "
                                  f"running, delete it") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _gen_name(gen: int) -> str:
    return f"{gen:012d}.json"


def _parse_gen(name: str) -> int | None:
    stem = name.removesuffix(".json")
    return int(stem) if name.endswith(".json") and len(stem) == 12 and stem.isdigit() else None


class WriterLock:
    def __init__(self, storage: Storage, run_id: str, *, epoch: int = 0, owner: str = "", ttl_s: float = 30.0):
        self.storage = storage
        self.run_id = run_id
        self.dir = RunRoot(run_id).lock_dir
        self.epoch = epoch
        self.owner = owner
        self.ttl_s = ttl_s
        self.holder_id = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.gen: int | None = None
        self.lost: str = ""  # why the lock was lost, once it was
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _me(self, acquired: float) -> Holder:
        now = time.time()
        return Holder(self.holder_id, self.host, os.getpid(), self.owner, self.epoch, acquired, now + self.ttl_s)

    def _newest(self) -> tuple[int, Holder | None]:
        gens = [g for g in (_parse_gen(n) for n in self.storage.list_dir(self.dir)) if g is not None]
        if not gens:
            return 0, None
        gen = max(gens)
        rel = f"{self.dir}/{_gen_name(gen)}"
        try:
            return gen, Holder.parse(self.storage.get(rel), f"{self.storage.join(rel)}")
        except FileNotFoundError:  # released between the listing and the read
            return gen, None

    def _may_take_over(self, h: Holder, now: float) -> bool:
        if h.holder_id == self.holder_id or h.expires_unix < now:
            return True
        if h.host == self.host and not _pid_alive(h.pid):
            return True
        return bool(self.owner) and h.owner == self.owner and h.epoch < self.epoch

    def acquire(self) -> None:
        """Take the run (WriterLockHeld if another live writer holds it), then keep it renewed."""
        for _ in range(5):
            gen, holder = self._newest()
            now = time.time()
            if holder is not None and not self._may_take_over(holder, now):
                raise WriterLockHeld(
                    f"run {self.run_id!r} is being written by another process: {holder.describe(now)} "
                    f"({self.storage.join(self.dir, _gen_name(gen))}). Stop that run first; if it died on "
                    f"another host, its lock expires by itself")
            try:
                self.storage.put(f"{self.dir}/{_gen_name(gen + 1)}", json.dumps(asdict(self._me(now))).encode(),
                                 exclusive=True)
            except FileExistsError:  # another writer took that generation first: look again
                continue
            self.gen = gen + 1
            if holder is not None and holder.holder_id != self.holder_id:
                log.info("writer lock of run %r taken over from %s", self.run_id, holder.describe(now))
            self._forget_older(gen)
            self._thread = threading.Thread(target=self._renew_loop, args=(now,), name="etrain-lock", daemon=True)
            self._thread.start()
            return
        raise WriterLockHeld(f"run {self.run_id!r}: could not take the writer lock (other writers kept racing)")

    def _forget_older(self, below_or_at: int) -> None:
        for name in self.storage.list_dir(self.dir):
            g = _parse_gen(name)
            if g is not None and g <= below_or_at:
                try:
                    self.storage.delete_tree(f"{self.dir}/{name}")
                except Exception as e:  # tidying only
                    log.debug("could not remove the old lock generation %s: %s", name, describe(e))

    def _renew_loop(self, acquired: float) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                gen, holder = self._newest()
                if gen != self.gen or holder is None or holder.holder_id != self.holder_id:
                    now = time.time()
                    self.lost = (f"the writer lock of run {self.run_id!r} was taken over by "
                                 f"{holder.describe(now) if holder else 'another writer'}")
                    if self.owner and holder is not None and holder.owner == self.owner and \
                            holder.epoch > self.epoch:
                        log.debug("%s (a newer epoch)", self.lost)
                    else:
                        log.error("%s: this process no longer commits checkpoints", self.lost)
                    return
                self.storage.put(f"{self.dir}/{_gen_name(self.gen)}", json.dumps(asdict(self._me(acquired))).encode())
            except Exception as e:  # an outage: try again at the next renewal; the lease may lapse
                log.warning("could not renew the writer lock of run %r: %s", self.run_id, describe(e))

    def check(self) -> None:
        """FencedError once the lock is lost (taken over, or its lease lapsed) or was never taken."""
        if self.gen is None:
            raise FencedError(f"run {self.run_id!r}: this process does not hold the writer lock")
        if self.lost:
            raise FencedError(self.lost)
        gen, holder = self._newest()
        if gen != self.gen or holder is None or holder.holder_id != self.holder_id:
            self.lost = f"the writer lock of run {self.run_id!r} was taken over by another writer"
            raise FencedError(self.lost)

    def release(self) -> None:
        """Stop renewing; remove our generation if it is still the newest (the next writer starts at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.gen is None:
            return
        try:
            gen, holder = self._newest()
            if gen == self.gen and holder is not None and holder.holder_id == self.holder_id:
                self.storage.delete_tree(f"{self.dir}/{_gen_name(self.gen)}")
        except Exception as e:
            log.warning("could not release the writer lock of run %r (it expires by itself): %s",
                        self.run_id, describe(e))
        self.gen = None
