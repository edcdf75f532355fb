"""Per-rank memory for parameters, gradients and optimizer state: predicted, held, and peak in a step.

    predicted = predict(cfg, dims, rank, mixed)         # before anything is built
    held = optimizer.memory_bytes()                     # on the live run, after a step
    with StepMemory(parts.modules, optimizer.optimizer) as mem:
        trainer.train_step()                            # mem.peak_bytes: the most held at once, during it

The prediction is the ZeRO paper's accounting (Rajbhandari et al., 2020),
applied to the parameters this rank holds after tensor and pipeline
parallelism (``P``), with ``N`` the size of the sharding axis (dp_shard):

=========  ==================  ==================  ===================
stage      parameters          gradients           optimizer state
=========  ==================  ==================  ===================
fp32 (CPU default): 4 + 4 + 8 bytes per parameter (AdamW m and v)
0          4P                  4P                  8P
1          4P                  4P                  8P / N
2          4P                  4P / N              8P / N
3          4P / N              4P / N              8P / N
bf16 (GPU default): 2 + 2 + 12 bytes per parameter (fp32 master, m, v)
0          2P                  2P + 4P             12P
1          2P                  2P + 4P / N         12P / N
2          2P                  4P / N              12P / N
3          4P / N              4P / N              8P / N
=========  ==================  ==================  ===================

Departures from the paper, all in mixed precision: gradients are reduced in
fp32, and what is reduced stays fp32 for AdamW on the fp32 masters (stage 0:
the whole reduced gradients beside the bf16 ones; stage 1: this rank's reduced
chunk; stage 2: the shard itself); stage 3 is FSDP2, whose sharded parameters
are themselves the fp32 master copy (plus transient bf16 copies of the blocks
being computed). :func:`paper_bytes_per_param` is the paper's own table.

The prediction leaves out activations and transient buffers. :class:`StepMemory`
measures what a step really holds at its peak, transients included: stages 1
and 2 add about one bucket (``parallel.bucket_mb``) of packed gradients or
gathered parameters; stage 2 also holds the whole gradients of the bucket
being filled.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import RunConfig
from ..models import spec_for
from ..parallel.dims import ParallelDims


def local_counts(cfg: RunConfig, dims: ParallelDims, rank: int) -> tuple[int, int]:
    """(parameters of one block, parameters this rank holds) after tensor and pipeline parallelism: the
    model's shape asked (:meth:`trainer.models.shape.ModelShape.local_counts`)."""
    n_stages, stages = dims.stages(rank, cfg.parallel.pp_stages_per_rank)
    return spec_for(cfg.model).shape().local_counts(dims.tp, stages, n_stages)


def local_param_count(cfg: RunConfig, dims: ParallelDims, rank: int) -> int:
    """Parameters this rank holds after tensor and pipeline parallelism, before ZeRO."""
    return local_counts(cfg, dims, rank)[1]


def bytes_per_param(stage: int, n: int, mixed: bool) -> dict[str, float]:
    """Bytes per local parameter for a ZeRO stage sharded ``n`` ways, as this trainer holds them."""
    if mixed:
        table = {0: (2, 2 + 4, 12), 1: (2, 2 + 4 / n, 12 / n), 2: (2, 4 / n, 12 / n), 3: (4 / n, 4 / n, 8 / n)}
    else:
        table = {0: (4, 4, 8), 1: (4, 4, 8 / n), 2: (4, 4 / n, 8 / n), 3: (4 / n, 4 / n, 8 / n)}
    p, g, o = table[stage]
    return {"params": p, "grads": g, "optimizer": o}


def paper_bytes_per_param(stage: int, n: int, mixed: bool) -> float:
    """The ZeRO paper's total bytes per parameter: 16, 4 + 12/N, 2 + 14/N, 16/N in mixed precision
    (bf16 parameters and gradients, fp32 master, m and v); the fp32 analogues (4 + 4 + 8) otherwise."""
    if mixed:
        return {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]
    return {0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]


def predict(cfg: RunConfig, dims: ParallelDims, rank: int, mixed: bool = False) -> dict[str, int]:
    """Predicted bytes on ``rank`` for parameters, gradients and optimizer state."""
    stage, n = dims.zero_stage, dims.zero_shards
    count = local_param_count(cfg, dims, rank)
    per = bytes_per_param(stage, n, mixed)
    if not mixed and stage in (1, 2) and cfg.parallel.quantized_weights:
        per["optimizer"] += 4 / n  # qwZ: the fp32 master is a copy (the parameter holds the dequantized values)
    # Expert parallelism below ZeRO-3: the experts (of this rank's stages) are FSDP's (trainer.zero.hybrid),
    # sharded over all of dp_shard (x cp).
    n_stages, stages = dims.stages(rank, cfg.parallel.pp_stages_per_rank)
    experts = spec_for(cfg.model).shape().stage_experts(stages, n_stages) if dims.ep > 1 and stage < 3 else 0
    fsdp = bytes_per_param(3, dims.shard_ranks, mixed)
    return {k: round(v * (count - experts) + fsdp[k] * experts) for k, v in per.items()}


def compare(predicted: dict[str, int], measured: dict[str, int]) -> dict[str, float]:
    """measured / predicted per kind (1.0 = exact)."""
    return {k: (measured[k] / predicted[k] if predicted[k] else float("nan")) for k in predicted}


def transient_bytes(cfg: RunConfig, dims: ParallelDims, rank: int, mixed: bool, bucket_bytes: int) -> int:
    """What a step holds at its peak beyond :func:`predict`'s figures, by design.

    Stage 0: nothing (the all-reduce is in place, or into the fp32 gradients it keeps). Stages 1
    and 2: one bucket, ``bucket_bytes`` (the optimizer's: packed fp32 gradients, or gathered
    parameters). Stage 3 (FSDP2, no pipeline): the gathered parameters of the root group and of
    two blocks (the one in backward and the one prefetched), and one block's unsharded gradients
    with their fp32 reduce-scatter copy; under pipeline parallelism every gathered parameter
    stays until the last backward."""
    stage = dims.zero_stage
    if stage in (1, 2):
        return bucket_bytes
    if stage < 3:
        return 0
    block, total = local_counts(cfg, dims, rank)
    n_blocks = spec_for(cfg.model).shape().n_layers // dims.stages(rank, cfg.parallel.pp_stages_per_rank)[0]
    p = 2 if mixed else 4
    gathered = total if dims.pp > 1 else total - max(0, n_blocks - 2) * block
    return p * gathered + (p + 4) * block


def measure_step(trainer) -> dict:
    """Train one step of ``trainer`` (a :class:`trainer.loop.Trainer`) under :class:`StepMemory`.

    Its peak with its split (:meth:`StepMemory.result`), beside ``formula_bytes`` (:func:`predict`'s
    sum), ``transient_bytes``, ``paper_bytes`` (the ZeRO paper's total), ``grad_bytes`` (the whole
    gradients in the parameters' dtype), the step's ``loss`` and ``seconds``."""
    cfg, dims, rank, opt = trainer.cfg, trainer.dims, trainer.world.rank, trainer.optimizer
    t0 = time.monotonic()
    with StepMemory(trainer.parts.modules, opt.optimizer) as mem:
        stats = trainer.train_step()
    seconds = time.monotonic() - t0
    stage = dims.zero_stage
    count = local_param_count(cfg, dims, rank)
    formula = predict(cfg, dims, rank, trainer.mixed)
    bucket = getattr(opt, "bucket_bytes", 0)
    return {**mem.result(), "loss": stats.loss, "seconds": seconds, "param_count": count, "formula": formula,
            "formula_bytes": sum(formula.values()), "bucket_bytes": bucket,
            "transient_bytes": transient_bytes(cfg, dims, rank, trainer.mixed, bucket),
            "paper_bytes": round(count * paper_bytes_per_param(stage, dims.dp_shard, trainer.mixed)),
            "grad_bytes": count * (2 if trainer.mixed else 4)}


# --- measured during a step ----------------------------------------------------------------

KINDS = ("params", "grads", "optimizer")
# Who wins when a storage plays several parts (an fp32 master that is a view of its parameter is a
# parameter); a kind taken from a data-moving op (rank 1) never overrides one of these.
_ROLE_RANK = {"optimizer": 2, "grads": 3, "params": 4}
# Ops that move data without computing on it: a buffer they fill from a parameter, gradient or
# optimizer-state storage holds that kind of data (packed gradients, gathered parameters).
_MOVES = {"copy_", "_to_copy", "clone", "cat", "_chunk_cat", "chunk_cat", "stack", "split_with_sizes_copy",
          "_foreach_copy_", "_foreach_copy", "index_put_", "index_copy_", "slice_scatter", "select_scatter",
          "narrow_copy", "lift_fresh_copy", "view_copy", "as_strided_copy"}
_MOVE_NAMESPACES = {"c10d", "_c10d_functional", "fsdp"}


def _storage(t: torch.Tensor):
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


class StepMemory(TorchDispatchMode):
    """Live bytes of parameters, gradients and optimizer state, followed op by op while code runs.

        with StepMemory(trainer.parts.modules, trainer.optimizer.optimizer) as mem:
            trainer.train_step()
        mem.result()   # peak_bytes (of their sum), at_peak (its split), max_by_kind, total_peak_bytes

    Every storage an op reads or writes is followed until it is freed (a finalizer on the
    storage). Its kind, checked before every op: **params** if it backs a parameter of
    ``modules`` as registered at that moment (FSDP's gathered parameters count while they
    exist), **grads** if it backs the ``.grad`` of one of those or of a parameter ``optimizer``
    updates, **optimizer** if it backs the optimizer's state or a parameter it updates that is
    no model parameter (fp32 masters). A buffer that a data-moving op (copy, conversion,
    concatenation, a collective) fills from one of those takes its kind: the packed, converted
    and reduced gradient buffers, the gathered parameters. Everything else (activations, their
    gradients, temporaries of arithmetic) is **other**, counted only in ``total_peak_bytes``.
    Granularity is the op: temporaries inside one op and buffers of the communication library
    are not seen.
    """

    def __init__(self, modules, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.param_slots = [(m, name) for root in modules for m in root.modules() for name in m._parameters]
        self.optimizer = optimizer
        # FSDP frees and refills its gathered parameters by resizing their storages, which no op shows.
        self.resizing = any(isinstance(m, FSDPModule) for root in modules for m in root.modules())
        self.live: dict[int, list] = {}  # storage key -> [kind, rank, nbytes, weak storage]
        self.finalizers: list[weakref.finalize] = []
        self.now = dict.fromkeys((*KINDS, "other"), 0)
        self.peak_bytes = 0  # max over time of params + grads + optimizer
        self.at_peak = dict.fromkeys(KINDS, 0)
        self.max_by_kind = dict.fromkeys((*KINDS, "other"), 0)
        self.total_peak_bytes = 0  # max over time of everything followed, activations included
        self._schemas: dict = {}
        self._n_state = -1
        self._masters: list = []
        self._params: list | None = None
        self._param_ids: list[int] | None = None
        self._grad_ids: list[int] | None = None
        self._resizable: dict[int, list] = {}  # entries of parameter storages, when FSDP resizes them

    def __enter__(self):
        self._poll()
        self._update_peak()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for f in self.finalizers:
            f.detach()

    def result(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "at_peak": dict(self.at_peak),
                "max_by_kind": dict(self.max_by_kind), "total_peak_bytes": self.total_peak_bytes}

    # --- following storages --------------------------------------------------------------

    def _see(self, t, kind: str = "other", rank: int = 0) -> str:
        """Follow ``t``'s storage; give it ``kind`` unless it has one of a higher ``rank``. Its kind after."""
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":  # a meta tensor holds no memory
            return "other"
        st = _storage(t)
        key = st._cdata
        e = self.live.get(key)
        if e is None:
            n = st.nbytes()
            e = self.live[key] = ["other", 0, n, weakref.ref(st)]
            self.now["other"] += n
            self.finalizers.append(weakref.finalize(st, self._freed, key, e))
        if rank > e[1]:
            self.now[e[0]] -= e[2]
            self.now[kind] += e[2]
            e[0], e[1] = kind, rank
        return e[0]

    def _freed(self, key: int, e: list) -> None:
        if self.live.get(key) is e:
            del self.live[key]
            self.now[e[0]] -= e[2]

    def _poll(self) -> None:
        """Give this moment's parameters, gradients and optimizer state their kinds.

        Runs before every op, so it only compares object ids with the last poll's and looks at what
        changed (a new ``.grad``, FSDP swapping gathered parameters in)."""
        opt = self.optimizer
        if len(opt.state) != self._n_state:  # AdamW creates its state at the first step
            self._n_state = len(opt.state)
            self._masters = [p for g in opt.param_groups for p in g["params"]]
            for t in self._masters + [t for st in opt.state.values() for t in st.values()]:
                self._see(t, "optimizer", _ROLE_RANK["optimizer"])
        if self.resizing or self._params is None:
            params = [m._parameters[name] for m, name in self.param_slots]
            ids = list(map(id, params))
            if ids != self._param_ids:
                for p in params:
                    if self._see(p, "params", _ROLE_RANK["params"]) == "params":
                        e = self.live[_storage(p)._cdata]
                        self._resizable[id(e)] = e
                self._params, self._param_ids = [p for p in params if p is not None], ids
            for e in self._resizable.values():  # FSDP frees and refills gathered parameters by resizing
                st = e[3]()
                if st is not None and st.nbytes() != e[2]:
                    self.now[e[0]] += st.nbytes() - e[2]
                    e[2] = st.nbytes()
        owners = self._params + self._masters
        grads = [p.grad for p in owners]
        ids = list(map(id, grads))
        if ids != self._grad_ids:
            last = self._grad_ids if self._grad_ids and len(self._grad_ids) == len(ids) else [None] * len(ids)
            for g, i, old in zip(grads, ids, last):
                if i != old and g is not None:
                    self._see(g, "grads", _ROLE_RANK["grads"])
            self._grad_ids = ids

    def _update_peak(self) -> None:
        now = self.now
        ours = now["params"] + now["grads"] + now["optimizer"]
        if ours > self.peak_bytes:
            self.peak_bytes = ours
            self.at_peak = {k: now[k] for k in KINDS}
        for k, v in now.items():
            if v > self.max_by_kind[k]:
                self.max_by_kind[k] = v
        self.total_peak_bytes = max(self.total_peak_bytes, ours + now["other"])

    # --- the op hook -----------------------------------------------------------------------

    def _schema(self, func) -> tuple[list[str], set[str], bool]:
        """``func``'s argument names, those it writes into, and whether it only moves data."""
        got = self._schemas.get(func)
        if got is None:
            ns, args = func.namespace, func._schema.arguments
            written = {a.name for a in args if (a.alias_info is not None and a.alias_info.is_write)
                       or (ns == "c10d" and a.name.startswith("output"))}
            moves = ns in _MOVE_NAMESPACES or func.overloadpacket.__name__ in _MOVES
            got = self._schemas[func] = ([a.name for a in args], written, moves)
        return got

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._poll()
        out = func(*args, **kwargs)
        names, written, moves = self._schema(func)
        sources, dests = [], _tensors(out)
        for name, a in [*zip(names, args), *kwargs.items()]:
            (dests if name in written else sources).extend(_tensors(a))
        kinds = {self._see(t) for t in sources}
        # What a data-moving op fills from gradients is gradients, even if parameters are among its
        # sources; a buffer written in place (or out=) from gradients is too (DDP's scaled bucket copy).
        kind = next((k for k in ("grads", "params", "optimizer") if k in kinds), "other") if moves else "other"
        if kind == "other" and written and "grads" in kinds:
            kind, dests = "grads", [t for name, a in [*zip(names, args), *kwargs.items()] if name in written
                                    for t in _tensors(a)]
        for t in dests:
            self._see(t, kind, 1 if kind != "other" else 0)
        self._update_peak()
        return out
