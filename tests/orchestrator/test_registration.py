"""Every run is the allocator's, however it started or resumed (docs/service.md#a-users-size), on the session's
real Ray cluster on 127.0.0.1: a run started, suspended and resumed stays in the allocator's registry and in its
decisions while its controller lives (its status says SUSPENDED until the resumed controller writes its own),
and a user's shrink sticks against the idle nodes. The allocator's rules on file stores without Ray:
tests/orchestrator/test_user_size.py."""

from __future__ import annotations

import time

import pytest

from tests.cluster import follow, start_run
from tests.orchestrator.test_ray_job_controls import registrations


def decided_after(alloc, since: float, rounds: int = 2, timeout: float = 60.0) -> dict:
    """The allocator's state once it has decided ``rounds`` more times after ``since`` (its interval apart)."""
    import ray

    from orchestrator.service.allocator import INTERVAL_S

    deadline = time.monotonic() + timeout
    while True:
        state = ray.get(alloc.state.remote(), timeout=30)
        if state.get("decided_unix", 0) > since + rounds * INTERVAL_S:
            return state
        assert time.monotonic() < deadline, f"the allocator made no decision within {timeout:.0f} s: {state}"
        time.sleep(0.5)


@pytest.mark.ray
def test_a_resumed_run_stays_the_allocators_and_a_users_shrink_sticks(ray_cluster, tmp_path):
    from orchestrator.driver.run import prepare_resume
    from orchestrator.service.allocator import controller_alive, find_allocator
    from orchestrator.service.resize import resize_run
    from orchestrator.store.cluster_names import cluster_key

    root = f"file://{tmp_path}/runs"
    run, store = start_run(root, "train.steps=2000", workers=2, min_workers=1, max_workers=3, run_id="reg")
    run.wait(lambda s: s["phase"] == "RUNNING" and s["world_size"] == 3, what="the run grown into the idle nodes",
             timeout=120)
    key = cluster_key("reg", store.url)
    assert registrations(store, "reg") == 1
    assert controller_alive("reg", store.url) and not controller_alive("reg", f"{root}-other")

    resize_run(store, "reg", 1)  # `etrain resize reg --workers 1`: the size sticks
    run.wait(lambda s: s["world_size"] == 1, what="the user's shrink", timeout=120)
    state = decided_after(find_allocator(), time.time())
    assert state["targets"].get(key) == 1 and run.snapshot()["world_size"] == 1, state
    shrink = [e for e in store.events("reg") if e["kind"] == "resized"][-1]
    assert "its user asked for 1 workers (pinned)" in shrink["reason"], shrink

    store.update_spec("reg", suspended=True)
    assert run.join(300)["phase"] == "SUSPENDED"
    run.close()
    assert not controller_alive("reg", store.url)

    spec, _ = prepare_resume("reg", store.url, None)  # as `etrain resume reg` does, in this process
    resumed = follow(spec, store)
    resumed.wait(lambda s: s["phase"] == "RUNNING", what="the resumed run training", timeout=120)
    state = decided_after(find_allocator(), time.time())
    assert key in state["runs"] and state["targets"].get(key) == 1, f"the resumed run is not the allocator's: {state}"
    assert registrations(store, "reg") == 2
    store.update_spec("reg", stop=True)
    assert resumed.join(300)["phase"] == "FINISHED"
