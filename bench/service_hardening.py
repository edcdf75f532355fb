"""What the service's hardening costs: the allocator's decision beside runs whose documents are hostile, and
the file store's compare-and-swap under contention.

    python bench/service_hardening.py [--quick]

1. **The allocator's decision** over N runs in real file stores (the logic of the allocator actor,
   :class:`orchestrator.service.allocator.AllocatorCore`, with a fixed capacity), first all well-formed,
   then with one run in ten hostile (a phase that is none, a NaN step time in its history, a size of a
   billion, a FIFO for its status). Median seconds per decision of each, and their ratio: what the
   checks and the per-run read budget cost, and proof that the hostile runs stop nothing (every good
   run is decided both times).
2. **Compare-and-swap on a file store**: ``update_spec`` by one writer, then by four processes at once on
   the same spec (the kernel record lock). Updates per second of each, their ratio, and the updates
   lost (the spec's generation against the number of writes told they landed: must be 0).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orchestrator.service.allocator import AllocatorCore  # noqa: E402
from orchestrator.store.documents import RunSpec  # noqa: E402
from orchestrator.store.run_store import open_store  # noqa: E402
from trainer.config.load import load_raw  # noqa: E402

BASE = ["data.max_bytes=200000", "data.seq_len=16", "train.global_batch=12", "train.micro_batch=1",
        "train.steps=1000"]


def make_run(store, run_id: str, raw: dict) -> None:
    store.create_run(RunSpec(run_id=run_id, config=raw, workers=1, min_workers=1, max_workers=3))
    lease = store.acquire(run_id, f"ctl-{run_id}")
    store.put_status(run_id, {"run_id": run_id, "phase": "RUNNING", "step": 10, "total_steps": 1000,
                              "world_size": 1}, lease)
    store.release(lease)
    store.put_history(run_id, [[s, 2.0, 1, 12 * s, 1000.0 + s, 0.1, 100.0] for s in range(1, 30)])


def spoil(store, root: str, run_id: str, how: int) -> None:
    def put(name: str, text: str) -> None:
        _, version = store.read_versioned(run_id, name)
        store.write_if(run_id, name, text, version)

    if how == 0:
        put("status", '{"run_id": "%s", "phase": "BOGUS", "updated_unix": %f}' % (run_id, time.time()))
    elif how == 1:
        put("history", "[" + ",".join(f"[{s}, 1.0, 1, 12, {1000 + s}, NaN]" for s in range(1, 30)) + "]")
    elif how == 2:
        raw, version = store.read_versioned(run_id, "spec")
        doc = json.loads(raw)
        doc["max_workers"] = 10**9
        store.write_if(run_id, "spec", json.dumps(doc), version)
    else:
        path = os.path.join(root, run_id, "control", "status.json")
        os.remove(path)
        os.mkfifo(path)


def decisions(n_runs: int, hostile: bool, rounds: int) -> tuple[float, int]:
    """Median seconds per decision, and how many good runs the last decision covered."""
    root = tempfile.mkdtemp(prefix="etrain-bench-alloc-")
    store = open_store(f"file://{root}")
    raw = load_raw("examples/tiny.toml", BASE)
    bad = set()
    for i in range(n_runs):
        make_run(store, f"r{i:03d}", raw)
        if hostile and i % 10 == 9:
            spoil(store, root, f"r{i:03d}", (i // 10) % 4)
            bad.add(f"r{i:03d}")
    core = AllocatorCore(store, capacity=lambda cpw, gpw: 3 * n_runs, read_budget_s=2.0)
    for run_id in store.list_runs():
        core.register(run_id, store.url)
    core.tick()  # warm: the layout's rules imported, every config parsed once
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        plan = core.tick()
        times.append(time.perf_counter() - t0)
    covered = sum(1 for k in plan.targets if k.split(".")[0] not in bad)
    return statistics.median(times), covered


def _writer(url: str, n: int, told: mp.Queue) -> None:
    store = open_store(url)
    landed = 0
    for _ in range(n):
        store.update_spec("cas", workers=1 + landed % 3)
        landed += 1
    told.put(landed)


def cas(writers: int, per_writer: int) -> tuple[float, int]:
    """Updates per second with ``writers`` processes on one spec, and the updates lost."""
    root = tempfile.mkdtemp(prefix="etrain-bench-cas-")
    url = f"file://{root}"
    store = open_store(url)
    store.create_run(RunSpec(run_id="cas", config={}, workers=1, min_workers=1, max_workers=3))
    before = store.get_spec("cas").generation
    told: mp.Queue = mp.Queue()
    procs = [mp.get_context("fork").Process(target=_writer, args=(url, per_writer, told)) for _ in range(writers)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    landed = sum(told.get() for _ in procs)
    for p in procs:
        p.join()
    seconds = time.perf_counter() - t0
    return landed / seconds, landed - (store.get_spec("cas").generation - before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 runs, 5 decisions, 100 updates per writer")
    args = ap.parse_args()
    n, rounds, per = (40, 5, 100) if args.quick else (100, 9, 300)
    clean_s, clean_cover = decisions(n, False, rounds)
    hostile_s, hostile_cover = decisions(n, True, rounds)
    one, lost1 = cas(1, per)
    four, lost4 = cas(4, per)
    out = {"bench": "service_hardening", "runs": n, "hostile_runs": n // 10,
           "decision_s_clean": round(clean_s, 4), "decision_s_hostile": round(hostile_s, 4),
           "decision_ratio_hostile_over_clean": round(hostile_s / clean_s, 3),
           "good_runs_decided_clean": clean_cover, "good_runs_decided_hostile": hostile_cover,
           "cas_updates_per_s_1_writer": round(one, 1), "cas_updates_per_s_4_writers": round(four, 1),
           "cas_ratio_4_over_1": round(four / one, 3), "cas_updates_lost": lost1 + lost4}
    print(f"allocator decision over {n} runs: {clean_s * 1000:.1f} ms clean, {hostile_s * 1000:.1f} ms with "
          f"{n // 10} hostile ({hostile_s / clean_s:.2f}x); good runs decided {clean_cover} / {hostile_cover}")
    print(f"file-store compare-and-swap: {one:.0f} updates/s alone, {four:.0f}/s by 4 writers "
          f"({four / one:.2f}x); updates lost: {lost1 + lost4}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
