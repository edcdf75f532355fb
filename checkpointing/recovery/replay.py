"""A snapshot's files laid out again by the last layout, without DCP: what the memory tier does each step
while its layout holds.

    replay = Replay.of(writer, paths)          # after a write of host tensors in place (None otherwise)
    files = replay.files(state_dict)           # [(name, byte views)], or None: the layout changed
    crc = storage.put_parts(rel, parts)        # the copy: each file joined into bytes, checksummed

The durable writer (:class:`checkpointing.dcp_io.EtrainWriter`) lays a file out as byte views: a tensor's
envelope, its bytes in place, padding; a non-tensor item serialized. When every tensor of a write was a
host tensor read in place (the memory tier's host copy: buffers kept from one copy to the next, refilled in
place), the views of a later state of the same layout are the same views: only the non-tensor items are
serialized again, and each must keep its size. A replay checks that each tensor item of the new state lies
in the very memory the views read (the host copy's buffers); any difference and the caller lays out anew.
"""

from __future__ import annotations

from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from ..dcp_io import PlannedItems, lookup
from ..manifest import FileEntry


class Replay:
    """The files of one write, to lay out again for a state of the same layout (see the module docstring)."""

    def __init__(self, staged: list, paths: dict):
        self.staged = [(f.path, list(f.parts), list(f.slots)) for f in staged]
        self.paths = paths

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

    def __init__(self, storage, rel: str, files: list):
        self.storage, self.rel, self.files = storage, rel, files

    def upload(self) -> list[FileEntry]:
        return [FileEntry(name, sum(len(p) for p in parts),
                          self.storage.put_parts(f"{self.rel}/{name}", parts, exclusive=True))
                for name, parts in self.files]

    def release(self) -> None:
        self.files = []


def _same_memory(new, old) -> bool:
    """Whether tensor ``new`` is ``old``'s bytes: the same host memory, dtype, shape and strides."""
    return (new.data_ptr() == old.data_ptr() and new.device.type == "cpu" and new.dtype == old.dtype
            and new.shape == old.shape and new.stride() == old.stride() and not new.is_conj() and not new.is_neg())
