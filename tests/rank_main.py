"""One rank of a tests.harness run.

    python -m tests.rank_main MODULE:FUNCTION PAYLOAD.pkl OUT.pkl   # one job, then exit
    python -m tests.rank_main --serve DIR                           # run jobs from DIR until killed
"""

import gc
import glob
import importlib
import os
import pickle
import sys
import time
import traceback

import torch


def call(target: str, payload):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(payload)


def serve(directory: str) -> None:
    rank = int(os.environ["RANK"])
    seen = set()
    while True:
        jobs = sorted(glob.glob(os.path.join(directory, "job*.pkl")), key=lambda p: int(p.rsplit("job", 1)[1][:-4]))
        todo = [j for j in jobs if j not in seen]
        if not todo:
            time.sleep(0.02)
            continue
        job = todo[0]
        seen.add(job)
        with open(job, "rb") as f:
            spec = pickle.load(f)
        os.environ.update(spec["env"])
        try:
            result = (True, call(spec["target"], spec["payload"]))
        except BaseException:  # reported to the harness, which kills the group
            result = (False, traceback.format_exc())
        out = f"{job[:-4]}.rank{rank}.out"
        with open(out + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.rename(out + ".tmp", out)
        gc.collect()


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
        return
    target, payload_path, out_path = sys.argv[1:4]
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    result = call(target, payload)
    with open(out_path, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main()
