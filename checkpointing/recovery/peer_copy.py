"""Copies of each rank's memory snapshot in its peers' host memory.

    peers = {r: replica_peers(r, world, replicas=1, node_ids=nodes) for r in range(world)}
    received = replicate(snapshot, replica_group, peers)   # {source rank: MemorySnapshot}, each checked

Every rank calls :func:`replicate` with its own agreed snapshot of the same step:
it sends its snapshot's bytes (:meth:`MemorySnapshot.to_bytes`, in pieces: the
header, then each file raw as it is held) to each of its peers and receives the
snapshots of the ranks whose peer it is, with point-to-point sends of byte tensors (sizes first, then the bytes, all
non-blocking so no pair waits on another).

Why this transport: a process group of its own (a gloo group made with
``dist.new_group(backend="gloo")`` beside the training group), used only from
the tier's background thread, so the copies never queue behind or in between
training collectives, and never touch the accelerator. Ray's object store was
the other choice, but a Ray object fate-shares with its owner: when the rank
that put it dies, the object goes with it, so the peer would have to fetch and
hold its own copy anyway, which is what a send to the peer does in one hop.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..dcp.format import CorruptCheckpointError
from .local_copy import open_copy
from .snapshot import MemorySnapshot


def senders_to(rank: int, peers: Mapping[int, Sequence[int]]) -> list[int]:
    """The ranks whose copies ``rank`` holds."""
    return sorted(src for src, dsts in peers.items() if rank in dsts and src != rank)


def replicate(snapshot: MemorySnapshot, group, peers: Mapping[int, Sequence[int]], hosts: Sequence[str] | None = None,
              share: Callable | None = None) -> dict[int, MemorySnapshot]:
    """Send this rank's ``snapshot`` to ``peers[rank]`` and receive the snapshots sent to it, over ``group``
    (collective over the ranks that send or receive; every rank passes the same ``peers``). A size a peer
    announces is bounded by what its snapshot of this step can take (the agreed table) before anything is
    allocated; each received snapshot is checked (:meth:`MemorySnapshot.from_bytes`) and must be the
    sender's of this step, with this rank's table (:meth:`MemorySnapshot.check_same_step`). A bad one
    raises CorruptCheckpointError naming its source.

    ``hosts``: every group rank's :func:`.local_copy.host_key` (the same on every rank). With ``share``, a
    peer with this rank's key maps the snapshot from shared memory instead (:mod:`.local_copy`):
    ``share(snapshot, wire_parts)`` gives (memory file, offset, size) of this rank's wire form, which the
    caller keeps open until every peer mapped it (the copies' agreement)."""
    me = dist.get_rank(group)
    wire = snapshot.wire_parts()
    parts = [_as_tensor(p) for p in wire if len(p)]
    sources = senders_to(me, peers)
    dsts = [d for d in peers.get(me, ()) if d != me]
    local = {r for r, key in enumerate(hosts or ()) if key and key == hosts[me]} - {me} if share else set()
    fd, offset = share(snapshot, wire)[:2] if any(d in local for d in dsts) else (-1, 0)
    # Each sender announces its copy's size (and, to a peer on its host, the memory file that holds it).
    size = torch.tensor([sum(p.numel() for p in parts), os.getpid(), fd, offset], dtype=torch.int64)
    sizes = {s: torch.zeros(4, dtype=torch.int64) for s in sources}
    _exchange([(size, d) for d in dsts], list(sizes.items()), group)
    for s, n in sizes.items():
        bound = snapshot.wire_bound(s)
        if not 0 < int(n[0]) <= bound:
            raise CorruptCheckpointError(f"rank {s} announced a copy of {int(n[0])} bytes; its snapshot of step "
                                         f"{snapshot.step} takes at most {bound}: nothing allocated, none kept")
    # Received straight into the buffers the copies keep (their files are views of them), in the pieces the
    # sender sends (its header, then its files by the agreed table's sizes: raw, never joined on its side).
    bufs: dict[int, bytearray | memoryview] = {s: bytearray(int(n[0])) for s, n in sizes.items() if s not in local}
    recvs = []
    for s, buf in bufs.items():
        files = snapshot.own_sizes(s)
        cuts = [len(buf) - sum(files), *files]
        if cuts[0] <= 0:
            raise CorruptCheckpointError(f"rank {s} announced a copy of {len(buf)} bytes, less than its files of "
                                         f"step {snapshot.step}: nothing kept")
        whole, pos = _as_tensor(buf), 0
        for n in cuts:
            if n:
                recvs.append((s, whole[pos : pos + n]))
            pos += n
    _exchange([(p, d) for d in dsts if d not in local for p in parts], recvs, group)
    mapped = {s: _map(s, n.tolist(), snapshot.step) for s, n in sizes.items() if s in local}
    out = {}
    for s, buf in {**bufs, **mapped}.items():
        where = f"the copy of rank {s}'s snapshot"
        snap = MemorySnapshot.from_bytes(buf, where, verify=s not in mapped)  # mapped: checked on restore
        if snap.rank != s:
            raise CorruptCheckpointError(f"{where} is rank {snap.rank}'s")
        snapshot.check_same_step(snap, where)
        out[s] = snap
    return out


def _map(source: int, announced: list[int], step: int) -> memoryview:
    """The copy of rank ``source`` on this host: its memory file, mapped (:func:`.local_copy.open_copy`)."""
    size, pid, fd, offset = announced
    where = f"the copy of rank {source}'s snapshot of step {step}"
    if fd < 0:
        raise CorruptCheckpointError(f"{where}: rank {source} shares this host but published no memory file")
    try:
        return open_copy(pid, fd, size, where, offset)
    except OSError as e:
        raise OSError(f"shared memory: {where} could not be opened ({e}); copies go over the network from the "
                      "next snapshot on") from None


def failed_copies(why: str, group) -> dict[int, str]:
    """The agreement on a step's copies (collective over ``group``): every rank's reason its copies failed,
    by rank ({} when all succeeded). One all-reduce of a flag; the reasons are gathered only on a failure."""
    failed = torch.tensor([1 if why else 0], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return {}
    votes = [None] * dist.get_world_size(group)
    dist.all_gather_object(votes, why, group=group)
    return {r: w for r, w in enumerate(votes) if w}


def _as_tensor(buf: bytes | bytearray) -> torch.Tensor:
    """A uint8 tensor over ``buf``'s memory (a read-only ``bytes`` is only ever sent from)."""
    if not buf:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bytes are read-only: gloo only reads what it sends
        return torch.frombuffer(buf, dtype=torch.uint8)


def _exchange(sends: list, recvs: list, group) -> None:
    """Post every receive and send at once, then wait for all (peers' ranks are group ranks)."""
    ops = [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, src), group) for src, t in recvs]
    ops += [dist.P2POp(dist.isend, t, dist.get_global_rank(group, dst), group) for t, dst in sends]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()
