"""How a rank's held snapshot moves between processes: one interface, two implementations.

    transport.send(snapshot)        # push: give this rank's snapshot to the ranks that keep its copies;
                                    # the copies this rank keeps, by source rank (checked)
    transport.fetch(key, name)      # pull: one file of snapshot ``key`` from the holder that has it
    transport.header(key)           # pull: that snapshot without its files (table, metadata, trainer state)

- :class:`PeerCopyTransport` (here): the copies to peers while training, over the tier's own gloo
  group (:mod:`checkpointing.recovery.peer_copy`). It pushes: every rank of the group sends and
  receives at once, from the tier's background thread; nothing is fetched from it later (its group
  ends with the group that trained).
- ``orchestrator.workers.tier_fetch.RayFetchTransport``: a restore's files, fetched from the live worker
  that holds each (any group's, a worker new to the step included) by a Ray actor call. It pulls;
  nothing is pushed through it (a holder answers ``memory_file`` and ``memory_header``).

Each carries its direction and refuses the other with :class:`TransportError` naming the transport
that does. What comes through either is checked against the step's agreed table before use (a copy
on receipt, a fetched file by the durable reader on restore).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from ..errors import CheckpointError
from .snapshot import MemorySnapshot


class TransportError(CheckpointError):
    """A transport asked to move a snapshot in the direction it does not carry."""


@runtime_checkable
class SnapshotTransport(Protocol):
    """Moves a rank's held snapshot: pushed to the ranks that keep its copies, or pulled from a holder."""

    def send(self, snapshot: MemorySnapshot) -> dict[int, MemorySnapshot]:
        """Give ``snapshot`` (this rank's, agreed) to the ranks that keep copies of it and take the copies
        this rank keeps: ``{source rank: its snapshot}``, each checked. Collective where the transport is."""
        ...

    def fetch(self, key: Hashable, name: str) -> bytes:
        """One file of snapshot ``key`` from the holder that has it."""
        ...

    def header(self, key: Hashable) -> MemorySnapshot:
        """Snapshot ``key`` without its files (its agreed table, DCP metadata and trainer state), checked."""
        ...


class PeerCopyTransport:
    """The copies to peers over a gloo group of the tier's own (:func:`peer_copy.replicate`)."""

    def __init__(self, group, peers: Mapping[int, Sequence[int]], hosts: Sequence[str] | None = None, arena=None):
        self.group, self.peers, self.hosts, self.arena = group, peers, hosts, arena
        self._shared: list = []  # memory files made for this snapshot's peers on this host (closed by agree)

    def send(self, snapshot: MemorySnapshot) -> dict[int, MemorySnapshot]:
        """Over the group, or to a peer on this host (``hosts``: every rank's host key) by shared memory
        (:mod:`.local_copy`): the memory file the snapshot's files were written into (``arena``), its
        header and metadata put just before them, else a memory file made for it."""
        from .peer_copy import replicate

        return replicate(snapshot, self.group, self.peers, self.hosts, self._share)

    def _share(self, snapshot: MemorySnapshot, wire: list) -> tuple[int, int, int]:
        from .local_copy import publish

        region = self.arena.region_of(snapshot.step) if self.arena is not None else None
        if region is not None and region.fd >= 0:
            placed = region.publish(wire[0], wire[1:])
            if placed is not None:
                return region.fd, *placed
            self.arena.grow_reserve(len(wire[0]))
        shared = publish(wire)
        self._shared.append(shared)
        return shared.fd, 0, shared.capacity

    def agree(self, why: str) -> dict[int, str]:
        """After :meth:`send`, every rank's reason its copies failed, by rank ({} when all succeeded). Every
        peer has then mapped what it copies from this rank's shared memory: this rank lets go of it."""
        from .peer_copy import failed_copies

        try:
            return failed_copies(why, self.group)
        finally:
            for shared in self._shared:
                shared.close()
            self._shared.clear()

    def fetch(self, key: Hashable, name: str) -> bytes:
        raise TransportError("copies to peers are pushed while training; a restore fetches a file from its "
                             "holder through orchestrator.workers.tier_fetch.RayFetchTransport")

    def header(self, key: Hashable) -> MemorySnapshot:
        return MemorySnapshot.from_bytes(self.fetch(key, ""))
