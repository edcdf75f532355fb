"""Data-parallel gradient reduction and AdamW, by ZeRO stage.

    opt = build_optimizer(parts, cfg, dims, mesh, rank)
    for each micro-batch: opt.before_backward(final=last); loss.backward(); opt.after_backward(final=last)
    norm_sq = opt.local_norm_sq()            # all-reduced over the world by the caller
    opt.step(lr, clip_coef); opt.zero_grad()

Stages 0-2 (:class:`ZeroOptimizer`) keep every parameter whole on each
data-parallel rank and differ in what they shard:

* 0: nothing (DDP semantics). Gradients live in one flat buffer (``p.grad`` are
  views into it, so autograd accumulates in place); one all-reduce per step.
* 1: the optimizer state. Same flat buffer; after the last micro-batch it is
  reduce-scattered in fp32, bucket by bucket, each rank updates its chunk of
  every parameter, and the chunks are all-gathered, bucket by bucket.
* 2: + gradients. Gradient hooks reduce-scatter them bucket by bucket
  (``parallel.bucket_mb``) while backward runs, adding this rank's chunks into
  an fp32 shard and dropping the whole gradients, so at most a bucket or two
  of them exist at once; every micro-batch accumulates into the shard.

Chunks follow DTensor's ``Shard`` rule (``torch.chunk`` along one dim: the
first dim that tensor parallelism does not already shard), so a chunk of the
optimizer state is exactly a DTensor shard and checkpoints reshard between
stages. Stage 3 (:class:`FSDPOptimizer`) is FSDP2: parameters, gradients and
state are DTensors sharded by ``fully_shard``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.adam import adam

from . import compat
from .config import RunConfig, TrainConfig
from .parallel_dims import ParallelDims, axis_group, sub_mesh
from .parallelize import ModelParts

log = logging.getLogger("etrain")


def chunk_bounds(size: int, n: int, r: int) -> tuple[int, int]:
    """(start, length) of chunk ``r`` of ``n`` along a dim of ``size`` (torch.chunk rule)."""
    cs = math.ceil(size / n) if size else 0
    start = min(r * cs, size)
    return start, max(0, min(cs, size - start))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def tp_shard_dim(p: torch.Tensor) -> int | None:
    """The tensor dim that tensor parallelism shards, if any."""
    if isinstance(p, DTensor):
        for pl in p.placements:
            if pl.is_shard():
                return pl.dim
    return None


def dtensor_replicas(t: DTensor, dims: ParallelDims) -> int:
    """World-wide identical copies of a DTensor's local shard (for the global norm).

    Every data-parallel or tensor-parallel axis counts that is Replicate in its
    placements or absent from its mesh; pipeline stages hold different tensors.
    """
    names = t.device_mesh.mesh_dim_names or ()
    reps = 1
    for axis in ("dp_replicate", "dp_shard", "tp"):
        if dims.size(axis) > 1 and (axis not in names or t.placements[names.index(axis)].is_replicate()):
            reps *= dims.size(axis)
    return reps


def _decays(fqn: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices (linear and embedding weights), not on norms."""
    return p.ndim >= 2


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state now (it is otherwise made at the first step), so a checkpoint can load into it.

    Zeros with step 0 are exactly what AdamW would create itself.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _adam_entries(st: dict, wrap) -> dict:
    return {"exp_avg": wrap(st["exp_avg"]), "exp_avg_sq": wrap(st["exp_avg_sq"]), "step": st["step"]}


def _make_adamw(groups: list[dict], ocfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=ocfg.lr,
        betas=(ocfg.beta1, ocfg.beta2),
        eps=ocfg.eps,
        foreach=True,
    )


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = local_tensor(t).untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


@dataclass
class _Slot:
    """One parameter as ZeRO sees it on this rank."""

    fqn: str
    param: nn.Parameter
    local: torch.Tensor  # the whole local tensor (the TP shard, if any)
    dim: int  # the dim ZeRO chunks
    starts: list[int]  # chunk start per shard rank
    lengths: list[int]  # chunk length per shard rank
    inner: int  # elements per index along ``dim``
    offset: int  # position in a rank's section of the packed buffer
    width: int  # elements reserved per rank for this parameter
    flat_offset: int  # position in the flat full-gradient buffer (stages 0/1)
    replicas: int  # identical copies of this rank's gradient chunk, world-wide
    decay: bool
    master: nn.Parameter | None = None  # what AdamW updates (a view of ``chunk`` in fp32)
    arrived: bool = False  # stage 2: its gradient waits in ``param.grad`` for the rest of its bucket

    def chunk(self, r: int) -> torch.Tensor:
        return self.local.narrow(self.dim, self.starts[r], self.lengths[r])

    def chunk_shape(self, r: int) -> torch.Size:
        s = list(self.local.shape)
        s[self.dim] = self.lengths[r]
        return torch.Size(s)


@dataclass
class _Bucket:
    """Consecutive slots whose gradients are reduced, and parameters gathered, by one collective."""

    slots: list[_Slot]
    lo: int  # its range in a rank's section
    hi: int
    ready: int = 0  # stage 2: slots whose gradient arrived since the bucket was last reduced
    reduced: bool = False  # stage 2: reduced into the shard at least once this step

    def region(self, row: torch.Tensor, s: _Slot, r: int) -> torch.Tensor:
        """Chunk ``r`` of slot ``s`` inside one ``hi - lo`` row of a bucket buffer, in the chunk's shape."""
        k = s.offset - self.lo
        return row[k : k + s.lengths[r] * s.inner].view(s.chunk_shape(r))


def make_buckets(slots: list[_Slot], n: int, limit_bytes: float) -> list[_Bucket]:
    """Cut ``slots`` into runs of at most ``limit_bytes`` of packed fp32 gradient (``n`` chunks each), from
    the last backwards (about backward's order); a parameter larger than the limit is a bucket alone."""
    runs: list[list[_Slot]] = []
    size = 0.0
    for s in reversed(slots):
        nbytes = 4 * n * s.width
        if not runs or size + nbytes > limit_bytes:
            runs.append([])
            size = 0.0
        runs[-1].append(s)
        size += nbytes
    return [_Bucket(run[::-1], run[-1].offset, run[0].offset + run[0].width) for run in runs]


def _local_grad(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The local tensor of gradient ``g`` in the placements of its parameter ``p`` (under TP the
    vocabulary-sharded embedding's can come back replicated at the full shape)."""
    if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
        with torch.no_grad():
            g = g.redistribute(p.device_mesh, p.placements)
    return local_tensor(g)


class ZeroOptimizer:
    """ZeRO stages 0, 1 and 2 over whole-parameter replicas (see module docstring)."""

    def __init__(self, parts: ModelParts, cfg: RunConfig, dims: ParallelDims, mesh, rank: int):
        self.stage = cfg.parallel.zero_stage if dims.dp > 1 else 0
        self.cfg = cfg.train
        self.dims = dims
        self.dp_group = axis_group(mesh, dims, "dp")
        self.shard_group = axis_group(mesh, dims, "dp_shard") if self.stage > 0 else None
        self.replicate_group = axis_group(mesh, dims, "dp_replicate") if self.stage > 0 else None
        self.n = dims.dp_shard if self.stage > 0 else 1
        self.r = dims.coords(rank)["dp_shard"] if self.stage > 0 else 0
        if cfg.parallel.reduce_every_microbatch and dims.dp > 1 and rank == 0:
            log.warning("parallel.reduce_every_microbatch has no effect with zero_stage=%d: stages 0 and 1 keep "
                        "whole gradients and reduce them once per step, stage 2 reduce-scatters every "
                        "micro-batch into its shard during backward", self.stage)
        params = list(parts.named_parameters())
        self.dtype = params[0][1].dtype if params else torch.float32
        self.slots: list[_Slot] = []
        offset = flat = 0
        for fqn, p in params:
            local = local_tensor(p.data)
            tpd = tp_shard_dim(p)
            dim = next((d for d in range(local.ndim) if d != tpd), 0) if local.ndim > 1 else 0
            bounds = [chunk_bounds(local.shape[dim], self.n, r) for r in range(self.n)]
            inner = local.numel() // max(1, local.shape[dim])
            width = max(L for _, L in bounds) * inner
            tp_rep = dims.tp if tpd is None else 1
            dp_rep = dims.dp if self.stage == 0 else dims.dp_replicate
            self.slots.append(_Slot(fqn, p, local, dim, [b[0] for b in bounds], [b[1] for b in bounds], inner,
                                    offset, width, flat, tp_rep * dp_rep, _decays(fqn, p)))
            offset += width
            flat += local.numel()
        self.section = offset
        self.buckets = make_buckets(self.slots, self.n, cfg.parallel.bucket_mb * 2**20) if self.stage else []
        # The bucketed collectives' scratch: the largest bucket's packed fp32 gradients and one more row.
        self.bucket_bytes = max((4 * (self.n + 1) * (b.hi - b.lo) for b in self.buckets), default=0)
        self._scratch: torch.Tensor | None = None  # see _bucket_buffers
        self._reduced: torch.Tensor | None = None  # stage 0, fp32 stage 1: reduced gradients, whole
        self.flat_grad: torch.Tensor | None = None  # stages 0/1: the full gradients
        self.grad_shard: torch.Tensor | None = None  # stage 2, bf16 stage 1: this rank's chunks in fp32
        if self.stage < 2:
            self._attach_flat_grads()
        else:
            for b in self.buckets:
                for s in b.slots:
                    s.param.register_post_accumulate_grad_hook(lambda p, s=s, b=b: self._grad_arrived(s, b))
        groups = [{"params": [], "weight_decay": self.cfg.weight_decay}, {"params": [], "weight_decay": 0.0}]
        for s in self.slots:
            mine = s.chunk(self.r)
            if mine.numel() == 0:
                continue
            # fp32: AdamW updates the parameter in place through a view. bf16: a
            # separate fp32 master copy, cast back after each step.
            s.master = nn.Parameter(mine if mine.dtype == torch.float32 else mine.float().clone())
            groups[0 if s.decay else 1]["params"].append(s.master)
        self.optimizer = _make_adamw(groups, self.cfg)
        # Checkpoints see each chunk as a DTensor shard of the whole parameter.
        self.state_mesh = sub_mesh(mesh, dims, "dp_replicate", "dp_shard", "tp")

    # --- checkpoints ----------------------------------------------------------

    def _as_global(self, s: _Slot, chunk: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``s`` as a DTensor of the parameter's global shape."""
        if self.state_mesh is None:
            return chunk
        tp_placement = s.param.placements[0] if isinstance(s.param, DTensor) else Replicate()
        if isinstance(tp_placement, Shard) and tp_placement.dim == s.dim and self.stage > 0:
            raise NotImplementedError(f"{s.fqn}: ZeRO and tensor parallelism shard the same dim")
        placements = []
        for name in self.state_mesh.mesh_dim_names:
            if name == "dp_shard" and self.stage > 0:
                placements.append(Shard(s.dim))
            elif name == "tp":
                placements.append(tp_placement)
            else:
                placements.append(Replicate())
        shape = s.param.shape
        return DTensor.from_local(chunk, self.state_mesh, placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def checkpoint_state(self) -> dict:
        """Model weights (the fp32 masters) and AdamW state, each a shard of its global tensor."""
        ensure_adam_state(self.optimizer)
        model, optim = {}, {}
        for s in self.slots:
            if s.master is None:
                continue
            model[s.fqn] = self._as_global(s, s.master)
            optim[s.fqn] = _adam_entries(self.optimizer.state[s.master], lambda t, s=s: self._as_global(s, t))
        return {"model": model, "optim": optim}

    @torch.no_grad()
    def after_load(self) -> None:
        """Loaded masters -> parameters, then every rank gets every chunk."""
        for s in self.slots:
            if s.master is not None and s.master.data_ptr() != s.chunk(self.r).data_ptr():
                s.chunk(self.r).copy_(s.master)
        self._all_gather_params()

    # --- gradients -----------------------------------------------------------

    def _attach_flat_grads(self) -> None:
        numel = sum(s.local.numel() for s in self.slots)
        self.flat_grad = torch.zeros(numel, dtype=self.dtype, device=self._device())
        self._grad_views = [self._flat_view(self.flat_grad, s) for s in self.slots]
        self._point_grads_at_views()

    @staticmethod
    def _flat_view(flat: torch.Tensor, s: _Slot) -> torch.Tensor:
        return flat[s.flat_offset : s.flat_offset + s.local.numel()].view(s.local.shape)

    def _point_grads_at_views(self) -> None:
        for s, view in zip(self.slots, self._grad_views):
            p = s.param
            if isinstance(p, DTensor):
                p.grad = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
            else:
                p.grad = view

    def _adopt_stray_grads(self) -> None:
        """Autograd normally accumulates into our views; copy in any grad it replaced."""
        for s, view in zip(self.slots, self._grad_views):
            if s.param.grad is None:
                continue
            lg = _local_grad(s.param, s.param.grad)
            if lg.data_ptr() != view.data_ptr():
                view.copy_(lg)
        self._point_grads_at_views()

    def before_backward(self, final: bool) -> None:
        """Before each micro-batch's forward. Nothing to do: stages 0/1 accumulate in the flat buffer,
        stage 2 reduces from its gradient hooks."""

    def after_backward(self, final: bool) -> None:
        """Call after each backward; ``final`` after the last micro-batch of the step."""
        if self.stage == 2:
            # The hooks reduced every complete bucket; the rest had parameters without a gradient.
            for b in self.buckets:
                if b.ready or (final and not b.reduced):
                    self._reduce_into_shard(b)
            if final and self.grad_shard is not None:
                if self.replicate_group is not None:
                    dist.all_reduce(self.grad_shard, group=self.replicate_group)
                self.grad_shard.div_(self.dims.dp)
        elif final:
            self._adopt_stray_grads()
            if self.stage == 0:
                self._all_reduce_grads()
            else:
                self._reduce_scatter_grads()
        self._scratch = None
        if final:
            self._set_master_grads()

    def _grad_arrived(self, s: _Slot, b: _Bucket) -> None:
        """Stage 2's hook, once autograd has accumulated ``s``'s gradient: reduce its bucket when complete."""
        if not s.arrived:
            s.arrived = True
            b.ready += 1
        if b.ready == len(b.slots):
            self._reduce_into_shard(b)

    def _reduce_into_shard(self, b: _Bucket) -> None:
        """Stage 2: reduce-scatter one bucket's gradients (then dropped) and add this rank's chunks to the shard."""
        grads = [None if s.param.grad is None else _local_grad(s.param, s.param.grad) for s in b.slots]
        for s in b.slots:
            s.param.grad, s.arrived = None, False
        packed, extra = self._pack(b, grads)
        del grads
        if self.grad_shard is None:
            self.grad_shard = torch.empty(self.section, dtype=torch.float32, device=self._device())
        dest = self.grad_shard[b.lo : b.hi]
        out = extra if b.reduced else dest
        self._reduce_scatter(out, packed)
        if b.reduced:
            dest.add_(out)
        b.reduced, b.ready = True, 0

    def _bucket_buffers(self, b: _Bucket, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` rows of ``hi - lo`` and one more, views of one scratch buffer sized for the largest bucket
        and reused bucket after bucket until the phase ends (gloo lets go of a collective's tensors from
        its worker thread, later: fresh buffers per bucket could pile up)."""
        if self._scratch is None or self._scratch.dtype != dtype:
            width = max(c.hi - c.lo for c in self.buckets)
            self._scratch = torch.empty((self.n + 1) * width, dtype=dtype, device=self._device())
        w = b.hi - b.lo
        return self._scratch[: self.n * w].view(self.n, w), self._scratch[self.n * w : (self.n + 1) * w]

    def _pack(self, b: _Bucket, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, hi - lo]`` fp32: row r holds chunk r of each of the bucket's gradients (zeros for None);
        and a spare ``hi - lo`` row."""
        packed, extra = self._bucket_buffers(b, torch.float32)
        packed.zero_()
        for s, g in zip(b.slots, grads):
            if g is None:
                continue
            for r in range(self.n):
                if s.lengths[r]:
                    b.region(packed[r], s, r).copy_(g.narrow(s.dim, s.starts[r], s.lengths[r]))
        return packed, extra

    def _reduce_scatter(self, out: torch.Tensor, packed: torch.Tensor) -> None:
        if self.shard_group is not None:
            compat.reduce_scatter_single(out, packed.view(-1), group=self.shard_group)
        else:
            out.copy_(packed.view(-1))

    def _all_reduce_grads(self) -> None:
        """Stage 0: all-reduce the whole gradients, in fp32 (in place when they are fp32)."""
        reduced = self.flat_grad if self.flat_grad.dtype == torch.float32 else self.flat_grad.float()
        if self.dp_group is not None:
            dist.all_reduce(reduced, group=self.dp_group)
        reduced.div_(self.dims.dp)
        self._reduced = reduced

    def _reduce_scatter_grads(self) -> None:
        """Stage 1, after the last micro-batch: reduce-scatter the accumulated gradients in fp32, bucket by
        bucket. This rank's reduced chunks go back into the flat buffer (fp32) or into an fp32 shard (bf16)."""
        in_place = self.dtype == torch.float32
        if not in_place:
            self.grad_shard = torch.empty(self.section, dtype=torch.float32, device=self._device())
        for b in self.buckets:
            packed, extra = self._pack(b, [self._flat_view(self.flat_grad, s) for s in b.slots])
            out = extra if in_place else self.grad_shard[b.lo : b.hi]
            self._reduce_scatter(out, packed)
            if self.replicate_group is not None:
                dist.all_reduce(out, group=self.replicate_group)
            out.div_(self.dims.dp)
            for s in b.slots if in_place else []:
                if s.lengths[self.r]:
                    self._my_chunk(self.flat_grad, s).copy_(b.region(out, s, self.r))
        self._reduced = self.flat_grad if in_place else None

    def _my_chunk(self, flat: torch.Tensor, s: _Slot) -> torch.Tensor:
        return self._flat_view(flat, s).narrow(s.dim, s.starts[self.r], s.lengths[self.r])

    def _set_master_grads(self) -> None:
        for s in self.slots:
            if s.master is None:
                continue
            if self._reduced is not None:
                s.master.grad = self._my_chunk(self._reduced, s)
            else:
                n = s.master.numel()
                s.master.grad = self.grad_shard[s.offset : s.offset + n].view(s.chunk_shape(self.r))

    def local_norm_sq(self) -> torch.Tensor:
        """Sum of squared gradient entries this rank owns, each divided by its replica count."""
        total = torch.zeros((), dtype=torch.float32, device=self._device())
        for s in self.slots:
            if s.master is not None and s.master.grad is not None:
                total += s.master.grad.float().pow(2).sum() / s.replicas
        return total

    def _device(self) -> torch.device:
        return self.slots[0].local.device if self.slots else torch.device("cpu")

    # --- update ------------------------------------------------------------------

    @torch.no_grad()  # the update and the copy into the (bf16) parameters are not part of any graph
    def step(self, lr: float, clip_coef: float) -> None:
        grads = [s.master.grad for s in self.slots if s.master is not None]
        if clip_coef < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coef)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        for s in self.slots:
            if s.master is not None and s.master.data_ptr() != s.chunk(self.r).data_ptr():
                s.chunk(self.r).copy_(s.master)
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        """Every rank's updated chunks to every rank, bucket by bucket (stages 1-2)."""
        for b in self.buckets if self.n > 1 else []:
            full, mine = self._bucket_buffers(b, self.dtype)
            mine.zero_()
            for s in b.slots:
                if s.lengths[self.r]:
                    b.region(mine, s, self.r).copy_(s.chunk(self.r))
            compat.all_gather_single(full.view(-1), mine, group=self.shard_group)
            for s in b.slots:
                for r in range(self.n):
                    if r != self.r and s.lengths[r]:
                        s.chunk(r).copy_(b.region(full[r], s, r))
        self._scratch = None

    def zero_grad(self) -> None:
        for s in self.slots:
            if s.master is not None:
                s.master.grad = None
        self._reduced = self.grad_shard = None
        for b in self.buckets:
            b.reduced = False
        if self.stage < 2:
            self.flat_grad.zero_()
            self._point_grads_at_views()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        params = _storage_bytes(s.local for s in self.slots)
        held = [self.flat_grad, self.grad_shard, self._reduced] + [s.param.grad for s in self.slots if self.stage == 2]
        grads = _storage_bytes(held)
        state = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        masters = [s.master for s in self.slots if s.master is not None
                   and s.master.data_ptr() != s.chunk(self.r).data_ptr()]
        return {"params": params, "grads": grads, "optimizer": _storage_bytes(state) + _storage_bytes(masters)}


class FSDPOptimizer:
    """ZeRO stage 3: AdamW over FSDP2's sharded DTensor parameters."""

    def __init__(self, parts: ModelParts, cfg: RunConfig, dims: ParallelDims, rank: int = 0):
        self.cfg = cfg.train
        self.dims = dims
        self.modules = [m for m in parts.modules if isinstance(m, FSDPModule)]
        # A pipeline schedule turns FSDP's gradient sync off and on itself (PipelineStage).
        self.sync_each = None if parts.pipeline is not None else cfg.parallel.reduce_every_microbatch
        if parts.pipeline is not None and cfg.parallel.reduce_every_microbatch and rank == 0:
            log.warning("parallel.reduce_every_microbatch has no effect under pipeline parallelism: the "
                        "schedule reduce-scatters once, after the last micro-batch")
        self.params = [p for _, p in parts.named_parameters()]
        self.fqns = [fqn for fqn, _ in parts.named_parameters()]
        groups = [{"params": [], "weight_decay": self.cfg.weight_decay}, {"params": [], "weight_decay": 0.0}]
        for fqn, p in parts.named_parameters():
            groups[0 if _decays(fqn, p) else 1]["params"].append(p)
        self.optimizer = _make_adamw(groups, self.cfg)

    def checkpoint_state(self) -> dict:
        """FSDP2's sharded parameters and AdamW state: DTensors of the global shapes."""
        ensure_adam_state(self.optimizer)
        model = dict(zip(self.fqns, self.params))
        optim = {fqn: _adam_entries(self.optimizer.state[p], lambda t: t) for fqn, p in zip(self.fqns, self.params)}
        return {"model": model, "optim": optim}

    def after_load(self) -> None:
        """Nothing to do: DCP loaded straight into the sharded parameters and state."""

    def before_backward(self, final: bool) -> None:
        """Before each micro-batch: FSDP reduce-scatters in that backward only for the last micro-batch
        (gradients accumulate unsharded until then), or for every one with
        ``parallel.reduce_every_microbatch`` (sharded accumulation: less memory, more traffic)."""
        if self.sync_each is not None:
            for m in self.modules:
                m.set_requires_gradient_sync(final or self.sync_each)

    def after_backward(self, final: bool) -> None:
        """FSDP reduce-scatters inside backward; nothing to do here."""

    def local_norm_sq(self) -> torch.Tensor:
        device = local_tensor(self.params[0]).device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for p in self.params:
            if p.grad is not None:
                total += local_tensor(p.grad).float().pow(2).sum() / dtensor_replicas(p.grad, self.dims)
        return total

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float) -> None:
        """AdamW on the local shards: torch's own AdamW arithmetic (``torch.optim.adam.adam``, foreach),
        fed each DTensor's local tensor.

        AdamW is elementwise, so updating the shards is updating the parameters. Stepping the
        DTensors themselves makes DTensor propagate the sharding of every foreach op, and a process
        that joins a new group (which must forget those decisions, ``trainer.world.forget_meshes``)
        pays for that again in its first step: 0.7-0.8 s of the tiny model's first step after
        every re-formation, measured here.
        """
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        if clip_coef < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coef)
        ensure_adam_state(self.optimizer)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
            live = [p for p in g["params"] if p.grad is not None]
            if not live:
                continue
            states = [self.optimizer.state[p] for p in live]
            adam([local_tensor(p) for p in live], [local_tensor(p.grad) for p in live],
                 [local_tensor(st["exp_avg"]) for st in states], [local_tensor(st["exp_avg_sq"]) for st in states],
                 [], [st["step"] for st in states], foreach=True, decoupled_weight_decay=True, amsgrad=False,
                 beta1=g["betas"][0], beta2=g["betas"][1], lr=lr, weight_decay=g["weight_decay"], eps=g["eps"],
                 maximize=False)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def memory_bytes(self) -> dict[str, int]:
        state = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        return {"params": _storage_bytes(self.params), "grads": _storage_bytes(p.grad for p in self.params),
                "optimizer": _storage_bytes(state)}


def build_optimizer(parts: ModelParts, cfg: RunConfig, dims: ParallelDims, mesh, rank: int):
    if parts.uses_fsdp:
        return FSDPOptimizer(parts, cfg, dims, rank)
    return ZeroOptimizer(parts, cfg, dims, mesh, rank)
