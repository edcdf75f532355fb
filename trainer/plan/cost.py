"""Device profiles and the step-time model: compute from a FLOP rate, communication from bandwidth and latency.

    dev = DEVICES["h100"]                                  # or custom(...), or a calibrated profile
    t = step_time(cfg, dims, rank, dev)                    # {"compute_s", "bubble", "comm_s", "exposed_s", "step_s"}

Compute: ``6 N T`` FLOPs for ``N`` parameters this rank computes with over ``T`` tokens it sees per
step (Kaplan et al. 2020; forward 2, backward 4), ``+ 2 N T`` for the blocks it recomputes under
activation checkpointing, plus attention's ``6 s`` FLOPs per token per layer and width (its
``QK^T`` and ``AV``, causal: half of Narayanan et al. 2021's ``12 s h``), at the profile's
achieved rate (peak x efficiency, or the calibrated rate; on the CPU profile the host's rate, shared
by the ranks it runs). Under context parallelism a rank sees ``seq / cp`` positions of each sample,
each attending the whole sequence. A pipeline stretches it by the bubble.

Communication: each collective of :func:`trainer.plan.comm.step_comm` takes ``bytes / bandwidth +
calls x hops x latency`` (a ring's hops: 2 (n - 1) for an all-reduce, n - 1 for an all-gather or a
reduce-scatter, 1 for a send/recv) on its axis's link class (on a CPU host running more ranks than
it has cores, each call takes the calibrated ``crowded_call_s`` instead of its hops' latency: the
ranks wait for the scheduler, not the wire): an axis whose group fits in one node
(``--gpus-per-node``) uses the intra-node figures (NVLink), else the inter-node ones (the NIC per GPU).
Ranks are laid out as :class:`trainer.parallel.dims.ParallelDims` lays them out: tp innermost, then
dp_shard, dp_replicate, pp. Exposed communication: all of it, except the collectives marked
``overlaps="compute"``, which hide behind one micro-batch's computation and count only past it.
On a shared host (the CPU profile) nothing overlaps: gloo moves the bytes on the same cores that
compute, so every collective is exposed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..config import RunConfig
from ..models import spec_for
from ..observe.device_memory import local_counts
from ..parallel.dims import Axis, ParallelDims
from .comm import bubble_fraction, step_comm

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """A device kind: memory, achieved FLOP rate, links (bus bandwidth in bytes/s, latency in s)."""

    name: str
    memory: int
    peak_flops: float
    efficiency: float  # achieved / peak on a transformer step (model FLOPs utilization)
    intra_bw: float
    inter_bw: float
    intra_lat: float
    inter_lat: float
    gpus_per_node: int = 8
    mixed: bool = True  # bf16 compute with fp32 masters (GPUs); fp32 on the CPU
    shared_host: bool = False  # the CPU: the ranks of one node share its cores and so its FLOP rate
    cores: int = 0  # shared_host: the host's cores (0: not known)
    crowded_call_s: float = 0.0  # shared_host: one collective's time when the host runs more ranks than cores
    calibrated: str = ""  # where a calibrated profile came from

    @property
    def flops(self) -> float:
        return self.peak_flops * self.efficiency

    def to_dict(self) -> dict:
        return asdict(self)


# Peak dense bf16 FLOP/s from the vendors' data sheets (H100 SXM 989 TFLOP/s, A100 312); NVLink bus
# bandwidth as nccl-tests all_reduce reach on 8 GPUs (about 80% of 450 and 300 GB/s per direction);
# one 400 Gb/s (H100) or 200 Gb/s (A100) InfiniBand NIC per GPU at about 80%. Efficiency 0.4: the
# MFU TorchTitan and Megatron-LM report for Llama-class training at these sizes. The CPU figures are
# placeholders for `etrain plan --calibrate`, which measures them (gloo over loopback); a CPU "node" is
# one host running gpus_per_node training processes, each with its share of the host's memory.
DEVICES: dict[str, Device] = {
    "h100": Device("h100", 80 * GiB, 989e12, 0.4, 360e9, 40e9, 5e-6, 15e-6),
    "a100": Device("a100", 80 * GiB, 312e12, 0.4, 240e9, 20e9, 5e-6, 15e-6),
    "cpu": Device("cpu", 16 * GiB, 100e9, 0.3, 1e9, 1e9, 100e-6, 100e-6, gpus_per_node=4, mixed=False,
                  shared_host=True),
}


def custom(base: Device, **changes) -> Device:
    """``base`` with the given fields replaced (the command line's --device-memory, --intra-node-bw, ...)."""
    return replace(base, **{k: v for k, v in changes.items() if v is not None})


def axis_span(dims: ParallelDims, axis: str, ranks: int = 0) -> int:
    """Consecutive ranks one group of ``axis`` spans (:meth:`ParallelDims.span`; "hpz": ZeRO++'s secondary
    groups, ``ranks`` consecutive shard ranks)."""
    if axis == "hpz":
        return dims.span(Axis.TP) * ranks
    return dims.span(axis)


def link(dims: ParallelDims, axis: str, dev: Device, ranks: int = 0) -> str:
    """"intra" when a group of ``axis`` (of ``ranks``, for "hpz") fits in one node, else "inter"."""
    if axis == Axis.PP:
        return "intra" if dims.world_size <= dev.gpus_per_node else "inter"
    return "intra" if axis_span(dims, axis, ranks) <= dev.gpus_per_node else "inter"


def step_flops(cfg: RunConfig, dims: ParallelDims, rank: int) -> float:
    """FLOPs ``rank`` computes in one step (module docstring)."""
    p, m = cfg.parallel, spec_for(cfg.model).shape()
    tokens = dims.local_batch(cfg) * cfg.data.seq_len / dims.cp  # each cp rank: seq_len / cp of every sample
    n_stages, stages = dims.stages(rank, p.pp_stages_per_rank)
    split = m.stage_layers(n_stages)
    layers = sum(len(split[s]) for s in stages)
    block, params = local_counts(cfg, dims, rank)
    embed = m.embedding_params(dims.tp) if 0 in stages else 0
    # a token computes with top_k of a Mixture of Experts' experts (those of this rank's stages)
    idle = m.stage_experts(stages, n_stages) * (1 - m.expert_share)
    dense = 6 * (params - embed - idle) * tokens  # an embedding lookup computes nothing
    attn = 6 * cfg.data.seq_len * m.dim / dims.tp * tokens * layers
    if p.activation_checkpoint == "full":
        recomputed = layers
    elif p.activation_checkpoint == "every_k":
        recomputed = sum(1 for s in stages for i in split[s] if i % p.ac_every_k == 0)
    else:
        recomputed = 0
    redo = recomputed * (2 * block * tokens + attn / max(1, layers) / 3)
    return dense + attn + redo


def step_time(cfg: RunConfig, dims: ParallelDims, rank: int, dev: Device) -> dict:
    """Predicted seconds of one step on ``rank`` (module docstring), with its parts."""
    share = min(dims.world_size, dev.gpus_per_node) if dev.shared_host else 1
    crowded = bool(dev.shared_host and dev.cores and dev.crowded_call_s and share > dev.cores)
    compute = step_flops(cfg, dims, rank) / (dev.flops / share)
    bubble = bubble_fraction(cfg, dims)
    compute_total = compute / (1 - bubble)
    mb = max(1, dims.local_batch(cfg) // cfg.train.micro_batch)
    window = compute / mb
    comm = step_comm(cfg, dims, rank, dev.mixed)
    by_axis: dict[str, float] = {}
    exposed = 0.0
    for c in comm:
        cls = link(dims, c["axis"], dev, c["ranks"])
        bw, lat = (dev.intra_bw, dev.intra_lat) if cls == "intra" else (dev.inter_bw, dev.inter_lat)
        hops = 1 if c["kind"] == "send_recv" else (2 if c["kind"] == "all_reduce" else 1) * (c["ranks"] - 1)
        per_call = dev.crowded_call_s if crowded else hops * lat
        seconds = c["bytes"] / bw + c["calls"] * per_call
        c["link"], c["seconds"] = cls, seconds
        by_axis[c["axis"]] = by_axis.get(c["axis"], 0.0) + seconds
        overlaps = c["overlaps"] == "compute" and not dev.shared_host
        exposed += max(0.0, seconds - window) if overlaps else seconds
    return {"compute_s": compute, "bubble": bubble, "comm_s": sum(by_axis.values()), "comm_by_axis": by_axis,
            "exposed_s": exposed, "step_s": compute_total + exposed, "comm": comm}
