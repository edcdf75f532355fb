"""A user's size sticks, and every live run stays the allocator's (docs/service.md#a-users-size): the allocator
on real run stores (file://) with the cluster's capacity given, `etrain resize` and `Run.resize` as a user calls
them, and what the run's own output says about who decided its size. On a live Ray cluster:
tests/orchestrator/test_service.py."""

from __future__ import annotations

import time

import pytest

from checkpointing.errors import ConfigError
from orchestrator.cli.main import main
from orchestrator.service.allocator import AllocatorCore
from orchestrator.service.demand import size_reason
from orchestrator.service.resize import resize_run
from orchestrator.store.run_store import open_store
from tests.orchestrator.test_allocator import a_running_and_b_queued_above_it, allocator, key, kinds, make_run


@pytest.fixture
def store(tmp_path):
    return open_store(f"file://{tmp_path}/runs")


def test_a_users_shrink_is_not_undone_by_idle_capacity_until_growth_is_allowed(store):
    make_run(store, "r", workers=2, min_workers=1, max_workers=3)
    spec = resize_run(store, "r", 1)  # `etrain resize r --workers 1`
    assert (spec.workers, spec.pinned, spec.target) == (1, True, 0)
    core = allocator(store, capacity=8)
    core.tick()
    core.tick()
    assert store.get_spec("r").target in (0, 1), "the allocator grew a run its user had shrunk"
    assert not kinds(store, "r", "allocated")
    spec = resize_run(store, "r", None, allow_growth=True)  # `etrain resize r --allow-growth`
    assert (spec.workers, spec.pinned) == (1, False)
    core.tick()
    assert store.get_spec("r").target == 3 and kinds(store, "r", "allocated")[-1]["cause"] == "idle"


def test_a_pinned_run_still_gives_way_to_a_higher_priority_and_gets_its_size_back(store):
    a_running_and_b_queued_above_it(store)
    resize_run(store, "a", 3)  # pinned at the size it runs at
    allocator(store, capacity=3).tick()
    a = store.get_spec("a")
    assert (a.workers, a.target, a.pinned) == (3, 1, True), "a pin is not a claim against higher priorities"
    assert a.target_cause.startswith("preempted: ")
    why = size_reason(a)
    assert why.startswith("the cluster's allocator: 1 workers (preempted: ") and str(a.target_cause) in why


def test_a_size_beyond_max_workers_raises_it_and_an_invalid_one_names_the_valid_sizes(store):
    make_run(store, "r", workers=2, min_workers=2, max_workers=2)
    spec = resize_run(store, "r", 3, field="--workers")  # the quick start's `etrain resize tiny --workers 3`
    assert (spec.workers, spec.max_workers, spec.min_workers) == (3, 3, 2)
    with pytest.raises(ConfigError, match=r"--workers 5 is not a valid size for run 'r'; valid sizes in "
                                          r"\[min 2, max 5\]: \[2, 3, 4\]"):
        resize_run(store, "r", 5, field="--workers")
    with pytest.raises(ConfigError, match=r"--workers 1 is not a valid size .*\[min 2, max 3\]: \[2, 3\]"):
        resize_run(store, "r", 1, field="--workers")  # below min_workers: the run would wait, not train
    with pytest.raises(ConfigError, match=r"give a size \(--workers N\), or .* \(--allow-growth\)"):
        resize_run(store, "r", None, field="--workers")
    assert store.get_spec("r").workers == 3, "a refused resize changed the run"


def test_etrain_resize_says_the_size_sticks_and_allow_growth_gives_room_back(store, capsys):
    make_run(store, "r", workers=2, min_workers=1, max_workers=2)
    lease = store.acquire("r", "ctl-r")  # its controller holds the run: it is live
    store.put_status("r", {"run_id": "r", "phase": "RUNNING", "world_size": 2, "updated_unix": time.time()}, lease)
    assert main(["resize", "r", "--workers", "3", "--store", store.url]) == 0
    out = capsys.readouterr().out
    assert "resizes 2 -> 3 workers" in out and "The size sticks" in out and "--allow-growth" in out
    assert main(["resize", "r", "--allow-growth", "--store", store.url]) == 0
    assert "may grow into idle capacity again, up to 3 workers" in capsys.readouterr().out
    assert not store.get_spec("r").pinned
    assert main(["resize", "r", "--store", store.url]) == 2  # neither a size nor --allow-growth


def test_the_users_own_size_is_named_as_the_users(store):
    make_run(store, "r", workers=2, min_workers=1, max_workers=3)
    assert size_reason(store.get_spec("r")) == "its user asked for 2 workers"
    assert size_reason(resize_run(store, "r", 1)) == "its user asked for 1 workers (pinned)"


@pytest.mark.parametrize("phase", ["SUSPENDED", "INTERRUPTED", "FAILED"])
def test_a_run_whose_controller_lives_is_never_forgotten_whatever_its_status_still_says(store, phase):
    """A resumed run registers when its controller starts; its status says SUSPENDED until the controller
    writes its own. Forgotten then, it was never the allocator's again (no target, no quota, no preemption)."""
    make_run(store, "r", workers=2, min_workers=1, max_workers=2, phase=phase)
    live = {"r"}
    core = AllocatorCore(store, capacity=lambda cpw, gpw: 4, alive=lambda run_id, url: run_id in live)
    core.register("r", store.url)
    (ev,) = [e for e in store.events("r") if e["kind"] == "allocator"]
    assert ev["action"] == "registered" and ev["key"] == key(store, "r")  # on the run: `etrain events` shows it
    core.tick()
    assert key(store, "r") in core.runs(), "the allocator forgot a run whose controller is live"
    live.clear()  # its controller ended: the run is done with
    core.tick()
    assert key(store, "r") not in core.runs()
