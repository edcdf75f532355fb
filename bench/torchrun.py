"""Re-launch a benchmark script under torchrun on loopback (the benchmarks' common entry).

    if "RANK" in os.environ: worker(args)
    else: sys.exit(relaunch(__file__, args.world))
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def relaunch(script: str, world: int) -> int:
    """Run ``script`` with this process's arguments as ``world`` torchrun ranks on 127.0.0.1, one
    CPU thread share each; returns torchrun's exit status."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)))
    cmd = [torchrun, f"--nproc_per_node={world}", "--master_addr=127.0.0.1", f"--master_port={port}",
           script, *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


def parse_args(quick_help: str, extra=None):
    """The options every torchrun benchmark takes; ``extra(parser)`` adds a benchmark's own."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--steps-per-round", type=int, default=0)
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def main(script: str, worker, args) -> None:
    """A benchmark's entry: ``worker(args)`` as a torchrun rank, else re-launched under torchrun."""
    if "RANK" in os.environ:
        worker(args)
    else:
        sys.exit(relaunch(script, args.world))


def stop_session(proc: subprocess.Popen) -> None:
    """SIGKILL a process started in a session of its own and what it started (torchrun starts each rank in a
    session of its own: its children by pid first, then the session), and reap it."""
    from orchestrator.chaos import procfs

    if proc.returncode is not None:  # reaped already: its pid may be another process's now
        return
    procfs.kill_tree(proc.pid, signal.SIGKILL, root=False)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_for(pred, timeout: float, what: str, poll: float = 0.02, check=None):
    """``pred()`` once it is true (returned), polling every ``poll`` s; ``check()`` (if given) on each poll may
    raise to stop waiting. TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if check is not None:
            check()
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def time_steps(fn, n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn``, every call started after a barrier of all ranks."""
    import time

    import torch.distributed as dist

    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def alternate(rounds: int, a, b) -> tuple[list[float], list[float]]:
    """Step times of ``a()`` and ``b()`` (each runs one round and returns its step times) over ``rounds``
    rounds, alternating which goes first so that noise on a shared machine hits both alike."""
    times_a: list[float] = []
    times_b: list[float] = []
    for r in range(rounds):
        if r % 2:
            times_a += a()
            times_b += b()
        else:
            times_b += b()
            times_a += a()
    return times_a, times_b


def slowest_rank_medians(*series: list[float]) -> list[float]:
    """The median over steps of each series, a step counting as slow as its slowest rank (the same
    figures on every rank)."""
    import statistics

    import torch
    import torch.distributed as dist

    both = torch.tensor([list(s) for s in series])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return [statistics.median(row) for row in both.tolist()]
