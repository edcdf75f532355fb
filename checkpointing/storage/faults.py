"""Storage fault injection: slow, failing and truncating requests, for tests and chaos runs.

    faults = StorageFaults(error_rate=0.3, delay_s=0.5, seed=1)
    storage = Storage(url, faults=faults)

Every storage request asks :meth:`StorageFaults.decide` first, and the
storage layer carries the decision out: sleep (a slow link), raise
:class:`TransientStorageError` (what a 503 or a reset connection looks like
to the retry layer), or store only part of the bytes while reporting success
(a truncated object). Faults
are drawn from a seeded generator, so a failing run can be replayed. Also
``fail_after``: once that many requests have passed, every request fails,
for "the storage went away mid-save".
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from .retry import TransientStorageError


@dataclass(frozen=True)
class Fault:
    delay_s: float = 0.0
    error: bool = False
    truncate: bool = False

    def raise_if_error(self, op: str, path: str) -> None:
        if self.error:
            raise TransientStorageError(f"injected storage fault on {op} {path}")


NO_FAULT = Fault()


@dataclass(kw_only=True)
class StorageFaults:
    error_rate: float = 0.0  # chance a request raises a transient error
    delay_s: float = 0.0  # added to every matching request
    truncate_rate: float = 0.0  # chance a write stores only half its bytes
    # also "cas": a local compare-and-swap writer held between its compare and its write, lock in hand
    ops: tuple[str, ...] = ("put", "get", "list", "delete")
    path_contains: str = ""  # only requests whose path contains this
    fail_after: int = -1  # >= 0: every request after this many fails
    seed: int = 0
    injected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._seen = 0

    def decide(self, op: str, path: str) -> Fault:
        """The faults for one request (none, for a request that does not match)."""
        if op not in self.ops or self.path_contains not in path:
            return NO_FAULT
        with self._lock:
            self._seen += 1
            down = 0 <= self.fail_after < self._seen
            err = down or self._rng.random() < self.error_rate
            trunc = not err and op == "put" and self._rng.random() < self.truncate_rate
            for kind, hit in (("error", err), ("truncate", trunc), ("delay", self.delay_s > 0)):
                if hit:
                    self.injected[kind] = self.injected.get(kind, 0) + 1
        return Fault(self.delay_s, err, trunc)

    @classmethod
    def from_dict(cls, raw: dict) -> StorageFaults:
        raw = dict(raw)
        if "ops" in raw:
            raw["ops"] = tuple(raw["ops"])
        return cls(**raw)
