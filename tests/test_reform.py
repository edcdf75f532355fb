"""A process leaves its process groups and forms the next at once, the old ones freed beside it.

A re-formed TrainWorker (orchestrator.worker) leaves its groups with ``shutdown_distributed(background=True)``:
freeing a gloo group joins its threads and closes its connections (15-25 ms of a recovery on 2 cores), which
the next group need not wait for. Real gloo groups in two processes.
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks


@pytest.mark.compat  # the groups are found through a map private to torch (2.11 to 2.13)
def test_groups_freed_in_the_background_while_the_next_group_forms_with_other_ranks():
    results = run_ranks("tests.jobs:reform_in_background", 2, {}, fresh=True)
    for r in results:
        # epoch 1: ranks 0, 1 (sum of rank+1 = 3); epoch 2: the ranks swapped, the same sums; each subgroup too
        assert r["sums"] == [[3.0, 2.0, 1.0], [3.0, 4.0, 1.0]]
        assert r["freed"] == [True, True]


EXIT_SCRIPT = """
import atexit, os, torch, torch.distributed as dist
from trainer.world import World, init_distributed, shutdown_distributed

def runloops():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return names.count("pt_gloo_runloop")

atexit.register(lambda: print("at exit", runloops(), flush=True))  # registered first: runs after etrain's hook
init_distributed(World(rank=0, size=1), torch.device("cpu"))
held = {"group": dist.group.WORLD}
held["self"] = held  # a cycle holding the group, as a model's FSDP state does: freed only by a collection
dist.all_reduce(torch.ones(4))
print("running", runloops(), flush=True)
shutdown_distributed()
del held
"""


def test_a_process_frees_its_groups_before_the_interpreter_finalizes():
    """A gloo group's threads live as long as the group object. One still finishing a collective while the
    interpreter finalizes aborted the process (exit -6) after a run that succeeded; at exit, etrain frees the
    groups its trainer held (here: in a reference cycle) while the interpreter still runs."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    running, at_exit = (int(line.split()[-1]) for line in out.stdout.splitlines())
    assert running > 0 and at_exit == 0, out.stdout
