"""The autoscaler hears what a run waits for (orchestrator/controller/autoscale.py): the observer against the fake group
(which workers wait for resources, when the request is withdrawn), and the demand board against the real
local Ray (the cluster's one request is every run's bundles, cleared when the last run withdraws)."""

from __future__ import annotations

import pytest

from orchestrator.controller.autoscale import AutoscaleObserver
from tests.orchestrator import test_controller as base

rig = base.rig  # the controller rig's fixture


class Board:
    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def set(self, key, bundles):
        run_id, digest = key.rsplit(".", 1)  # the run's cluster key: its run id and its store
        assert len(digest) == 8
        self.calls.append((run_id, len(bundles)))
        return bundles


def test_workers_waiting_for_resources_are_requested_and_withdrawn_when_placed_and_at_the_end(rig):
    r = rig(workers=3, min_workers=1, max_workers=3, capacity=2)
    board = Board()
    r.ctl.observers.observers.append(AutoscaleObserver(board, every_s=0.0))
    r.drive_to_step(3)
    assert board.calls == [("r", 1)]  # one of three workers has no room
    assert [e["workers"] for e in r.events("autoscale")] == [1]
    r.group.add_capacity(1)  # the autoscaler's node joins
    r.drive(lambda r: len(r.ctl.members) == 3)
    r.drive_to_step(r.ctl.last_completed_step() + 1)
    assert board.calls == [("r", 1), ("r", 0)]
    assert [e["action"] for e in r.events("autoscale")] == ["request", "withdraw"]
    r.drive()
    assert board.calls[-1] == ("r", 0) and len(board.calls) == 2  # nothing left to withdraw at the end


def test_a_run_that_ends_waiting_withdraws_its_request(rig):
    r = rig(workers=3, min_workers=1, max_workers=3, capacity=2)
    board = Board()
    r.ctl.observers.observers.append(AutoscaleObserver(board, every_s=0.0))
    r.drive()
    assert r.ctl.state.name == "FINISHED" and board.calls == [("r", 1), ("r", 0)]


@pytest.mark.ray
def test_the_cluster_request_is_every_runs_bundles_and_clears_when_the_last_withdraws(ray_cluster):
    from orchestrator.controller.autoscale import DemandBoard, requested_bundles

    board = DemandBoard()
    try:
        assert board.set("run-a", [{"CPU": 1}] * 2) == [{"CPU": 1.0}] * 2
        board.set("run-b", [{"CPU": 2}])
        assert sorted(map(str, requested_bundles())) == sorted(map(str, [{"CPU": 1.0}] * 2 + [{"CPU": 2.0}]))
        board.set("run-a", [])
        assert requested_bundles() == [{"CPU": 2.0}]
    finally:
        board.set("run-a", [])
        board.set("run-b", [])
    assert requested_bundles() == []
