"""ZeRO stages 0, 1 and 2 over whole-parameter replicas (:class:`ZeroOptimizer`; see trainer.zero)."""

from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..config import RunConfig
from ..parallel.dims import DATA_AXES, Axis, Mesh, ParallelDims
from ..parallel.parallelize import ModelParts
from .buckets import Bucket, Slot, chunk_bounds, local_grad, make_buckets
from .collectives import all_gather, all_reduce, reduce_scatter
from .common import (
    adam_entries,
    decays,
    ensure_adam_state,
    local_tensor,
    make_adamw,
    storage_bytes,
    tp_shard_dim,
)
from .offload import make_offload, master_placeholder, offloads_master

log = logging.getLogger("etrain")


class ZeroOptimizer:
    """ZeRO stages 0, 1 and 2 over whole-parameter replicas (see module docstring)."""

    def __init__(self, parts: ModelParts, cfg: RunConfig, dims: ParallelDims, mesh, rank: int):
        self.stage = dims.zero_stage
        self.cfg = cfg.train
        self.dims = dims
        self.dp_group = dims.group(mesh, dims.loss_mesh)  # dp, x cp under context parallelism
        self.shard_group = dims.group(mesh, Mesh.DP_SHARD_CP) if self.stage > 0 else None
        self.replicate_group = dims.group(mesh, Axis.DP_REPLICATE) if self.stage > 0 else None
        self.n = dims.zero_shards
        # This rank's row in the shard group's collectives: its rank there (dp_shard x cp under context parallelism).
        self.r = dist.get_rank(self.shard_group) if self.shard_group is not None else 0
        # ZeRO++ (trainer.zero.quantize): int8 blocks in the parameter all-gather and the gradient reduce-scatter.
        pc = cfg.parallel
        self.qw_block = pc.quantization_block if pc.quantized_weights and self.stage > 0 else 0
        self.qg_block = pc.quantization_block if pc.quantized_gradients and self.stage > 0 else 0
        if (self.qw_block or self.qg_block) and self.n == 1 and rank == 0:
            log.warning("parallel.quantized_weights / quantized_gradients have no effect: the ZeRO shard group has "
                        "one rank (dp_shard=1)")
        if cfg.parallel.reduce_every_microbatch and dims.dp > 1 and rank == 0:
            log.warning("parallel.reduce_every_microbatch has no effect with zero_stage=%d: stages 0 and 1 keep "
                        "whole gradients and reduce them once per step, stage 2 reduce-scatters every "
                        "micro-batch into its shard during backward", self.stage)
        params = list(parts.named_parameters())
        self.dtype = params[0][1].dtype if params else torch.float32
        self.slots: list[Slot] = []
        offset = flat = 0
        for fqn, p in params:
            local = local_tensor(p.data)
            tpd = tp_shard_dim(p)
            dim = next((d for d in range(local.ndim) if d != tpd), 0) if local.ndim > 1 else 0
            bounds = [chunk_bounds(local.shape[dim], self.n, r) for r in range(self.n)]
            inner = local.numel() // max(1, local.shape[dim])
            width = max(L for _, L in bounds) * inner
            tp_rep = dims.tp if tpd is None else 1
            dp_rep = dims.grad_ranks if self.stage == 0 else dims.dp_replicate
            self.slots.append(Slot(fqn, p, local, dim, [b[0] for b in bounds], [b[1] for b in bounds], inner,
                                    offset, width, flat, tp_rep * dp_rep, decays(fqn, p)))
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
            # Hooks live in C++, where the garbage collector cannot see a cycle through them: a weak
            # reference lets the optimizer (its buffers, an offload file) go with its trainer.
            me = weakref.ref(self)
            for b in self.buckets:
                for s in b.slots:
                    s.param.register_post_accumulate_grad_hook(
                        lambda p, s=s, b=b: (o := me()) is not None and o._grad_arrived(s, b))
        groups = [{"params": [], "weight_decay": self.cfg.weight_decay}, {"params": [], "weight_decay": 0.0}]
        targets: dict = {}
        for s in self.slots:
            mine = s.chunk(self.r)
            if mine.numel() == 0:
                continue
            # fp32: AdamW updates the parameter in place through a view. bf16, or quantized weights (the
            # parameter then holds the all-gathered int8 values): a separate fp32 master, copied back each step.
            in_place = mine.dtype == torch.float32 and not self.qw_block
            if offloads_master(cfg, mine.dtype):  # parallel.offload_params: the master's values in the file
                s.master = master_placeholder(mine)
                targets[s.master] = mine
            else:
                s.master = nn.Parameter(mine if in_place else mine.float().clone())
            groups[0 if s.decay else 1]["params"].append(s.master)
        self.optimizer = make_adamw(groups, self.cfg)
        # parallel.offload="nvme": the state (and with offload_params the masters) in a file
        self.offload = make_offload(self.optimizer, cfg, rank, targets)
        self._masters_in_file = bool(targets)
        # Checkpoints see each chunk as a DTensor shard of the whole parameter.
        self.state_mesh = dims.sub_mesh(mesh, *DATA_AXES, Axis.TP)

    # --- checkpoints ----------------------------------------------------------

    def _as_global(self, s: Slot, chunk: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``s`` as a DTensor of the parameter's global shape."""
        if self.state_mesh is None:
            return chunk
        tp_placement = s.param.placements[0] if isinstance(s.param, DTensor) else Replicate()
        if isinstance(tp_placement, Shard) and tp_placement.dim == s.dim and self.stage > 0:
            raise NotImplementedError(f"{s.fqn}: ZeRO and tensor parallelism shard the same dim")
        placements = []
        for name in self.state_mesh.mesh_dim_names:
            if name == Axis.DP_SHARD and self.stage > 0:
                placements.append(Shard(s.dim))
            elif name == Axis.TP:
                placements.append(tp_placement)
            else:
                placements.append(Replicate())
        shape = s.param.shape
        return DTensor.from_local(chunk, self.state_mesh, placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def checkpoint_state(self) -> dict:
        """Model weights (the fp32 masters) and AdamW state, each a shard of its global tensor."""
        if self.offload is None:
            ensure_adam_state(self.optimizer)
        states = self.optimizer.state if self.offload is None else self.offload.states()
        model, optim = {}, {}
        for s in self.slots:
            if s.master is None:
                continue
            model[s.fqn] = self._as_global(s, states[s.master]["master"] if self._masters_in_file else s.master)
            optim[s.fqn] = adam_entries(states[s.master], lambda t, s=s: self._as_global(s, t))
        return {"model": model, "optim": optim}

    @torch.no_grad()
    def after_load(self) -> None:
        """Loaded masters -> parameters, then every rank gets every chunk."""
        if self._masters_in_file:
            self.offload.load_masters()
        for s in self.slots if not self._masters_in_file else []:
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
    def _flat_view(flat: torch.Tensor, s: Slot) -> torch.Tensor:
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
            lg = local_grad(s.param, s.param.grad)
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
                self.grad_shard.div_(self.dims.grad_ranks)
        elif final:
            self._adopt_stray_grads()
            if self.stage == 0:
                self._all_reduce_grads()
            else:
                self._reduce_scatter_grads()
        self._scratch = None
        if final:
            self._set_master_grads()

    def _grad_arrived(self, s: Slot, b: Bucket) -> None:
        """Stage 2's hook, once autograd has accumulated ``s``'s gradient: reduce its bucket when complete."""
        if not s.arrived:
            s.arrived = True
            b.ready += 1
        if b.ready == len(b.slots):
            self._reduce_into_shard(b)

    def _reduce_into_shard(self, b: Bucket) -> None:
        """Stage 2: reduce-scatter one bucket's gradients (then dropped) and add this rank's chunks to the shard."""
        grads = [None if s.param.grad is None else local_grad(s.param, s.param.grad) for s in b.slots]
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

    def _bucket_buffers(self, b: Bucket, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` rows of ``hi - lo`` and one more, views of one scratch buffer sized for the largest bucket
        and reused bucket after bucket until the phase ends (gloo lets go of a collective's tensors from
        its worker thread, later: fresh buffers per bucket could pile up)."""
        if self._scratch is None or self._scratch.dtype != dtype:
            width = max(c.hi - c.lo for c in self.buckets)
            self._scratch = torch.empty((self.n + 1) * width, dtype=dtype, device=self._device())
        w = b.hi - b.lo
        return self._scratch[: self.n * w].view(self.n, w), self._scratch[self.n * w : (self.n + 1) * w]

    def _pack(self, b: Bucket, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
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
            reduce_scatter(out, packed.view(-1), self.shard_group, self.qg_block)
        else:
            out.copy_(packed.view(-1))

    def _all_reduce_grads(self) -> None:
        """Stage 0: all-reduce the whole gradients, in fp32 (in place when they are fp32)."""
        reduced = self.flat_grad if self.flat_grad.dtype == torch.float32 else self.flat_grad.float()
        if self.dp_group is not None:
            all_reduce(reduced, self.dp_group)
        reduced.div_(self.dims.grad_ranks)
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
            out.div_(self.dims.grad_ranks)
            for s in b.slots if in_place else []:
                if s.lengths[self.r]:
                    self._my_chunk(self.flat_grad, s).copy_(b.region(out, s, self.r))
        self._reduced = self.flat_grad if in_place else None

    def _my_chunk(self, flat: torch.Tensor, s: Slot) -> torch.Tensor:
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
        (self.optimizer if self.offload is None else self.offload).step()
        for s in self.slots if not self._masters_in_file else []:  # else the update wrote the parameters
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
            all_gather(full.view(-1), mine, self.shard_group, self.qw_block)
            for s in b.slots:
                for r in range(self.n):
                    # Quantized, this rank too takes its chunk as every other rank received it.
                    if (r != self.r or self.qw_block) and s.lengths[r]:
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
        params = storage_bytes(s.local for s in self.slots)
        held = [self.flat_grad, self.grad_shard, self._reduced] + [s.param.grad for s in self.slots if self.stage == 2]
        grads = storage_bytes(held)
        state = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        masters = [s.master for s in self.slots if s.master is not None
                   and s.master.data_ptr() != s.chunk(self.r).data_ptr()]
        held = self.offload.host_bytes if self.offload is not None else 0  # its buffers; the state is in a file
        return {"params": params, "grads": grads, "optimizer": storage_bytes(state) + storage_bytes(masters) + held}
