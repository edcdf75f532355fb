"""The memory tier's budget and what a run tells of the tier.

The default budget derives from the host's available memory (``/proc/meminfo``'s MemAvailable, capped by
the process's cgroup limit), shared by the ranks on the host; here the kernel's files are stood in for by
files of the same format. Every turn-off, budget refusal and fallback to the durable checkpoint is an
event of the run (kind ``memory_tier``), a line of ``etrain run``'s output and part of its status: the
controller is stepped against a fake worker group whose workers report what the real ones do.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from checkpointing.errors import ConfigError
from checkpointing.recovery.budget import available_bytes, tier_budget
from orchestrator.config import RecoveryConfig, recovery_from_raw
from orchestrator.driver.progress import describe_event, tier_status_line
from orchestrator.workers.results import Formed, Restored
from tests.fake_group import FakeGroup
from tests.orchestrator.test_controller import Rig

GiB = 1 << 30


def meminfo(tmp_path, available_kib: int | None) -> str:
    path = tmp_path / "meminfo"
    lines = ["MemTotal:       65536000 kB", "MemFree:          123456 kB"]
    if available_kib is not None:
        lines.append(f"MemAvailable:   {available_kib} kB")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def cgroup(tmp_path, line: str, files: dict[str, str]) -> tuple[str, str]:
    """A cgroup filesystem under ``tmp_path/cg`` with ``files`` (relative path -> text) and a
    ``/proc/self/cgroup`` of ``line``."""
    root = tmp_path / "cg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self_cgroup").write_text(line + "\n")
    return str(root), str(tmp_path / "self_cgroup")


def test_the_default_budget_is_a_share_of_the_hosts_available_memory(tmp_path):
    assert RecoveryConfig().memory_budget_bytes == 0 and RecoveryConfig().memory_budget_fraction == 0.5
    avail = available_bytes(meminfo(tmp_path, 8 * GiB // 1024), str(tmp_path / "none"), str(tmp_path / "none"))
    assert avail == 8 * GiB
    b = tier_budget(0, 0.5, ranks_on_host=4, available=avail)
    assert (b.bytes, b.how) == (GiB, "derived")
    assert b.describe() == "1.0 GiB per rank (0.5 of 8.0 GiB available on its host, 4 ranks)"
    # What this worker's tier already holds (kept from the group before) is not counted as taken.
    assert tier_budget(0, 0.5, ranks_on_host=4, held_bytes=2 * GiB, available=avail).bytes == 2 * GiB
    assert (tier_budget(123, available=avail).bytes, tier_budget(123).how) == (123, "explicit")
    assert (tier_budget(-1).bytes, tier_budget(-1).how) == (0, "none")  # -1: no bound, asked for
    unknown = tier_budget(0, available_bytes(meminfo(tmp_path, None)))
    assert (unknown.bytes, unknown.how) == (0, "unknown") and "could not be read" in unknown.describe()


def test_a_cgroup_limit_caps_the_available_memory(tmp_path):
    info = meminfo(tmp_path, 64 * GiB // 1024)
    # v2: the process's group has no limit, its parent (a pod) 4 GiB of which 3 are used.
    fs, self_cg = cgroup(tmp_path, "0::/kubepods/pod1/ctr", {
        "kubepods/pod1/ctr/memory.max": "max\n", "kubepods/pod1/ctr/memory.current": "100\n",
        "kubepods/pod1/memory.max": f"{4 * GiB}\n", "kubepods/pod1/memory.current": f"{3 * GiB}\n"})
    assert available_bytes(info, fs, self_cg) == GiB
    # v1 inside a container: the mount is the container's own group; no limit means the page-rounded max.
    fs, self_cg = cgroup(tmp_path / "v1", "4:memory:/docker/abc", {
        "memory/memory.limit_in_bytes": f"{2 * GiB}\n", "memory/memory.usage_in_bytes": f"{GiB // 2}\n"})
    assert available_bytes(info, fs, self_cg) == GiB + GiB // 2
    fs, self_cg = cgroup(tmp_path / "v1u", "4:memory:/", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5\n"})
    assert available_bytes(info, fs, self_cg) == 64 * GiB


@pytest.mark.parametrize("table, message", [
    ({"memory_budget_bytes": -2}, "recovery.memory_budget_bytes=-2 must be an integer: bytes per rank, 0 to derive"),
    ({"memory_budget_fraction": 0.0}, "recovery.memory_budget_fraction=0.0 must be a number in (0, 1]"),
    ({"memory_budget_fraction": 1.5}, "recovery.memory_budget_fraction=1.5"),
    ({"memory_budget_fraction": float("nan")}, "recovery.memory_budget_fraction=nan"),
])
def test_budget_settings_out_of_range_name_the_field(table, message):
    with pytest.raises(ConfigError) as e:
        recovery_from_raw({"recovery": table})
    assert message in str(e.value)
    assert recovery_from_raw({"recovery": {"memory_budget_bytes": -1}}).memory_budget_bytes == -1


# --- what the run tells ------------------------------------------------------------------------------

BUDGET = {"budget_bytes": 100_000, "budget": "explicit", "available_bytes": None, "ranks_on_host": 1,
          "fraction": 0.5, "describe": "97.7 KiB per rank (memory_budget_bytes)"}
OFF_AT = 3


class TierGroup(FakeGroup):
    """Workers with a memory tier as the real ones report it: a budget from every restore, and (rank 0,
    once) the tier turned off over its budget after step ``OFF_AT``, in its progress."""

    told = False

    def _execute(self, w, call, method, args):
        super()._execute(w, call, method, args)
        value = call.ref.value if call.ref.done else None
        if method == "restore" and isinstance(value, Restored):
            call.ref.value = replace(value, memory_tier={**BUDGET, "rank": w.rank})
        if method == "form" and isinstance(value, Formed) and value.restored is not None:  # formed, then restored
            call.ref.value = replace(value, restored=replace(value.restored, memory_tier={**BUDGET, "rank": w.rank}))
        if method == "progress" and isinstance(value, dict) and w.rank == 0 and w.step >= OFF_AT and not self.told:
            TierGroup.told = True
            value["memory_tier"] = [{"action": "off", "step": OFF_AT, "rank": 1, "bytes": 150_000,
                                     "budget_bytes": 100_000, "ranks": [1],
                                     "reason": "memory snapshot of step 3 not taken: rank 1 would hold 150000 "
                                               "bytes (...), over memory_budget_bytes=100000"}]


def test_a_turn_off_and_a_fallback_are_events_lines_and_status(tmp_path):
    from tests.fake_group import Fault

    TierGroup.told = False
    r = Rig(tmp_path, workers=2, faults=[Fault(rank=1, step=7, kind="die")], group=TierGroup)
    try:
        r.drive()
    finally:
        r.close()
    assert r.ctl.state.name == "FINISHED"
    formed = r.events("formed")
    assert formed[0]["memory_tier"]["min_budget_bytes"] == 100_000
    tier = r.events("memory_tier")
    assert [e["action"] for e in tier] == ["off", "fallback"], tier
    off, fallback = tier
    assert (off["rank"], off["bytes"], off["budget_bytes"], off["step"]) == (1, 150_000, 100_000, OFF_AT)
    assert fallback["step"] == 5 and "no worker holds a snapshot in memory" in fallback["reason"]
    # etrain run's lines
    assert describe_event(off) == ("[memory tier] off at step 3: rank 1 would hold 146.5 KiB, over its budget of "
                                   "97.7 KiB ([recovery] memory_budget_bytes); recoveries restore from the checkpoint")
    assert describe_event(fallback).startswith("[memory tier] step 5 from the checkpoint, not memory: ")
    # etrain status: the group formed after the recovery has the tier on again (a tier of its own)
    st = r.status()["memory_tier"]
    assert st["state"] == "on" and st["fallbacks"] == 1 and "no worker holds" in st["last_fallback"]
    assert tier_status_line(r.status()).startswith("memory tier: on, budget 97.7 KiB per rank (memory_budget_bytes); "
                                                   "1 restore(s) from the checkpoint instead")


def test_the_status_line_says_when_the_tier_is_off():
    off = {"memory_tier": {"state": "off", "since_step": 3, "reason": "rank 1 would hold ...", "fallbacks": 0}}
    assert tier_status_line(off) == "memory tier: off since step 3 (rank 1 would hold ...)"
    assert tier_status_line({"memory_tier": {"state": "disabled"}}).endswith("memory_every_steps = 0)")
    assert tier_status_line({}) is None
    refused = {"kind": "memory_tier", "action": "refused", "step": 9, "rank": 0, "bytes": 2048, "budget_bytes": 1024}
    assert describe_event(refused) == ("[memory tier] snapshot of step 9 refused: rank 0 would hold 2.0 KiB, over "
                                       "its budget of 1.0 KiB ([recovery] memory_budget_bytes); the resize commits "
                                       "a checkpoint")


class RefusingGroup(FakeGroup):
    """Workers whose tier refuses the resize's snapshot over the budget (``memory_flush``)."""

    def _execute(self, w, call, method, args):
        super()._execute(w, call, method, args)
        if method == "restore":
            call.ref.value = replace(call.ref.value, memory_tier={**BUDGET, "rank": w.rank})
        if method == "memory_flush":
            call.ref.value.update(reason="memory snapshot of step 6 not taken: ...", refused={
                "action": "refused", "step": w.step, "rank": 0, "bytes": 150_000, "budget_bytes": 100_000,
                "ranks": [0], "reason": "memory snapshot of step 6 not taken: ..."})


def test_a_resize_whose_snapshot_is_refused_says_so_and_goes_through_storage(tmp_path):
    r = Rig(tmp_path, workers=2, group=RefusingGroup)
    try:
        r.drive_to_step(6)
        r.store.update_spec("r", workers=4)
        r.drive(lambda rig: rig.events("resized"))
    finally:
        r.close()
    refused, fallback = r.events("memory_tier")
    assert (refused["action"], refused["rank"], refused["bytes"], refused["budget_bytes"]) == ("refused", 0,
                                                                                                150_000, 100_000)
    assert fallback["action"] == "fallback" and fallback["step"] == refused["step"]
    assert fallback["reason"] == "the resize commits a checkpoint: memory snapshot of step 6 not taken: ..."
    assert r.events("resized")[0]["to_workers"] == 4
