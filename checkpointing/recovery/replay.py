"""A snapshot's files laid out again by the last layout, without DCP: what the memory tier does each step
while its layout holds.

    replay = Replay.of(writer, paths)          # after a write of host tensors in place (None otherwise)
    files = replay.files(state_dict)           # [(name, byte views)], or None: the layout changed
    crc = storage.put_parts(rel, parts)        # the copy: each file joined into bytes, checksummed
    placed = place(replay, region, host, layout)   # the host copy's buffers where these files put each tensor
    patches = placed.replay.patches(state_dict)      # once laid out there: only the non-tensor items again

The durable writer (:class:`checkpointing.dcp.writer.EtrainWriter`) lays a file out as byte views: a tensor's
envelope, its bytes in place, padding; a non-tensor item serialized. When every tensor of a write was a
host tensor read in place (the memory tier's host copy: buffers kept from one copy to the next, refilled in
place), the views of a later state of the same layout are the same views: only the non-tensor items are
serialized again, and each must keep its size. A replay checks that each tensor item of the new state lies
in the very memory the views read (the host copy's buffers); any difference and the caller lays out anew.

:func:`place` goes one step further: the host copy's buffers are placed in a memory file
(:class:`checkpointing.recovery.local_copy.Region`) exactly where these files, written there back to back,
put each tensor's bytes. A snapshot whose host copy went there writes only the envelopes, padding and
non-tensor items: the tensors' bytes are already in place, and the region refuses any write over them.
Once a placed replay laid its files out in a region (and nothing else wrote there since), the next snapshot
there writes only its non-tensor items, serialized again (:class:`Patched`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from ..dcp.writer import PlannedItems, host_bytes, lookup
from ..manifest import FileEntry


class Replay:
    """The files of one write, to lay out again for a state of the same layout (see the module docstring)."""

    def __init__(self, staged: list, paths: dict):
        self.staged = [(f.path, list(f.parts), list(f.slots)) for f in staged]
        self.paths = paths
        self._starts: list[list[int]] | None = None

    def patches(self, state_dict: dict) -> list[tuple[str, int, list]] | None:
        """For a state known to lie where this replay's tensor items are read (a host copy into its placed
        buffers) and files already laid out by it: per file ``(name, size, [(offset in the file, bytes)])``,
        the non-tensor items serialized again; None when one changed size."""
        items = PlannedItems(self.paths, state_dict)
        out = []
        for (name, parts, slots), offsets in zip(self.staged, self._offsets()):
            patch = []
            for pos, item, data in slots:
                if item.type == WriteItemType.BYTE_IO:
                    raw = items.resolve_data(item).getvalue()
                    if len(raw) != len(data):
                        return None
                    patch.append((offsets[pos], raw))
            out.append((name, offsets[-1], patch))
        return out

    def _offsets(self) -> list[list[int]]:
        """Per file, where each part starts in it, and its size last (computed once)."""
        if self._starts is None:
            self._starts = [list(itertools.accumulate((len(p) for p in parts), initial=0))
                            for _, parts, _ in self.staged]
        return self._starts

    def rebased(self, tensors: dict[int, torch.Tensor]) -> Replay | None:
        """This replay with each tensor item read from ``tensors[its data_ptr]`` (same shape and dtype, other
        memory) instead; None when one is missing."""
        out = Replay([], self.paths)
        for name, parts, slots in self.staged:
            parts, moved = list(parts), []
            for pos, item, data in slots:
                if pos is not None and item.type != WriteItemType.BYTE_IO:
                    data = tensors.get(data.data_ptr())
                    view = host_bytes(data) if data is not None else None
                    if view is None or len(view) != len(parts[pos]):
                        return None
                    parts[pos] = view
                moved.append((pos, item, data))
            out.staged.append((name, parts, moved))
        return out

    @classmethod
    def of(cls, writer, paths: dict | None) -> Replay | None:
        """The replay of ``writer``'s files (laid out, not yet released), or None when some tensor was
        copied to host by the writer (its views would hold that copy, not the next state) or the items'
        paths in the state are not known."""
        if paths is None or writer.staged_bytes or not writer.staged:
            return None
        return cls(writer.staged, paths)

    def files(self, state_dict: dict) -> list[tuple[str, list]] | None:
        """``[(file name, byte views)]`` of ``state_dict`` (the views read its tensors in place), or None
        when its layout is not this replay's (a tensor in other memory, an item of another size)."""
        items = PlannedItems(self.paths, state_dict)
        out = []
        for name, parts, slots in self.staged:
            parts = list(parts)
            for pos, item, data in slots:
                try:
                    if item.type == WriteItemType.BYTE_IO:
                        new = items.resolve_data(item)
                    else:  # what resolve_data gives, without its per-item import
                        new = lookup(state_dict, self.paths[item.index.fqn])
                        new = new._local_tensor if isinstance(new, DTensor) else new
                except (KeyError, IndexError, TypeError):
                    return None
                if item.type == WriteItemType.BYTE_IO:
                    raw = new.getvalue()
                    if len(raw) != len(data):
                        return None
                    parts[pos] = memoryview(raw)
                elif pos is not None and not _same_memory(new, data):
                    return None
            out.append((name, parts))
        return out


class Replayed:
    """Files laid out by a :class:`Replay`, copied into a storage as a writer's files are (``upload``)."""

    def __init__(self, storage, rel: str, files: list, replay: Replay | None = None):
        self.storage, self.rel, self.files, self.replay = storage, rel, files, replay

    def upload(self) -> list[FileEntry]:
        return [FileEntry(name, sum(len(p) for p in parts),
                          self.storage.put_parts(f"{self.rel}/{name}", parts, exclusive=True))
                for name, parts in self.files]

    def release(self) -> None:
        self.files = []


class Patched(Replayed):
    """Files already laid out in a memory file by a placed :class:`Replay` (``Region.laid_out``), the state
    copied into its tensors' bytes: only the non-tensor items are written again (:meth:`Replay.patches`)."""

    def upload(self) -> list[FileEntry]:
        return [FileEntry(name, size, self.storage.put_patched(f"{self.rel}/{name}", size, patch))
                for name, size, patch in self.files]


@dataclass
class Placed:
    """The host copy's buffers placed in a region (:func:`place`)."""

    placement: object  # checkpointing.host_copy.Placement
    replay: Replay  # the files, reading the placed buffers
    ranges: list  # (start, end) in the region of every placed tensor's bytes, sorted
    base: Replay  # the replay they were placed by (of the host copy's own buffers)
    layout: str  # its layout's fingerprint


def place(replay: Replay, region, host, layout: str) -> Placed | None:
    """The host copy's (``host``: :class:`checkpointing.host_copy.HostCopy`) buffers of the layout ``replay``
    read placed in ``region`` where ``replay``'s files, written there back to back from its reserve (as
    :meth:`Replayed.upload` writes them), put each tensor's bytes (a buffer this rank's files do not hold stays
    where it is); None when the files do not fit or read a tensor that is not one of the buffers."""
    starts: dict[int, int] = {}
    pos = region.reserve
    for _, parts, slots in replay.staged:
        at = []
        for part in parts:
            at.append(pos)
            pos += len(part)
        for i, item, data in slots:
            if i is not None and item.type != WriteItemType.BYTE_IO:
                starts[data.data_ptr()] = at[i]
    if pos > region.reserve + region.capacity:
        return None

    def where(buf: torch.Tensor) -> torch.Tensor:
        start = starts.get(buf.data_ptr()) if buf.numel() else None
        if start is None:  # not in this rank's files (DCP gave a replicated tensor to another rank): kept
            return buf
        return torch.frombuffer(region.view, dtype=buf.dtype, count=buf.numel(), offset=start).view(buf.shape)

    placement = host.place(where)
    if placement is None:
        return None
    moved = {b.data_ptr(): t for b, t in zip(placement.index.buffers, placement.buffers) if t is not b}
    rebased = replay.rebased(moved)
    if rebased is None:
        return None
    base = region.address()
    ranges = sorted((t.data_ptr() - base, t.data_ptr() - base + t.numel() * t.element_size()) for t in moved.values())
    return Placed(placement, rebased, ranges, replay, layout)


def _same_memory(new, old) -> bool:
    """Whether tensor ``new`` is ``old``'s bytes: the same host memory, dtype, shape and strides."""
    return (new.data_ptr() == old.data_ptr() and new.device.type == "cpu" and new.dtype == old.dtype
            and new.shape == old.shape and new.stride() == old.stride() and not new.is_conj() and not new.is_neg())
