"""Run a function in N real processes that form a torch.distributed group.

    results = run_ranks("tests.parity_job:main", world_size=4, payload={...})

Each rank is a fresh ``python -m tests.rank_main`` process with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT set, one
CPU thread each; the function receives the payload and returns a picklable
value. A rank that fails or a run that outlives ``timeout`` kills the whole
group, and the error names each failed rank with the tail of its output.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(RuntimeError):
    pass


def run_ranks(target: str, world_size: int, payload=None, timeout: float = 300.0, env: dict | None = None) -> list:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="etrain-ranks-") as tmp:
        payload_path = os.path.join(tmp, "payload.pkl")
        with open(payload_path, "wb") as f:
            pickle.dump(payload, f)
        procs, logs = [], []
        for rank in range(world_size):
            e = dict(os.environ)
            e.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
            e.update(env or {})
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            logs.append(log)
            out = os.path.join(tmp, f"rank{rank}.pkl")
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.rank_main", target, payload_path, out],
                                          cwd=ROOT, env=e, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        failed = []
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    failed = ["timeout"]
                    break
                if any(p.poll() not in (None, 0) for p in procs):
                    time.sleep(2.0)  # let peers report their side
                    failed = ["rank failure"]
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        codes = [p.returncode for p in procs]
        if failed or any(codes):
            report = []
            for rank, (log, code) in enumerate(zip(logs, codes)):
                log.seek(0)
                tail = log.read()[-3000:]
                report.append(f"--- rank {rank} exit {code}\n{tail}")
            raise RankFailure(f"{target} at world {world_size}: {failed or codes}\n" + "\n".join(report))
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        for log in logs:
            log.close()
        return results
