"""What each rank measures for the metrics: communication and memory.

    meter = comm_meter()            # the process's meter; installs its hooks once
    meter.name_axes(mesh)           # label collectives by mesh axis (dp_shard, tp, pp, ...)
    ...train...
    snap = rank_telemetry(trainer, ckpt)   # a JSON-able dict, sent to the exporter

Communication is timed around the real collectives. The public
``torch.distributed`` functions (all_reduce, all_gather_single,
reduce_scatter_single and their names before torch 2.13, broadcast,
send/recv, isend/irecv, all_to_all_single, all_gather, reduce_scatter) and
the functional collectives that DTensor uses for tensor parallelism are
replaced by thin wrappers that count the call, its
bytes and its time, then call the original. Bytes and bus bandwidth follow the
nccl-tests definitions: the "size" of all_gather is its output, of
reduce_scatter and all_to_all its input, of the others the tensor; bus
bandwidth is size / time times 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
reduce_scatter and all_to_all, 1 for broadcast and point-to-point. Time is from
the call to completion: the call itself when it blocks; for ``async_op=True``
work, until its future completes (a callback); for functional collectives,
until the result is waited for (the first use of the tensor). A metered call
made inside another metered one counts once (all_gather_single inside the
deprecated all_gather_into_tensor). The object collectives
(all_gather_object, broadcast_object_list) are not wrapped themselves: the
tensor collectives they issue (sizes, then data) are counted. gather,
scatter, reduce, the list form of all_to_all and barrier are not counted.

On NCCL (CUDA tensors) the seconds are GPU time, from CUDA events around the collective
(:mod:`trainer.observe.gpu_timing`), read once they have fired; on gloo, host time as above.

Cost: one Python wrapper per collective (a few microseconds; FSDP issues two or
three per block and step) plus, for async work, one future callback.
``bench/metrics_overhead.py`` measures it against a run with the hooks off.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..world import group_axis
from .gpu_timing import EventTimer
from ..models import spec_for
from ..parallel.dims import Axis, Mesh

# Histogram buckets of one collective's seconds (upper bounds; +Inf is implied).
SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "all_to_all")


def _bus_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


# (kind, index and name of the argument whose bytes are the "size", index and name of the group argument)
_C10D = {
    "all_reduce": ("all_reduce", 0, "tensor", 2, "group"),
    "all_reduce_coalesced": ("all_reduce", 0, "tensors", 2, "group"),
    "all_gather_single": ("all_gather", 0, "output_tensor", 2, "group"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor", 2, "group"),  # torch < 2.13 (trainer.compat)
    "all_gather": ("all_gather", 0, "tensor_list", 2, "group"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input", 3, "group"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input", 3, "group"),  # torch < 2.13 (trainer.compat)
    "reduce_scatter": ("reduce_scatter", 1, "input_list", 3, "group"),
    "broadcast": ("broadcast", 0, "tensor", 2, "group"),
    "send": ("send", 0, "tensor", 2, "group"),
    "isend": ("send", 0, "tensor", 2, "group"),
    "recv": ("recv", 0, "tensor", 2, "group"),
    "irecv": ("recv", 0, "tensor", 2, "group"),
    "all_to_all_single": ("all_to_all", 1, "input", 4, "group"),
}
# Functional collectives (DTensor): (kind, group argument index); the size is the input
# (times the group size for all_gather, whose output is n inputs).
_FUNCOL = {
    "all_reduce": ("all_reduce", 2),
    "all_gather_tensor": ("all_gather", 2),
    "all_gather_single": ("all_gather", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 3),
    "reduce_scatter_single": ("reduce_scatter", 3),
    "all_to_all_single": ("all_to_all", 3),
    "broadcast": ("broadcast", 2),
}


class CommMeter:
    """Cumulative calls, bytes, bus bytes, seconds and a seconds histogram per (kind, axis)."""

    def __init__(self):
        self.enabled = True
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str], list] = {}
        self._axes: dict[str, str] = {}  # process group name -> mesh axis
        self._pending: dict[int, tuple] = {}  # functional collectives waiting for their wait()
        self._tls = threading.local()
        self._installed = False
        self._originals: list[tuple[Any, str, Any]] = []  # (module, name, original function)
        self.events = EventTimer()  # NCCL collectives' CUDA event pairs, recorded once they fired

    # --- labelling ----------------------------------------------------------------

    def name_axes(self, mesh) -> None:
        """Label the groups of ``mesh``'s dimensions with their names (dp_shard, dp_replicate, dp, tp, pp)."""
        self._axes = {}
        if mesh is None:
            return
        names = list(mesh.mesh_dim_names or ())
        flat = [m.value for m in (Mesh.DP_CP, Mesh.DP_SHARD_CP)]  # flattened under context parallelism
        if Axis.DP_REPLICATE in names and Axis.DP_SHARD in names:
            names.append(Mesh.DP.value)  # the flattened axis of the loss/norm reductions (ParallelDims.build_mesh)
        for name in names + flat:
            try:
                pg = mesh[name].get_group()
            except Exception:
                continue
            if name in flat and dist.is_initialized() and pg.group_name == dist.group.WORLD.group_name:
                continue  # the whole world: left "world"
            self._axes[pg.group_name] = name

    def axis_of(self, group) -> str:
        if group is None:
            return "world"
        name = getattr(group, "group_name", None) if not isinstance(group, str) else group
        if name is None:
            return "other"
        axis = self._axes.get(name) or group_axis(name)  # groups outside the mesh: trainer.world.name_group
        if axis is not None:
            return axis
        if dist.is_initialized() and name == dist.group.WORLD.group_name:
            return "world"
        return "other"

    # --- recording ------------------------------------------------------------------

    def record(self, kind: str, axis: str, nbytes: int, group_size: int, seconds: float) -> None:
        bus = nbytes * _bus_factor(kind, group_size)
        i = 0
        while i < len(SECONDS_BUCKETS) and seconds > SECONDS_BUCKETS[i]:
            i += 1
        with self._lock:
            s = self._stats.get((kind, axis))
            if s is None:
                s = self._stats[(kind, axis)] = [0, 0, 0.0, 0.0, [0] * (len(SECONDS_BUCKETS) + 1)]
            s[0] += 1
            s[1] += nbytes
            s[2] += bus
            s[3] += seconds
            s[4][i] += 1

    def snapshot(self) -> list[dict]:
        """Cumulative figures: one dict per (kind, axis), JSON-able."""
        self.events.drain(self.record)
        with self._lock:
            return [{"kind": k, "axis": a, "calls": s[0], "bytes": s[1], "bus_bytes": s[2], "seconds": s[3],
                     "buckets": list(s[4])} for (k, a), s in sorted(self._stats.items())]

    def bytes_since(self, before: dict[str, int] | None) -> tuple[dict[str, int], dict[str, int]]:
        """(bytes per collective kind since the totals ``before``, the totals now): the step log's
        ``comm_bytes``, one step at a time (``before`` None: since the meter started)."""
        now: dict[str, int] = {}
        for c in self.snapshot():
            now[c["kind"]] = now.get(c["kind"], 0) + c["bytes"]
        prior = before or {}
        return {k: v - prior.get(k, 0) for k, v in now.items() if v != prior.get(k, 0)}, now

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()
            self._pending.clear()

    # --- hooks ----------------------------------------------------------------------

    def install(self) -> None:
        """Wrap the collectives of torch.distributed (once per process)."""
        if self._installed:
            return
        self._installed = True
        c10d = dist.distributed_c10d
        for name, spec in _C10D.items():
            orig = getattr(c10d, name, None)
            if orig is None:
                continue
            wrapped = self._wrap_c10d(orig, *spec)
            self._swap(c10d, name, wrapped)
            if getattr(dist, name, None) is orig:
                self._swap(dist, name, wrapped)
        if getattr(c10d, "batch_isend_irecv", None) is not None:
            batch = self._wrap_batch(c10d.batch_isend_irecv)
            if getattr(dist, "batch_isend_irecv", None) is c10d.batch_isend_irecv:
                self._swap(dist, "batch_isend_irecv", batch)
            self._swap(c10d, "batch_isend_irecv", batch)
        import torch.distributed._functional_collectives as funcol

        for name, (kind, gi) in _FUNCOL.items():
            orig = getattr(funcol, name, None)
            if orig is not None:
                self._swap(funcol, name, self._wrap_funcol(funcol, orig, kind, gi))
        self._swap(funcol, "wait_tensor", self._wrap_wait(funcol.wait_tensor))

    def _swap(self, module, name: str, fn) -> None:
        self._originals.append((module, name, getattr(module, name)))
        setattr(module, name, fn)

    def uninstall(self) -> None:
        """Put torch.distributed's own functions back (the overhead benchmark's "off")."""
        for module, name, orig in reversed(self._originals):
            setattr(module, name, orig)
        self._originals = []
        self._installed = False

    def _outer(self) -> bool:
        return self.enabled and not getattr(self._tls, "inside", False)

    def _issue(self, orig, args, kwargs):
        """Call ``orig``, marking this thread as inside a metered call; (result, start time)."""
        self._tls.inside = True
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs), t0
        finally:
            self._tls.inside = False

    def _done(self, kind: str, axis: str, nbytes: int, n: int, t0: float, start) -> None:
        """A collective has completed (on the current stream, for a CUDA one): record its time."""
        if start is None:
            self.record(kind, axis, nbytes, n, time.perf_counter() - t0)
        else:
            self.events.finish(start, (kind, axis, nbytes, n))
            self.events.drain(self.record)

    def _wrap_c10d(self, orig, kind: str, bi: int, bname: str, gi: int, gname: str):
        meter = self

        @functools.wraps(orig)
        def metered(*args, **kwargs):
            if not meter._outer():
                return orig(*args, **kwargs)
            tensor = _arg(args, kwargs, bi, bname)
            start = meter.events.start() if meter.events.wants(tensor) else None
            work, t0 = meter._issue(orig, args, kwargs)
            group = _arg(args, kwargs, gi, gname)
            nbytes = _nbytes(tensor)
            try:
                n = dist.get_world_size(group)
            except Exception:
                n = 1
            axis = meter.axis_of(group)

            def done(_f=None):  # on the current stream (a blocking call) or the future's callback stream
                meter._done(kind, axis, nbytes, n, t0, start)

            batched = getattr(meter._tls, "batched", None)
            if work is None and batched is not None:  # coalesced in a batch_isend_irecv (NCCL): timed with it
                batched.append((kind, axis, nbytes, n, t0, start))
                return work
            if work is None or not hasattr(work, "get_future"):
                done()
                return work
            try:
                work.get_future().add_done_callback(done)
            except Exception:  # coalesced work without a future: count it at issue
                done()
            return work

        return metered

    def _wrap_batch(self, orig):
        """``batch_isend_irecv``: NCCL coalesces its sends and receives, which then return no work of their own
        (their end would be recorded before their kernels were even queued): each is timed to the batch's
        completion instead, its last work's future. Gloo's are not coalesced and time themselves."""
        meter = self

        @functools.wraps(orig)
        def metered(p2p_op_list, *args, **kwargs):
            if not meter._outer():
                return orig(p2p_op_list, *args, **kwargs)
            meter._tls.batched = batched = []
            try:
                works = orig(p2p_op_list, *args, **kwargs)
            finally:
                meter._tls.batched = None

            def done(_f=None):
                for op in batched:
                    meter._done(*op)

            if batched:
                last = works[-1] if works else None
                try:
                    last.get_future().add_done_callback(done)
                except Exception:  # no work or no future: count them now
                    done()
            return works

        return metered

    def _wrap_funcol(self, funcol, orig, kind: str, gi: int):
        meter = self

        @functools.wraps(orig)
        def metered(*args, **kwargs):
            if not meter._outer():
                return orig(*args, **kwargs)
            inp = _arg(args, kwargs, 0, "self")
            start = meter.events.start() if meter.events.wants(inp) else None
            out, t0 = meter._issue(orig, args, kwargs)
            try:
                name = funcol._resolve_group_name(_arg(args, kwargs, gi, "group"))
                n = dist.distributed_c10d._get_group_size_by_name(name)
            except Exception:
                name, n = None, 1
            nbytes = _nbytes(inp) * (n if kind == "all_gather" else 1)
            elem = getattr(out, "elem", None)
            if elem is None or getattr(out, "completed", True):
                meter._done(kind, meter.axis_of(name), nbytes, n, t0, start)
            else:
                with meter._lock:
                    if len(meter._pending) > 4096:  # never waited for: forget rather than grow
                        meter._pending.clear()
                    meter._pending[elem.untyped_storage().data_ptr()] = (kind, meter.axis_of(name), nbytes, n, t0,
                                                                         start)
            return out

        return metered

    def _wrap_wait(self, orig):
        meter = self

        @functools.wraps(orig)
        def wait_tensor(tensor):
            out = orig(tensor)
            if meter._pending:
                try:
                    key = tensor.untyped_storage().data_ptr()
                except Exception:
                    return out
                with meter._lock:
                    hit = meter._pending.pop(key, None)
                if hit is not None:
                    meter._done(*hit)
            return out

        return wait_tensor


_METER: CommMeter | None = None


def comm_meter(install: bool = True) -> CommMeter:
    """This process's meter (hooks installed on first use unless ``install`` is False)."""
    global _METER
    if _METER is None:
        _METER = CommMeter()
    if install:
        _METER.install()
    return _METER


# --- memory ------------------------------------------------------------------------------


def process_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, on systems without /proc


def memory_bytes(trainer, ckpt=None) -> dict[str, int]:
    """Bytes by kind on this rank: params, grads, optimizer, rss, checkpoint_staging, and on GPU
    device_allocated, device_reserved, device_peak."""
    out: dict[str, int] = {}
    if trainer is not None and trainer.memory_measured:
        out.update(trainer.memory_measured)
    out["rss"] = process_rss_bytes()
    out["checkpoint_staging"] = ckpt.staging_bytes if ckpt is not None else 0
    device = getattr(trainer, "device", None)
    if device is not None and device.type == "cuda":
        out["device_allocated"] = torch.cuda.memory_allocated(device)
        out["device_reserved"] = torch.cuda.memory_reserved(device)
        out["device_peak"] = torch.cuda.max_memory_allocated(device)
    return out


def rank_telemetry(trainer, ckpt=None, meter: CommMeter | None = None) -> dict[str, Any]:
    """One rank's figures for the exporter: communication (cumulative) and memory (now)."""
    rank = trainer.world.rank if trainer is not None else -1
    m = meter or _METER
    return {"rank": rank, "time": time.time(), "comm": m.snapshot() if m is not None else [],
            "memory": memory_bytes(trainer, ckpt)}


# --- steps ---------------------------------------------------------------------------------

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class StepMeter:
    """Cumulative step-time histogram and data-wait seconds of this process (every step, not a sample)."""

    def __init__(self):
        self.buckets = [0] * (len(STEP_BUCKETS) + 1)
        self.seconds = 0.0
        self.data_seconds = 0.0

    def observe(self, step_seconds: float, data_seconds: float) -> None:
        i = 0
        while i < len(STEP_BUCKETS) and step_seconds > STEP_BUCKETS[i]:
            i += 1
        self.buckets[i] += 1
        self.seconds += step_seconds
        self.data_seconds += data_seconds

    def snapshot(self) -> dict:
        return {"buckets": list(self.buckets), "seconds": self.seconds, "data_seconds": self.data_seconds}


# Dense bf16 peak FLOP/s by device name (the first key the name contains: the PCIe and NVL cards before their
# SXM namesakes), for MFU; ETRAIN_PEAK_FLOPS overrides.
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 836e12, "H200": 989e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def peak_flops(device: torch.device) -> float | None:
    if os.environ.get("ETRAIN_PEAK_FLOPS"):
        return float(os.environ["ETRAIN_PEAK_FLOPS"])
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def peak_for_name(name: str) -> float | None:
    """The dense bf16 peak of the device ``name`` (``torch.cuda.get_device_name``), None when unknown."""
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def flops_per_token(cfg) -> float:
    """Training FLOPs per token of ``cfg``'s model, whichever its family: its spec's count
    (:meth:`trainer.models.shape.ModelShape.flops_per_token`: 6 x the parameters that multiply + 12 x
    layers x dim x sequence for attention). A model a user brings is counted on the meta device once."""
    return spec_for(cfg.model).flops_per_token(cfg.data.seq_len)


def mfu(cfg, device: torch.device, tokens_per_s: float, world_size: int) -> float | None:
    """Model FLOPs utilization over every device of the group; None off GPU (or unknown peak)."""
    peak = peak_flops(device)
    if not peak:
        return None
    return tokens_per_s * flops_per_token(cfg) / (peak * world_size)
