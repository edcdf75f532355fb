"""A rank's training state copied to host memory, and the layout a DCP save planned for it: what the
durable checkpoint's async save and the memory recovery tier share.

    host = HostCopy()
    copy = host.copy(state_dict)           # every tensor in a host buffer kept from one copy to the next
    layout = layout_fingerprint(state_dict)  # what a DCP save plan depends on
    planned = PlannedLayout(plan_id, layout, writer.plan, paths, writer.results, is_coordinator, metadata,
                            tokens)       # kept, so a later save of the same layout skips DCP's planning

:class:`HostCopy` keeps its buffers (pinned where CUDA is present) and the DTensors
rewrapped over them between copies, so a steady-state copy allocates nothing. A
save of a state whose :func:`layout_fingerprint` matches a :class:`PlannedLayout`
reuses its plan (``checkpointing.transaction``, ``checkpointing.recovery.tier``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlannedLayout:
    """What a save planned by DCP leaves for later saves of the same layout (checkpointing.transaction)."""

    plan_id: str  # rank 0's nonce of the planned save: the same on every rank
    layout: str  # layout_fingerprint of the state it was planned for
    plan: Any  # this rank's final DCP SavePlan
    paths: dict  # where each of its items is in the state dict (dcp_io.PlannedItems)
    results: list  # this rank's WriteResults: where each item went
    is_coordinator: bool
    metadata: Any  # the DCP Metadata (coordinator only)
    tokens: tuple  # each rank's file token in that save

    def metadata_for(self, tokens: list[str]):
        """The planned save's metadata with every rank's file names of a new attempt."""
        from .dcp_io import retoken_metadata

        return retoken_metadata(self.metadata, dict(zip(self.tokens, tokens)))


class HostCopy:
    """Host buffers for a state dict, kept from one copy to the next (DTensors rewrapped over them)."""

    def __init__(self):
        self.buffers: dict = {}  # path -> host buffer
        self._views: dict = {}  # path -> the DTensor over that buffer, made once (from_local costs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def copy(self, state_dict: dict) -> dict:
        """A copy of every tensor in ``state_dict`` in host buffers kept from one save to the next."""
        import torch

        devices: set[str] = set()
        out = self._copy_tree(state_dict, "", devices)
        if "cuda" in devices:
            torch.cuda.current_stream().synchronize()  # once, after every copy was queued
        return out

    def _copy_tree(self, obj, path: str, devices: set[str]):
        import torch
        from torch.distributed.tensor import DTensor

        if isinstance(obj, dict):
            return {k: self._copy_tree(v, f"{path}/{k}", devices) for k, v in obj.items()}
        if not isinstance(obj, torch.Tensor):
            return obj
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        buf = self.buffers.get(path)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=torch.cuda.is_available())
            self.buffers[path] = buf
        devices.add(local.device.type)
        buf.copy_(local.detach(), non_blocking=local.device.type == "cuda")
        if not isinstance(obj, DTensor):
            return buf
        view = self._views.get(path)
        if (view is None or view._local_tensor.data_ptr() != buf.data_ptr() or view.device_mesh is not obj.device_mesh
                or view.placements != obj.placements or view.shape != obj.shape or view.stride() != obj.stride()):
            view = DTensor.from_local(buf, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())
            self._views[path] = view
        return view


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
