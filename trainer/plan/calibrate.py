"""``etrain plan --calibrate``: fit the compute rate and the collectives' bandwidth of the machine at hand.

    fit = calibrate(cfg, "cpu")          # two training steps, then timed all-reduces; stored and returned
    dev = apply(DEVICES["cpu"], load("cpu"))

Compute: the model (the built-in preset, or the ``transformers`` or factory model itself; the
planner's FLOP count is its built-in-equivalent shape's, :mod:`.shape`) trains two steps
of one micro-batch (forward, backward, AdamW) on this machine in one process (more steps, up to 8
in 3 s, when they are quick); the fastest step after the first, against
:func:`trainer.plan.cost.step_flops`, gives the achieved FLOP rate. On the CPU the step runs on one thread and the host's rate is that
times its cores (threads that contend with other work on a busy host would measure the contention). A model too large
for a quick step here (over 200M parameters) is measured at the ``small`` preset's size instead,
and the report says so. Collectives: two processes on 127.0.0.1 (gloo; NCCL with two GPUs)
all-reduce 4 bytes (the latency: half its time, a two-rank ring being two hops) and 2 and 16 MiB
(the bus bandwidth: the slope between them). On the CPU, twice as many ranks as cores then
all-reduce one number 40 times: the median is ``crowded_call_s``, what a collective costs when the
ranks wait for the scheduler (:mod:`.cost`). The fit is stored as JSON in ``$ETRAIN_HOME/plan/calibration.json`` (default
``~/.etrain``), keyed by device profile, and every later ``etrain plan`` with that profile uses it.
"""

from __future__ import annotations

import json
import os
import socket
import time

from ..config import MODEL_PRESETS, RunConfig
from ..host import usable_cpus
from .cost import Device, custom

SIZES = (4, 2 * 2**20, 16 * 2**20)  # the first: latency alone


def store_path() -> str:
    from checkpointing.names import etrain_home

    return os.path.join(etrain_home(), "plan", "calibration.json")


def load(profile: str) -> dict | None:
    """The stored fit of ``profile``, or None."""
    try:
        with open(store_path()) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    fit = doc.get(profile) if isinstance(doc, dict) else None
    ok = isinstance(fit, dict) and all(isinstance(fit.get(k), (int, float)) and fit[k] > 0
                                       for k in ("flops", "bandwidth", "latency"))
    return fit if ok else None


def save(profile: str, fit: dict) -> str:
    path = store_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            doc = json.load(f)
        doc = doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        doc = {}
    doc[profile] = fit
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return path


def apply(dev: Device, fit: dict | None) -> Device:
    """``dev`` with a stored fit's rate, bandwidth and latency (both link classes: one machine measured)."""
    if not fit:
        return dev
    crowd = {"cores": int(fit["cores"]), "crowded_call_s": float(fit["crowded_call_s"])} if (
        dev.shared_host and isinstance(fit.get("cores"), int) and isinstance(fit.get("crowded_call_s"), float)) else {}
    return custom(dev, **crowd, peak_flops=fit["flops"], efficiency=1.0, intra_bw=fit["bandwidth"],
                  inter_bw=min(dev.inter_bw, fit["bandwidth"]) if dev.name != "cpu" else fit["bandwidth"],
                  intra_lat=fit["latency"], inter_lat=max(dev.inter_lat, fit["latency"]),
                  calibrated=fit.get("when", "calibrated"))


def measure_compute(cfg: RunConfig, device: str) -> dict:
    """Two steps of one micro-batch of the model, in this process; the second one's FLOP rate."""
    import dataclasses

    import torch

    from ..models import spec_for
    from ..parallel.dims import ParallelDims
    from ..parallel.tensor import lm_loss
    from .cost import step_flops
    from .shape import model_shape

    shape = model_shape(cfg)
    m = shape.model
    note = ""
    spec = spec_for(cfg.model)  # the model itself (a transformers or factory model too)
    if shape.n_params > 200e6:
        m = dataclasses.replace(m, **MODEL_PRESETS["small"], vocab_size=min(m.vocab_size, 32000))
        note, spec = "the model is over 200M parameters: measured at the small preset's size", spec_for(m)
    seq = min(cfg.data.seq_len, m.max_seq_len)
    one = dataclasses.replace(cfg, model=m, data=dataclasses.replace(cfg.data, seq_len=seq),
                              parallel=dataclasses.replace(cfg.parallel, dp_replicate=1, dp_shard=1, tp=1, pp=1,
                                                           sequence_parallel=False, pp_schedule="1f1b",
                                                           pp_stages_per_rank=1, offload="none"),
                              train=dataclasses.replace(cfg.train, global_batch=cfg.train.micro_batch))
    dims = ParallelDims.from_config(one, 1)
    dev = torch.device(device)
    threads = torch.get_num_threads()
    if device == "cpu":  # one core, times the cores: threads that contend for a busy host measure the contention
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    net = spec.build("cpu", cfg.train.seed).to(dev, dtype)

    def model(tokens):
        return spec.logits(net, tokens)

    params = net.parameters()
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randint(0, m.vocab_size, (one.train.micro_batch, seq + 1), device=dev)
    times: list[float] = []
    t_end = time.monotonic() + 3.0
    while len(times) < 2 or (len(times) < 8 and time.monotonic() < t_end):  # two steps at least
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    flops = step_flops(one, dims, 0)
    best = min(times[1:])  # the fastest after the first: a shared machine's noise only slows steps down
    cores = 1
    if device == "cpu":
        cores = usable_cpus()
    return {"flops": flops / best * cores, "flops_per_core": flops / best, "step_seconds": best,
            "steps": len(times), "step_flops": flops, "note": note}


def _allreduce_worker(rank: int, port: int, backend: str, out, world: int = 2) -> None:
    import torch
    import torch.distributed as dist

    from ..world import World, init_distributed

    torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    # All on loopback: the rendezvous store and the group's sockets (tcp:// would listen on every interface).
    init_distributed(World(rank=rank, size=world, local_rank=rank, master_addr="127.0.0.1", master_port=port), dev)
    if world > 2:  # crowded: more ranks than cores; the median time of a small all-reduce
        t = torch.ones(1)
        times = []
        for _ in range(40):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            out.put(sorted(times)[len(times) // 2])
        dist.destroy_process_group()
        return
    rows = []
    for size in SIZES:
        t = torch.ones(size // 4, device=dev)
        dist.all_reduce(t)
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            if backend == "nccl":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if backend == "nccl":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t0)
        rows.append((size, best))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def _spawn(world: int, backend: str):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, backend, q, world)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return q.get() if not q.empty() else None


def measure_crowded() -> dict:
    """On the CPU: one small all-reduce's time when twice as many ranks as cores share the host."""
    cores = usable_cpus()
    world = min(8, 2 * cores)
    got = _spawn(world, "gloo") if world > 2 else None
    return {"cores": cores, "crowded_call_s": got, "crowded_ranks": world} if got else {"cores": cores}


def measure_collectives() -> dict:
    """All-reduce times between two local processes, and the fitted latency and bus bandwidth."""
    import torch

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    rows = _spawn(2, backend) or []
    if len(rows) < 3:
        return {}
    (_, t0), (s1, t1), (s2, t2) = rows[:3]
    latency = max(t0 / 2, 1e-6)  # a 2-rank ring all-reduce is 2 hops
    slope = max((t2 - t1) / (s2 - s1), 1e-13)  # seconds per bus byte (2 (n - 1) / n S = S at n = 2)
    n = len(rows)
    return {"bandwidth": 1 / slope, "latency": latency, "backend": backend,
            "allreduce": [{"bytes": s, "seconds": t} for s, t in rows], "points": n}


def calibrate(cfg: RunConfig, profile: str, device: str) -> dict:
    """Measure (module docstring), store under ``profile`` and return the fit."""
    fit = measure_compute(cfg, device)
    fit.update(measure_collectives() or {"bandwidth": 1e9, "latency": 1e-4, "note_collectives": "not measured"})
    if device == "cpu":
        fit.update(measure_crowded())
    fit["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fit["device"] = device
    fit["path"] = save(profile, fit)
    return fit
