"""Re-launch a benchmark script under torchrun on loopback (the benchmarks' common entry).

    if "RANK" in os.environ: worker(args)
    else: sys.exit(relaunch(__file__, args.world))
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

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


def parse_args(quick_help: str):
    """The options every torchrun benchmark takes."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--steps-per-round", type=int, default=0)
    return ap.parse_args()
