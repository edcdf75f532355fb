"""Run a function in N real processes that form a torch.distributed group.

    results = run_ranks("tests.jobs:train_layouts", world_size=4, payload={...})

Each rank is a real ``python -m tests.rank_main`` process with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, one CPU
thread each; the function receives the payload, forms its own process group
and returns a picklable value.

Importing torch costs each process seconds, so by default the processes of a
world size are kept for the whole test session and handed one job after
another (a fresh port each); ``fresh=True`` (implied by ``expect_exit``)
starts new ones. A rank that fails or a job that outlives ``timeout`` kills
the whole group (it is restarted for the next job), and the error names each
failed rank with its output.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PASS_ENV = ("AWS_", "FSSPEC_", "ETRAIN_", "RAY_")


def wait_for(pred, what: str, timeout: float = 120.0, poll_s: float = 0.1):
    """``pred()`` once it is true (returned), polling every ``poll_s``; AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankFailure(RuntimeError):
    pass


def _tail(text: str) -> str:
    """A rank's output for a failure report: the start (the command) and the end (the error)."""
    return text if len(text) < 6000 else text[:2500] + "\n[...]\n" + text[-3500:]


def _job_env(port: int, extra: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(_PASS_ENV)}
    env["MASTER_PORT"] = str(port)
    env.update(extra or {})
    return env


class RankPool:
    """``world_size`` long-lived rank processes that run jobs one at a time."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.dir = tempfile.mkdtemp(prefix=f"etrain-pool{world_size}-")
        self.jobs = 0
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        for rank in range(world_size):
            log = open(os.path.join(self.dir, f"rank{rank}.log"), "w+")
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tests.rank_main", "--serve", self.dir],
                                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            self.logs.append(log)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def run(self, target: str, payload, timeout: float, env: dict | None) -> list:
        self.jobs += 1
        job = os.path.join(self.dir, f"job{self.jobs}")
        offsets = [log.seek(0, os.SEEK_END) for log in self.logs]
        with open(job + ".tmp", "wb") as f:
            pickle.dump({"target": target, "payload": payload, "env": _job_env(free_port(), env)}, f)
        os.rename(job + ".tmp", job + ".pkl")
        outs = [f"{job}.rank{r}.out" for r in range(self.world_size)]
        deadline = time.monotonic() + timeout
        problem = None
        while True:
            done = [os.path.exists(o) for o in outs]
            if all(done):
                break
            if not self.alive():
                problem = "a rank process died"
            elif time.monotonic() > deadline:
                problem = f"timeout after {timeout:.0f} s"
            if problem:
                break
            time.sleep(0.02)
        results, errors = [], {}
        if problem is None:
            for r, o in enumerate(outs):
                with open(o, "rb") as f:
                    ok, value = pickle.load(f)
                if ok:
                    results.append(value)
                else:
                    errors[r] = value
            if not errors:
                return results
            problem = "a rank raised"
        self.close()
        report = []
        for r, (log, off) in enumerate(zip(self.logs, offsets)):
            log.seek(off)
            text = log.read()
            if r in errors:
                text += "\n" + errors[r]
            report.append(f"--- rank {r}\n{_tail(text)}")
        raise RankFailure(f"{target} at world {self.world_size}: {problem}\n" + "\n".join(report))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


_pools: dict[int, RankPool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()


def run_ranks(target: str, world_size: int, payload=None, timeout: float = 300.0, env: dict | None = None,
              expect_exit: dict[int, int] | None = None, fresh: bool = False) -> list:
    """Results per rank (None for a rank listed in ``expect_exit``, which must exit with that code)."""
    if not (fresh or expect_exit):
        pool = _pools.get(world_size)
        if pool is None or not pool.alive():
            pool = _pools[world_size] = RankPool(world_size)
        return pool.run(target, payload, timeout, env)
    return _run_fresh(target, world_size, payload, timeout, env, expect_exit or {})


def _run_fresh(target, world_size, payload, timeout, env, expect_exit) -> list:
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
                if any(p.poll() not in (None, 0, expect_exit.get(r)) for r, p in enumerate(procs)):
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
        if failed or any(c != expect_exit.get(r, 0) for r, c in enumerate(codes)):
            report = []
            for rank, (log, code) in enumerate(zip(logs, codes)):
                log.seek(0)
                report.append(f"--- rank {rank} exit {code}\n{_tail(log.read())}")
            raise RankFailure(f"{target} at world {world_size}: {failed or codes}\n" + "\n".join(report))
        results = []
        for rank in range(world_size):
            if rank in expect_exit:
                results.append(None)
                continue
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        for log in logs:
            log.close()
        return results
