"""A rank's training state copied to host memory, and the layout a DCP save planned for it: what the
durable checkpoint's async save and the memory recovery tier share.

    host = HostCopy()
    copy = host.copy(state_dict)           # every tensor in a host buffer kept from one copy to the next
    pending = host.copy_async(state_dict)  # CUDA: queued on a side stream; pending.wait() on the host later
    pending = host.copy_async(state_dict, defer=True)  # host state: copied by pending.wait() or fence_writes()
    placement = host.place(where)          # this layout's buffers at other memory (a memory file's bytes)
    pending = host.copy_async(state_dict, into=placement)   # host state: copied there while the layout holds
    fence_writes()                         # before the optimizer writes in place: the GPU waits for the reads
    layout = layout_fingerprint(state_dict)  # what a DCP save plan depends on
    planned = PlannedLayout(plan_id, layout, writer.plan, paths, writer.results, is_coordinator, metadata,
                            tokens)       # kept, so a later save of the same layout skips DCP's planning

:class:`HostCopy` keeps its buffers (pinned where CUDA is present) and the DTensors
rewrapped over them between copies, so a steady-state copy allocates nothing; device-to-host
copies run on a side stream into ping-pong buffers, ordered by events (:class:`HostCopy`). A
save of a state whose :func:`layout_fingerprint` matches a :class:`PlannedLayout`
reuses its plan (``checkpointing.transaction``, ``checkpointing.recovery.tier``).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any


def _tensor_types() -> tuple[type, type]:
    """(torch.Tensor, DTensor), imported at the first copy: `etrain ckpt --help` and the other commands that
    import this module without copying anything never load torch."""
    global _TENSOR_TYPES
    if _TENSOR_TYPES is None:
        import torch
        from torch.distributed.tensor import DTensor

        _TENSOR_TYPES = (torch.Tensor, DTensor)
    return _TENSOR_TYPES


_TENSOR_TYPES: tuple[type, type] | None = None


@dataclass(frozen=True)
class PlannedLayout:
    """What a save planned by DCP leaves for later saves of the same layout (checkpointing.transaction)."""

    plan_id: str  # rank 0's nonce of the planned save: the same on every rank
    layout: str  # layout_fingerprint of the state it was planned for
    plan: Any  # this rank's final DCP SavePlan
    paths: dict  # where each of its items is in the state dict (checkpointing.dcp.writer.PlannedItems)
    results: list  # this rank's WriteResults: where each item went
    is_coordinator: bool
    metadata: Any  # the DCP Metadata (coordinator only)
    tokens: tuple  # each rank's file token in that save

    def metadata_for(self, tokens: list[str]):
        """The planned save's metadata with every rank's file names of a new attempt."""
        from .dcp.writer import retoken_metadata

        return retoken_metadata(self.metadata, dict(zip(self.tokens, tokens)))


class PendingCopy:
    """A copy queued on the side stream: :meth:`wait` blocks the calling (host) thread until the host
    buffers hold it and returns the copied state; nothing to wait for when every tensor was on the host.
    ``layout``: the copy's :func:`layout_fingerprint` when known (host state), else None. ``into``: the
    :class:`Placement` the copy went to, or None (the copy's own buffers)."""

    def __init__(self, state: dict, event=None, layout: str | None = None, into: Placement | None = None,
                 deferred: _Deferred | None = None):
        self.state = state
        self.event = event  # a CUDA event recorded on the side stream after the last copy, or None
        self.layout = layout
        self.into = into
        self.deferred = deferred  # host state copied later (copy_async(defer=True)), or None

    def done(self) -> bool:
        return (self.deferred is None or self.deferred.done) and (self.event is None or self.event.query())

    def wait(self) -> dict:
        if self.deferred is not None:
            self.deferred.run()
        if self.event is not None:
            self.event.synchronize()
        return self.state


class _Deferred:
    """A host copy not made yet (:meth:`HostCopy.copy_async` with ``defer``): made once, by the first thread
    that needs it, the one that waits for the copy (:meth:`PendingCopy.wait`) or the training thread before
    the optimizer writes the state (:func:`fence_writes`)."""

    def __init__(self, buffers: list, sources: list):
        self._args: tuple | None = (buffers, sources)
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._args is None

    def run(self) -> None:
        with self._lock:
            if self._args is not None:
                import torch

                torch._foreach_copy_(*self._args)
                self._args = None


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every HostCopy with a copy in flight, for fence_writes


def fence_writes() -> None:
    """Before the optimizer step writes parameters and state in place: make the current CUDA stream wait (on
    the GPU, the host does not block) until every queued device-to-host copy has read its tensors, and make
    every deferred host copy that its thread has not made yet (here, in the calling thread). Nothing to do
    without a copy in flight."""
    for host in list(_LIVE):
        host.fence()


class HostCopy:
    """Host buffers for a state dict, kept from one copy to the next (DTensors rewrapped over them).

    CPU tensors are copied in the calling thread, or (``defer``) by the thread that waits for the copy: the
    foreach copy releases the GIL, so it runs while training computes the next step. CUDA tensors are copied
    on a side stream, which first waits for the compute stream (the values as of the call), into pinned
    buffers that alternate between two sets (ping-pong: copy N+1 may be queued while copy N is still read on
    the host; copy N+2 reuses N's buffers, so N must have been consumed by then). An event after the last
    copy lets :func:`fence_writes` order the optimizer's in-place writes after the reads, and
    :meth:`PendingCopy.wait` tell the host when the buffers are filled; forward and backward of the next
    step overlap the copy.
    """

    SLOTS = 2  # buffer sets for CUDA state (ping-pong); host state needs one

    def __init__(self, slots: int = SLOTS):
        """``slots``: buffer sets for CUDA state, 2 (ping-pong) unless every copy is consumed before the next is
        queued (the memory tier waits for its previous snapshot first): then 1, and each copy lands in the same
        buffers, so what was laid out over them (the tier's files) is reused."""
        self.slots = slots
        self.buffers: dict = {}  # path -> host buffer (slot 0)
        self._more: list[dict] = [{} for _ in range(slots - 1)]  # the other slots' buffers, CUDA state only
        self._views: dict = {}  # (slot, path) -> the DTensor over that buffer, made once (from_local costs)
        self._slot = 0
        self._stream = None  # the side stream, made at the first CUDA copy
        self._event = None  # recorded after the last queued copy
        self._index: _Index | None = None  # host state: the buffers of the last layout, in walk order
        self._deferred: _Deferred | None = None  # the last deferred host copy

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.buffers, *self._more) for t in d.values())

    def copy(self, state_dict: dict) -> dict:
        """A copy of every tensor in ``state_dict`` in host buffers kept from one save to the next, complete
        when this returns (CUDA copies: the host waits for the side stream's event, not the compute stream)."""
        return self.copy_async(state_dict).wait()

    def copy_async(self, state_dict: dict, into: Placement | None = None, defer: bool = False) -> PendingCopy:
        """Queue the copy; for CUDA state, returns before it is done (:class:`PendingCopy`). Host state whose
        layout is the one ``into`` was placed for is copied into its buffers instead of this copy's own
        (:meth:`place`); CUDA state always goes to the pinned buffers. ``defer``: host state of the last
        layout is copied later, by :meth:`PendingCopy.wait` or :func:`fence_writes`, whichever comes first
        (the caller's promise: nothing writes the state in place before either; the first copy of a layout,
        which indexes it, is made now)."""
        import torch

        if self._deferred is not None:  # a deferred copy into these buffers lands before this one
            self._deferred.run()
        leaves: list = []
        key: list = []
        tree = _flatten(state_dict, leaves, key)
        _, dtensor = _tensor_types()
        if not any((t._local_tensor if type(t) is dtensor else t).is_cuda for t in leaves):
            return self._copy_indexed(state_dict, leaves, key, tree, into, defer)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._slot = (self._slot + 1) % self.slots
        side, compute = self._stream, torch.cuda.current_stream()
        side.wait_stream(compute)  # the values as of now, after the queued forward/backward/step
        with torch.cuda.stream(side):
            out = self._copy_tree(state_dict, "", self._slot)
            self._event = torch.cuda.Event()
            self._event.record(side)
        _LIVE.add(self)
        return PendingCopy(out, self._event)

    def _copy_indexed(self, state_dict: dict, leaves: list, key: list, tree, into: Placement | None,
                      defer: bool = False) -> PendingCopy:
        """Host state (``leaves``, ``key``, ``tree``: :func:`_flatten`'s): while the layout's key is the last
        one's, one ``foreach`` copy into the buffers (and DTensor views) indexed for it (or ``into``'s, placed
        for it), else the full copy, which indexes the new layout. The copy carries its layout's fingerprint,
        computed once per layout."""
        import torch

        _, dtensor = _tensor_types()
        index = self._index
        if index is None or index.key != key:
            out = self._copy_tree(state_dict, "", 0)
            views: list = []
            _flatten(out, views, [])
            self._index = _Index(key, views, [v._local_tensor if type(v) is dtensor else v for v in views],
                                 layout_fingerprint(out))
            return PendingCopy(out, layout=self._index.layout)
        target = into if into is not None and into.index is index else index
        deferred = None
        if leaves:
            sources = [(t._local_tensor if type(t) is dtensor else t).detach() for t in leaves]
            if defer:
                deferred = self._deferred = _Deferred(target.buffers, sources)
                _LIVE.add(self)
            else:
                torch._foreach_copy_(target.buffers, sources)
        return PendingCopy(_fill(tree, target.views), layout=index.layout, into=into if target is into else None,
                           deferred=deferred)

    def place(self, where) -> Placement | None:
        """The current layout's buffers in other memory: ``where(buffer)`` gives a tensor of the buffer's shape
        and dtype in the memory it should lie in, or None (then nothing is placed: None). A copy of a state of
        this layout ``into`` the placement (:meth:`copy_async`) fills those tensors; a new layout drops it."""
        from torch.distributed.tensor import DTensor

        index = self._index
        if index is None:
            return None
        placed = []
        for buf in index.buffers:
            t = where(buf)
            if t is None or t.shape != buf.shape or t.dtype != buf.dtype or not t.is_contiguous():
                return None
            placed.append(t)
        views = [DTensor.from_local(t, v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride())
                 if isinstance(v, DTensor) else t for v, t in zip(index.views, placed)]
        return Placement(index, placed, views)

    def holds(self, placement: Placement | None) -> bool:
        """Whether ``placement`` was placed for the layout this copy holds now (a copy into it would use it)."""
        return placement is not None and placement.index is self._index

    def fence(self) -> None:
        """This copy's deferred host copy made, if its thread has not yet; the current stream waits for this
        copy's reads (:func:`fence_writes`)."""
        if self._deferred is not None:
            self._deferred.run()
        if self._event is not None:
            import torch

            torch.cuda.current_stream().wait_event(self._event)

    def _copy_tree(self, obj, path: str, slot: int):
        import torch
        from torch.distributed.tensor import DTensor

        if isinstance(obj, dict):
            return {k: self._copy_tree(v, f"{path}/{k}", slot) for k, v in obj.items()}
        if not isinstance(obj, torch.Tensor):
            return obj
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        on_gpu = local.device.type == "cuda"
        bufs = self.buffers if slot == 0 or not on_gpu else self._more[slot - 1]
        buf = bufs.get(path)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=torch.cuda.is_available())
            bufs[path] = buf
        buf.copy_(local.detach(), non_blocking=on_gpu)
        if on_gpu:  # a temporary source must outlive the copy: the allocator waits for the side stream
            local.record_stream(torch.cuda.current_stream())
        if not isinstance(obj, DTensor):
            return buf
        key = (slot if on_gpu else 0, path)
        view = self._views.get(key)
        if (view is None or view._local_tensor.data_ptr() != buf.data_ptr() or view.device_mesh is not obj.device_mesh
                or view.placements != obj.placements or view.shape != obj.shape or view.stride() != obj.stride()):
            view = DTensor.from_local(buf, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())
            self._views[key] = view
        return view


@dataclass
class Placement:
    """One layout's host buffers placed in other memory (:meth:`HostCopy.place`), and the copy's tensors
    over them (the buffers, or DTensors over them), in the order :func:`_flatten` walks a state of it."""

    index: _Index  # the layout's own buffers, which these stand in for
    buffers: list
    views: list


@dataclass
class _Index:
    """The host buffers of one layout, in the order :func:`_flatten` walks a state of it."""

    key: list  # per tensor (walk order) what its buffer and view depend on; per dict its keys
    views: list  # the copy's tensors: the buffers, or DTensors over them
    buffers: list  # the buffers
    layout: str  # layout_fingerprint of the copy


class _Slot(int):
    """A tensor's place in the flattened list (in a tree made by :func:`_flatten`)."""


def _flatten(obj, leaves: list, key: list, types: tuple[type, type] | None = None):
    """``obj``'s dicts rebuilt with every tensor replaced by its :class:`_Slot` in ``leaves`` (appended to);
    ``key`` gets what the layout depends on: each dict's keys, each tensor's type, shapes, dtype, sharding."""
    tensor, dtensor = types = types or _tensor_types()
    if isinstance(obj, dict):
        key.append(tuple(obj))
        return {k: _flatten(v, leaves, key, types) for k, v in obj.items()}
    if isinstance(obj, dtensor):
        local = obj._local_tensor
        key.append((id(obj.device_mesh), obj.device_mesh, obj.placements, obj.shape, obj.stride(), local.shape,
                    local.dtype, local.device, obj.requires_grad))
    elif isinstance(obj, tensor):
        key.append((type(obj), obj.shape, obj.dtype, obj.device, obj.layout, obj.requires_grad))
    else:
        if isinstance(obj, (list, tuple)):
            key.append((type(obj), len(obj)))
            for v in obj:  # their structure is part of the layout (never copied: kept as they are)
                _flatten(v, [], key, types)
        else:
            key.append(type(obj))
        return obj
    leaves.append(obj)
    return _Slot(len(leaves) - 1)


def _fill(tree, views: list):
    """``tree`` (from :func:`_flatten`) with each slot replaced by its view."""
    if isinstance(tree, dict):
        return {k: _fill(v, views) for k, v in tree.items()}
    return views[tree] if type(tree) is _Slot else tree


def layout_fingerprint(state_dict) -> str:
    """A digest of everything this rank's DCP save plan depends on: the keys, and per tensor its
    dtype, shapes, sharding and the properties DCP records (``TensorProperties``). Where non-tensor
    items land (their serialized size) is checked after laying out instead."""
    import torch
    from torch.distributed.tensor import DTensor

    h = hashlib.blake2b(digest_size=16)
    coords: dict[int, tuple] = {}

    def props(t: torch.Tensor, requires_grad: bool) -> str:
        return f"{t.dtype}{t.layout}{int(requires_grad)}{int(t.is_pinned())}"

    def walk(obj, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            h.update(f"{path}:{type(obj).__name__}{len(obj)};".encode())
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        elif isinstance(obj, DTensor):
            mesh, local = obj.device_mesh, obj._local_tensor
            if id(mesh) not in coords:
                coords[id(mesh)] = (tuple(mesh.shape), mesh.get_coordinate())
            h.update(f"{path}:D{tuple(obj.shape)}{tuple(local.shape)}{obj.placements}{coords[id(mesh)]}"
                     f"{props(local, obj.requires_grad)};".encode())
        elif isinstance(obj, torch.Tensor):
            h.update(f"{path}:T{tuple(obj.shape)}{props(obj, obj.requires_grad)};".encode())
        else:
            h.update(f"{path}:{type(obj).__name__};".encode())

    walk(state_dict, "")
    return h.hexdigest()
