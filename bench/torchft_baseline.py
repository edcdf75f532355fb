"""torchft baseline for bench/recovery.py: the same tiny model and kill pattern, recovered torchft's way.

    python bench/torchft_baseline.py [--kills 1] [--every 10] [--steps-after 30]

Two replica groups of one process each, each under its own ``torchrun --nproc_per_node=1`` (the
Manager reads torchrun's store env), and a torchft lighthouse (``--min_replicas 1``, its defaults
otherwise) on 127.0.0.1. Each replica trains etrain's built-in tiny model (``model.preset = "tiny"``
on examples/tiny.toml: ``trainer.models.decoder.model.Transformer``, weights from ``train.seed``), AdamW lr 0.003,
6 samples of ``data.seq_len`` per replica per step: windows of the ``trainer.data.corpus.load_splits(cfg)``
corpus (the stdlib sources, as recovery.py's BASE), picked by step and replica. The gradients go
through torchft's fault-tolerant ``Manager.allreduce`` (one flat bucket, ProcessGroupGloo, Manager
timeout ``TIMEOUT_S``) and its ``Optimizer`` (steps only where ``should_commit``). Not torchft's
DistributedDataParallel: in torchft 0.2.0 its comm hook fails ``assert fut._fut`` (ddp.py) when the
allreduce errors in ``wait`` (a peer killed mid-allreduce), which takes the survivor down too. Each
replica logs a JSON line per step; ``committed`` is false where ``should_commit`` said no.

Every ``every`` steps of the whole group, replica 1's rank process is SIGKILLed (its torchrun with
it) and a replacement replica 1 started at once: a new process that heals (weights and optimizer
state) from the live replica 0. Per kill: ``mttr`` is the time from the kill to the replacement's
first committed step with 2 participants (the group whole again); ``survivor_stall`` the longest gap
between replica 0's consecutive committed steps, from its last before the kill to its first after
the rejoin. torchft redoes no step: replica 0 goes on alone. So ``steps_lost`` counts replica 0's
steps that did not commit in that span (the work of the step in flight at the kill, thrown away: the
analogue of etrain's steps redone); ``steps_degraded`` the steps it committed alone (half the
samples, not progress lost); ``step_gap`` the replacement's first step minus replica 0's step at the
kill (``steps_degraded`` + 1: an uncommitted attempt does not advance the step).
Here the rejoin waits on the lighthouse's ``heartbeat_timeout_ms`` (5 s, its default): the survivor's
next quorum waits for the dead replica's heartbeats to lapse, the replacement (booted in ~4-5 s) too.

torchft's location: ``ETRAIN_TORCHFT_PATH`` (a directory put on PYTHONPATH: ``pip install --target DIR
torchft`` keeps it and its OpenTelemetry dependencies out of the project's environment), else a
normally importable ``torchft``. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import stop_session  # noqa: E402  (after the path: run as a script)
from bench.torchrun import wait_for as poll_until  # noqa: E402

TIMEOUT_S = 10  # the Manager's timeout for its collectives and RPCs (torchft's default: 60)
BOOT_S = 180  # a replica (torchrun + torch + torchft + the model) not stepping after this long: failed
OVERRIDES = ["model.preset=\"tiny\"", "data.max_bytes=2000000", "train.lr=0.003"]
PER_REPLICA = 6  # samples per replica per step (recovery.py's global_batch 12 over 2)


def _torchft_path() -> str | None:
    """A directory to put on PYTHONPATH for torchft, or None when it imports as it is."""
    if os.environ.get("ETRAIN_TORCHFT_PATH"):
        return os.environ["ETRAIN_TORCHFT_PATH"]
    return None


def _env() -> dict:
    path = [ROOT] + ([p] if (p := _torchft_path()) else [])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                OMP_NUM_THREADS="1")


def torchft_available() -> tuple[bool, str]:
    """(True, "") when torchft imports (with its lighthouse) in a subprocess, else (False, why)."""
    r = subprocess.run([sys.executable, "-c", "import torchft; from torchft._torchft import lighthouse_main"],
                       env=_env(), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"torchft is not importable (PYTHONPATH {_torchft_path() or 'as is'}): {last}"
    return True, ""


# --- one replica (run under torchrun) --------------------------------------------------------


def worker(a: argparse.Namespace) -> None:
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.nn.functional as F
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from trainer.config.load import load_config
    from trainer.data.corpus import load_splits
    from trainer.models.decoder.model import Transformer

    cfg = load_config(os.path.join(ROOT, "examples/tiny.toml"), OVERRIDES)
    corpus, _ = load_splits(cfg)
    seq, n = cfg.data.seq_len, corpus.n_samples(cfg.data.seq_len)
    torch.manual_seed(cfg.train.seed)
    m = Transformer(cfg.model)
    opt0 = torch.optim.AdamW(m.parameters(), lr=cfg.train.lr)

    def load(sd):
        m.load_state_dict(sd["model"])
        opt0.load_state_dict(sd["optim"])

    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load,
                      state_dict=lambda: {"model": m.state_dict(), "optim": opt0.state_dict()},
                      replica_id=f"r{a.replica}", lighthouse_addr=a.lighthouse, timeout=timedelta(seconds=TIMEOUT_S))
    opt, params = Optimizer(manager, opt0), list(m.parameters())
    with open(a.log, "a") as log:
        while not os.path.exists(a.stop):
            opt.zero_grad()
            base = manager.current_step() * 2 * PER_REPLICA + a.replica * PER_REPLICA
            x = torch.from_numpy(np.stack([corpus.window(((base + j) % n) * seq, seq + 1)
                                           for j in range(PER_REPLICA)]).astype(np.int64))
            F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
            flat = torch.cat([p.grad.flatten() for p in params])  # one bucket: the model is 3.7 MB
            manager.allreduce(flat).wait()  # averaged; on a failure it reports, should_commit says no
            for p, g in zip(params, torch.split(flat, [p.numel() for p in params])):
                p.grad.copy_(g.view_as(p.grad))
            before = manager.current_step()
            opt.step()
            log.write(json.dumps({"replica": a.replica, "step": manager.current_step(),
                                  "participants": manager.num_participants(), "time": time.time(),
                                  "committed": manager.current_step() > before}) + "\n")
            log.flush()


# --- the benchmark ----------------------------------------------------------------------------


def _rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except (OSError, ValueError):
        return []


def bench_torchft(root: str, kills: int, every: int, steps_after: int = 30) -> dict:
    from orchestrator.chaos import procfs
    from tests.harness import free_port

    out = {k: [] for k in ("mttr", "survivor_stall", "steps_lost", "steps_degraded", "step_gap")}
    out.update(ok=False, error="")
    ok, why = torchft_available()
    if not ok:
        out["error"] = why
        return out
    os.makedirs(root, exist_ok=True)
    env, procs = _env(), []
    stop, port = os.path.join(root, "stop"), free_port()
    lighthouse = f"http://127.0.0.1:{port}"

    def start(cmd: list[str], log: str, **extra) -> subprocess.Popen:
        with open(log, "ab") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(env, **extra), stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        return procs[-1]

    def replica(r: int, gen: int) -> tuple[subprocess.Popen, str]:
        log = os.path.join(root, f"r{r}-{gen}.jsonl")
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.abspath(__file__)]
        args = {"replica": r, "lighthouse": lighthouse, "log": log, "stop": stop}
        return start(cmd, os.path.join(root, f"r{r}-{gen}.out"), ETRAIN_TORCHFT_WORKER=json.dumps(args)), log

    def wait_for(pred, timeout: float, what: str):
        def alive():  # the lighthouse and the survivor must live through the wait
            for name, p in zip(("the lighthouse", "replica 0 (the survivor)"), procs):
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}) waiting for {what}")

        return poll_until(pred, timeout, what, poll=0.05, check=alive)

    def whole(log: str, min_step: int = 0):
        return next((x for x in _rows(log) if x["committed"] and x["participants"] == 2 and x["step"] >= min_step),
                    None)

    try:
        # lighthouse_main parses the process's own argv: a script, as torchft's bin/torchft_lighthouse is
        with open(os.path.join(root, "torchft_lighthouse"), "w") as f:
            f.write("import sys\nfrom torchft._torchft import lighthouse_main\nsys.exit(lighthouse_main())\n")
        start([sys.executable, f.name, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}"],
              os.path.join(root, "lighthouse.out"))
        (_, log0), (p1, log1) = replica(0, 0), replica(1, 0)
        rejoined = 3
        for k in range(kills):
            target = rejoined + every  # every steps of the whole group (from step 3) between kills
            wait_for(lambda t=target, log=log1: whole(log0, t) and whole(log), BOOT_S, f"step {target} on 2 replicas")
            victim = procfs.children(p1.pid)
            if not victim:
                raise RuntimeError("no rank process found under replica 1's torchrun")
            t_kill = time.time()
            os.kill(victim[0], signal.SIGKILL)
            stop_session(p1)
            p1, log1 = replica(1, k + 1)
            first = wait_for(lambda log=log1: whole(log), BOOT_S, f"the replacement {k + 1} stepping with 2 participants")
            wait_for(lambda t=first["time"]: [x for x in _rows(log0) if x["time"] > t and x["committed"]],
                     30, "a survivor step after the rejoin")
            s = _rows(log0)
            at_kill = max([x["step"] for x in s if x["committed"] and x["time"] <= t_kill], default=0)
            span = [x["time"] for x in s if x["committed"]]
            t0 = max([t for t in span if t <= t_kill], default=t_kill)
            t1 = min([t for t in span if t > first["time"]])
            span = [t for t in span if t0 <= t <= t1]
            out["mttr"].append(first["time"] - t_kill)
            out["survivor_stall"].append(max(b - a for a, b in itertools.pairwise(span)))
            out["steps_lost"].append(sum(1 for x in s if not x["committed"] and t_kill < x["time"] <= t1))
            out["steps_degraded"].append(sum(1 for x in s if x["committed"] and x["participants"] < 2
                                             and t_kill < x["time"] <= t1))
            out["step_gap"].append(first["step"] - at_kill)
            rejoined = first["step"]
            print(f"torchft kill {k + 1}: survivor at step {at_kill}: group whole again in {out['mttr'][-1]:.2f} s "
                  f"(replacement's first step {first['step']}), survivor stalled {out['survivor_stall'][-1]:.2f} s, "
                  f"{out['steps_lost'][-1]} uncommitted, {out['steps_degraded'][-1]} committed alone", flush=True)
        last = max([x["step"] for x in _rows(log0)], default=0)
        wait_for(lambda: whole(log0, last + steps_after) and whole(log1, last + steps_after), 120 + steps_after,
                 f"{steps_after} steps after the last recovery")
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported in the result, the processes ended below
        out["error"] = f"{type(e).__name__}: {e} (logs in {root})"
    finally:
        open(stop, "w").close()
        for p in reversed(procs):  # the replicas' torchrun sessions, then the lighthouse
            stop_session(p)
    return out


def main() -> int:
    if "ETRAIN_TORCHFT_WORKER" in os.environ:  # one replica, under torchrun (its own options: none of ours)
        worker(argparse.Namespace(**json.loads(os.environ["ETRAIN_TORCHFT_WORKER"])))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=1)
    ap.add_argument("--every", type=int, default=15, help="steps between kills")
    ap.add_argument("--steps-after", type=int, default=30)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="etrain-bench-torchft-")
    res = bench_torchft(root, a.kills, a.every, a.steps_after)
    if res["ok"]:  # kept on a failure: the error names it
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({k: [round(x, 3) for x in v] if isinstance(v, list) else v for k, v in res.items()}))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
