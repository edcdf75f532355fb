"""AdamW's state on NVMe (``[parallel] offload = "nvme"``): every ZeRO stage keeps exp_avg and exp_avg_sq in a
file per rank and stream them through a fixed pool of host buffers during the step.

    offload_preflight(cfg, world_size, rank)        # before any process group: the directory and its room
    state = NvmeAdamState(optimizer, cfg, rank)     # optimizer: the torch AdamW over this rank's fp32 masters
    state.step()                                    # instead of optimizer.step(): the same arithmetic
    states = state.states()                         # {master: {"exp_avg", "exp_avg_sq", "step"}}: checkpoints

The file (``<offload_dir>/<run_id>/rank<k>/adam-<pid>-<n>.f32``) holds every master's exp_avg, in
parameter order, then every exp_avg_sq. The step cuts that order into units of at most a buffer's
worth (a parameter larger than that is cut into flat pieces when it is contiguous) and runs
:class:`trainer.zero.swapper.Swapper` over them: the next unit is read and the previous one written
back while AdamW updates the current one. AdamW is elementwise, so updating in pieces is the same
arithmetic as one call over every parameter (the tests check bitwise equality with ``offload="none"``);
the step counts live in memory. :meth:`NvmeAdamState.states` maps the file (``torch.from_file``):
a checkpoint, the memory tier and a load read and write the state in place, like in-memory state,
and copy it (a checkpoint never refers to the file). The file is scratch: a new optimizer starts
from a new one (zeros, AdamW's initial state) and removes it when it goes; files that a dead process
left behind are removed when the next one starts in that directory.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import shutil
import weakref

import torch
from torch.optim.adam import adam

from checkpointing.errors import ConfigError

from ..config import RunConfig
from ..models.spec import dtensor_like
from .common import local_tensor
from .swapper import F32, BufferPool, StateFile, Swapper, SwapStats

log = logging.getLogger("etrain")
BUFFERS = 4  # host buffers in the pool: one computed on, one being written back, two read ahead
_SEQ = itertools.count()
_NAME = re.compile(r"adam-(\d+)-\d+\.f32")


def unit_numel(buffer_mb: float) -> int:
    """fp32 elements per buffer of a pool of ``buffer_mb`` MiB: half a unit's exp_avg, half its exp_avg_sq."""
    return max(2, int(buffer_mb * 2**20 / F32 / BUFFERS) // 2 * 2)


def rank_dir(cfg: RunConfig, rank: int) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(cfg.parallel.offload_dir)), cfg.run_id, f"rank{rank}")


def state_bytes(cfg: RunConfig, world_size: int, rank: int) -> int:
    """What ``rank``'s file holds: exp_avg and exp_avg_sq of its share of the parameters, and with
    ``parallel.offload_params`` their fp32 masters (counted whatever the precision: the most it can be)."""
    from ..observe.device_memory import local_param_count
    from ..parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg, world_size)
    count = local_param_count(cfg, dims, rank)
    return (3 if cfg.parallel.offload_params else 2) * F32 * -(-count // dims.zero_shards)


def offload_preflight(cfg: RunConfig, world_size: int, rank: int) -> None:
    """ConfigError (exit 2) naming parallel.offload_dir when this rank cannot write its directory or its
    disk lacks room for the state (every local rank's, when LOCAL_WORLD_SIZE says how many share it)."""
    if cfg.parallel.offload != "nvme":
        return
    where = rank_dir(cfg, rank)
    key = f"parallel.offload_dir={cfg.parallel.offload_dir!r}"
    try:
        make_rank_dir(cfg, rank)
        probe = os.path.join(where, f".probe-{os.getpid()}")
        fd = _open_new(probe, key)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{key} is not writable ({where}: {e.strerror or e}); point it at a local directory "
                          "this user may write") from None
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    need = state_bytes(cfg, world_size, rank) * local_ranks
    free = shutil.disk_usage(where).free
    if free < need:
        raise ConfigError(
            f"{key} has {free / 2**20:.1f} MiB free, and the optimizer state offloaded there needs "
            f"{need / 2**20:.1f} MiB ({local_ranks} rank(s) of {state_bytes(cfg, world_size, rank) / 2**20:.1f} MiB); "
            "point it at a disk with that much room, or shard the state over more ranks (parallel.zero_stage >= 1)")


def _open_new(path: str, key: str) -> int:
    """A new file at ``path`` to write, made exclusively and never through a link (a name planted in a shared
    offload_dir, a symbolic link to another's file, is refused: ConfigError naming it)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        what = "a symbolic link" if os.path.islink(path) else "there already"
        raise ConfigError(f"{key}: {path} is {what}, not made by this run; refused (nothing is written through "
                          "a name someone else made: remove it, or point parallel.offload_dir at a directory "
                          "of your own)") from None


def make_rank_dir(cfg: RunConfig, rank: int) -> str:
    """:func:`rank_dir`, made if missing, each of ``<offload_dir>/<run_id>`` and its ``rank<k>`` entered without
    following a link: in a shared offload_dir another user could point one at someone else's files
    (ConfigError naming it). The offload_dir itself may be a link (the user's own choice)."""
    where = rank_dir(cfg, rank)
    run = os.path.dirname(where)
    os.makedirs(os.path.dirname(run), exist_ok=True)
    for path in (run, where):
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
        except OSError as e:
            if not os.path.islink(path) and e.errno != errno.ENOTDIR:
                raise
            what = "a symbolic link" if os.path.islink(path) else "not a directory"
            raise ConfigError(f"parallel.offload_dir={cfg.parallel.offload_dir!r}: {path} is {what}; refused (remove "
                              "it, or point parallel.offload_dir at a directory of your own)") from None
    return where


def _remove_stale(where: str) -> None:
    """Files of processes that are gone (a crash leaves its scratch behind)."""
    for name in os.listdir(where):
        m = _NAME.fullmatch(name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(where, name))
            except FileNotFoundError:
                pass
        except PermissionError:
            pass


def _flat(t: torch.Tensor, lo: int, hi: int, whole: bool) -> torch.Tensor:
    return t if whole else t.view(-1)[lo:hi]


class NvmeAdamState:
    """exp_avg and exp_avg_sq of ``optimizer``'s parameters in a per-rank file (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: RunConfig, rank: int,
                 targets: dict | None = None):
        """``targets``: with ``parallel.offload_params``, each master's (bf16) parameter chunk; the masters
        are then placeholders (:func:`master_placeholder`) and their fp32 values live in the file."""
        self.optimizer = optimizer
        self.targets = targets or {}
        self.regions = 3 if self.targets else 2  # exp_avg, exp_avg_sq[, master]
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        # ZeRO-3's parameters are DTensors: the file holds their local shards
        self.local = {p: local_tensor(p) for p in self.params}
        self.group_of = {p: gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.offset: dict[torch.Tensor, int] = {}
        at = 0
        for p in self.params:
            self.offset[p] = at
            at += self.local[p].numel()
        self.total = at
        on_device = [g.get("fused") or g.get("capturable") for g in optimizer.param_groups]
        self.steps = {p: torch.zeros((), dtype=torch.float32,
                                     device=self.local[p].device if on_device[self.group_of[p]] else None)
                      for p in self.params}
        numel = unit_numel(cfg.parallel.offload_buffer_mb)
        self.capacity = numel // self.regions  # parameter elements per unit: exp_avg, exp_avg_sq[, master]
        self.units, self.pieces = self._plan(cfg)
        where = make_rank_dir(cfg, rank)
        _remove_stale(where)
        self.file = StateFile(os.path.join(where, f"adam-{os.getpid()}-{next(_SEQ)}.f32"), self.regions * self.total)
        for p, chunk in self.targets.items():  # the masters' first values: their parameters, in fp32
            self.file.write_from(2 * self.total + self.offset[p], chunk.detach().float().cpu().contiguous().view(-1))
        self.pool = BufferPool(BUFFERS, numel, pin=torch.cuda.is_available())
        self.swapper = Swapper(self.file, self.pool)
        self.last = SwapStats()  # the last step's I/O
        self.total_stats = SwapStats()
        self._finalizer = weakref.finalize(self, self.swapper.close)

    def _plan(self, cfg: RunConfig) -> tuple[list, list]:
        """Units of consecutive elements, each at most ``capacity``; per unit its pieces
        ``(param, lo, hi, at)``: elements lo..hi of param at ``at`` in the unit."""
        units, pieces = [], []
        cur: list = []
        start = used = 0
        for p in self.params:
            n, lo = self.local[p].numel(), 0
            contiguous = self.targets.get(p, self.local[p]).is_contiguous()
            if n > self.capacity and not contiguous:
                raise ConfigError(
                    f"parallel.offload_buffer_mb={cfg.parallel.offload_buffer_mb} is too small for a parameter "
                    f"chunk of {n} elements ({2 * F32 * n * BUFFERS / 2**20:.1f} MiB of buffers needed); raise it")
            while lo < n:
                if used == self.capacity or (n - lo > self.capacity - used and not contiguous):
                    units.append((start, used))
                    pieces.append(cur)
                    cur, start, used = [], start + used, 0
                hi = min(n, lo + self.capacity - used)
                cur.append((p, lo, hi, used))
                used += hi - lo
                lo = hi
        if used:
            units.append((start, used))
            pieces.append(cur)
        return [[(r * self.total + a, n) for r in range(self.regions)] for a, n in units], pieces

    def close(self) -> None:
        self._finalizer()

    @property
    def host_bytes(self) -> int:
        """Host memory the offloaded state costs: the buffer pool (and the step counts)."""
        return self.pool.nbytes + 4 * len(self.steps)

    # --- the update ------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> SwapStats:
        """AdamW over every parameter with a gradient, its state swapped in unit by unit."""
        groups = self.optimizer.param_groups
        self.last = self.swapper.run(self.units, lambda k, buf: self._update(self.pieces[k], buf, groups))
        for p in self.params:
            if p.grad is not None:
                self.steps[p] += 1
        self.total_stats.add(self.last)
        return self.last

    def _update(self, pieces: list, buf: torch.Tensor, groups: list[dict]) -> None:
        n = buf.numel() // self.regions
        host = buf
        device = self.local[pieces[0][0]].device
        if device.type != "cpu":
            buf = buf.to(device, non_blocking=True)
        m_all, v_all, w_all = buf[:n], buf[n : 2 * n], buf[2 * n :]
        lists: dict[int, tuple[list, ...]] = {}
        for p, lo, hi, at in pieces:
            if p.grad is None:
                continue
            lp, grad = self.local[p], local_tensor(p.grad)
            whole = hi - lo == lp.numel()
            m, v = m_all[at : at + hi - lo], v_all[at : at + hi - lo]
            ps, gs, ms, vs, ss = lists.setdefault(self.group_of[p], ([], [], [], [], []))
            if self.targets:  # the master from the file, updated in the buffer
                w = w_all[at : at + hi - lo]
                ps.append(w.view(lp.shape) if whole else w)
            else:
                ps.append(_flat(lp, lo, hi, whole))
            gs.append(grad if whole else grad.reshape(-1)[lo:hi])  # adam() only reads gradients
            ms.append(m.view(lp.shape) if whole else m)
            vs.append(v.view(lp.shape) if whole else v)
            ss.append(self.steps[p].clone())  # adam() counts it up; the step's own += 1 comes after every unit
        for gi, (ps, gs, ms, vs, ss) in lists.items():
            g = groups[gi]
            beta1, beta2 = g["betas"]
            adam(ps, gs, ms, vs, [], ss, foreach=g["foreach"], fused=g["fused"], capturable=g["capturable"],
                 differentiable=False, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                 lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=g["maximize"])
        for p, lo, hi, at in pieces if self.targets else []:  # updated masters -> the (bf16) parameters
            if p.grad is not None:
                whole = hi - lo == p.numel()
                w = w_all[at : at + hi - lo]
                _flat(self.targets[p], lo, hi, whole).copy_(w.view(p.shape) if whole else w)
        if device.type != "cpu":
            host.copy_(buf)  # synchronous: the writer thread reads the host buffer next

    # --- checkpoints -------------------------------------------------------------------

    def states(self) -> dict:
        """Per parameter, AdamW's state as the checkpoint sees it: views of the memory-mapped file (read
        and loaded in place), and the step count."""
        if not self.total:  # a rank whose chunks are all empty
            return {}
        mapped = self.file.mapped()
        out = {}
        for p in self.params:
            a, n, shape = self.offset[p], self.local[p].numel(), self.local[p].shape
            # a DTensor parameter's state: the same sharding
            out[p] = {"exp_avg": dtensor_like(p, mapped[a : a + n].view(shape)),
                      "exp_avg_sq": dtensor_like(p, mapped[self.total + a : self.total + a + n].view(shape)),
                      "step": self.steps[p],
                      **({"master": mapped[2 * self.total + a : 2 * self.total + a + n].view(shape)}
                         if self.targets else {})}
        return out

    @torch.no_grad()
    def load_masters(self) -> None:
        """The file's masters (after a checkpoint loaded into them) -> the parameters."""
        if self.targets:
            states = self.states()
            for p, chunk in self.targets.items():
                chunk.copy_(states[p]["master"])


def offloads_master(cfg: RunConfig, dtype: torch.dtype) -> bool:
    """Whether a parameter of ``dtype`` keeps its fp32 master in the file (``parallel.offload_params``)."""
    return cfg.parallel.offload == "nvme" and cfg.parallel.offload_params and dtype != torch.float32


def master_placeholder(chunk: torch.Tensor) -> torch.nn.Parameter:
    """A master whose values live in the file: its shape (for its gradient), one fp32 element of memory."""
    return torch.nn.Parameter(torch.zeros((), dtype=torch.float32, device=chunk.device).expand(chunk.shape))


def make_offload(optimizer: torch.optim.Optimizer, cfg: RunConfig, rank: int,
                 targets: dict | None = None) -> NvmeAdamState | None:
    """The NVMe-resident state of ``optimizer`` under ``parallel.offload="nvme"``, else None."""
    if cfg.parallel.offload_params and not targets and rank == 0:
        log.warning("parallel.offload_params=true has no effect here: in fp32, and under ZeRO-3 (FSDP2's sharded "
                    "parameters), the fp32 masters are the parameters themselves (it offloads ZeRO 0-2's separate "
                    "masters of bf16 training)")
    return NvmeAdamState(optimizer, cfg, rank, targets) if cfg.parallel.offload == "nvme" else None
