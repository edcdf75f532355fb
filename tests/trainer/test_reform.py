"""A process's process groups over their life: left and re-formed at once (the old ones freed beside it), freed
before the interpreter finalizes at exit, aborted on the controller's notice; and the GPU a worker is given.

A re-formed TrainWorker (orchestrator.workers.worker) leaves its groups with ``shutdown_distributed(background=True)``:
freeing a gloo group joins its threads and closes its connections (15-25 ms of a recovery on 2 cores), which
the next group need not wait for. Real gloo groups in two processes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import run_ranks


@pytest.mark.compat  # the groups are found through a map private to torch (2.11 to 2.13)
def test_groups_freed_in_the_background_while_the_next_group_forms_with_other_ranks():
    results = run_ranks("tests.jobs:reform_in_background", 2, {}, fresh=True)
    for r in results:
        # epoch 1: ranks 0, 1 (sum of rank+1 = 3); epoch 2: the ranks swapped, the same sums; each subgroup too
        assert r["sums"] == [[3.0, 2.0, 1.0], [3.0, 4.0, 1.0]]
        assert r["freed"] == [True, True]


def python(script: str) -> str:
    """What ``script`` printed, run in a fresh interpreter of this project (it must exit 0)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


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
    out = python(EXIT_SCRIPT)
    running, at_exit = (int(line.split()[-1]) for line in out.splitlines())
    assert running > 0 and at_exit == 0, out


def test_the_gpu_ray_assigned_is_found_among_the_visible_devices():
    """With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES Ray leaves CUDA_VISIBLE_DEVICES as the node set it: the
    device index is the assigned GPU's place there (ordinals or UUIDs), never Ray's id taken as an index."""
    from checkpointing.errors import ConfigError
    from trainer.world import visible_device_index

    assert visible_device_index("3", None) == 3  # every GPU visible: the ordinal
    assert visible_device_index("3", "2,3") == 1
    assert visible_device_index("GPU-9f2c", "GPU-1a0b, GPU-9f2c") == 1
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES='0,1'.*RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        visible_device_index("5", "0,1")
    with pytest.raises(ConfigError, match="not an ordinal and CUDA_VISIBLE_DEVICES is unset"):
        visible_device_index("GPU-9f2c", None)


ABORT_SCRIPT = """
import torch, torch.distributed as dist
from trainer.world import World, abort_groups, init_distributed, shutdown_distributed

init_distributed(World(rank=0, size=1), torch.device("cpu"))
subgroups = [dist.new_group([0]), dist.new_group([0])]  # a mesh's groups, as TP and PP make them
print(abort_groups(), flush=True)
shutdown_distributed()
print(abort_groups(), flush=True)
"""


@pytest.mark.compat  # the groups are found through a map private to torch (2.11 to 2.13)
def test_an_abort_reaches_every_group_of_the_rank_not_only_the_default_one():
    """The controller's notice aborts every group a survivor may be blocked in (under NCCL; gloo's abort releases
    nothing, its peers' closed connections do): the default group and each mesh group, then none once left."""
    assert python(ABORT_SCRIPT).split() == ["3", "0"]
