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
