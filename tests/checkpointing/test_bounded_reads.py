"""Every run-store document read is bounded: a FIFO, a link or an oversize document is refused unread,
naming it (and its cap); events are read newest first up to a count and a size; checkpoint shards are
not capped. Also: what etrain writes beside shared names (the Prometheus target file, the NVMe
offload directory) never goes through a link planted there. Real file stores under tmp_path; the
reads that used to hang or to fill memory run in a child process with a timeout and a memory limit.

    pytest tests/checkpointing/test_bounded_reads.py -x -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpointing.storage.base import DocumentRefused, Storage
from orchestrator.store.run_store import CorruptRunStore, RunSpec, StorageRunStore, open_store

ROOT = str(Path(__file__).resolve().parents[2])

# What `etrain status RUN`, `etrain status` (a store's listing), `etrain queue` and `etrain events RUN` read,
# in a child that may not take more than 1 GiB of memory.
READER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from orchestrator.store.run_store import open_store
from orchestrator.store.user_runs import statuses
url, what = sys.argv[1:3]
store = open_store(url)
try:
    if what == "status":
        store.get_spec("r1"); store.get_status("r1")
    elif what == "listing":
        print(statuses([url], registered=False, strict=True))
    elif what == "allocator":
        store.read_versioned(None, "allocator")
    else:
        store.events("r1")
except Exception as e:
    print(type(e).__name__, e)
"""


def new_store(tmp_path) -> tuple[str, StorageRunStore, Path]:
    url = f"file://{tmp_path}/runs"
    store = open_store(url)
    store.create_run(RunSpec(run_id="r1", config={"run_id": "r1"}, workers=2, min_workers=1, max_workers=4))
    return url, store, tmp_path / "runs" / "r1" / "control"


def read_in_child(url: str, what: str, timeout: float = 20.0) -> str:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", READER, url, what], check=False, cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})
    assert time.monotonic() - t0 < timeout
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("doc,what", [("spec.json", "status"), ("status.json", "status"), ("spec.json", "listing"),
                                      ("events/00000000000000000001-abcdef.json", "events")])
def test_a_fifo_as_a_document_is_refused_at_once_not_waited_on(tmp_path, doc, what):
    url, _, control = new_store(tmp_path)
    path = control / doc
    path.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    out = read_in_child(url, what)
    if what == "listing":  # the run is listed, and its row says why it cannot be read
        assert "'phase': 'unreadable'" in out, out
    else:
        assert out.startswith("CorruptRunStore"), out
    assert f"r1/control/{doc} is a FIFO, not a regular file; refused unread" in out


def test_a_fifo_as_the_allocators_document_is_refused(tmp_path):
    url, _, _ = new_store(tmp_path)
    os.mkfifo(tmp_path / "runs" / "_etrain-allocator.json")
    assert "_etrain-allocator.json is a FIFO" in read_in_child(url, "allocator")


def test_an_event_linked_to_dev_zero_is_refused_without_reading_it(tmp_path):
    url, store, control = new_store(tmp_path)
    store.add_event("r1", {"kind": "started"})
    (control / "events" / "99999999999999999999-zzzzzz.json").symlink_to("/dev/zero")
    out = read_in_child(url, "events")
    assert out.startswith("CorruptRunStore") and "99999999999999999999-zzzzzz.json is a symbolic link" in out, out


@pytest.mark.parametrize("doc,cap,read", [("spec.json", "16 MiB", lambda s: s.get_spec("r1")),
                                          ("status.json", "1 MiB", lambda s: s.get_status("r1")),
                                          ("history.json", "64 MiB", lambda s: s.get_history("r1")),
                                          ("leader.json", "1 MiB", lambda s: s.leader_alive("r1")),
                                          ("spec.json", "16 MiB", lambda s: s.update_spec("r1", workers=3))])
def test_a_document_over_its_cap_is_refused_naming_the_cap(tmp_path, doc, cap, read):
    _, store, control = new_store(tmp_path)
    limit = {"16 MiB": 16 << 20, "1 MiB": 1 << 20, "64 MiB": 64 << 20}[cap]
    with open(control / doc, "wb") as f:
        f.truncate(limit + 1)  # sparse: refused on its size, before a byte is read
    with pytest.raises(CorruptRunStore, match=rf"r1/control/{doc} is bigger than its cap of {cap}; refused unread"):
        read(store)


def test_a_document_at_its_cap_is_read(tmp_path):
    _, store, control = new_store(tmp_path)
    status = json.dumps({"phase": "RUNNING", "pad": ""})
    (control / "status.json").write_text(status[:-2] + "x" * ((1 << 20) - len(status)) + '"}')
    assert os.path.getsize(control / "status.json") == 1 << 20
    assert store.get_status("r1")["phase"] == "RUNNING"


def test_events_are_read_newest_first_up_to_a_count_and_a_size(tmp_path):
    _, store, control = new_store(tmp_path)
    (control / "events").mkdir()
    n = StorageRunStore.MAX_EVENTS + 5
    for i in range(n):  # written directly: a thousand fsync'ed writes would take longer than the test
        (control / "events" / f"{i:020d}-abcdef.json").write_text(json.dumps({"time": i, "kind": "x", "i": i}).ljust(64))
    events = store.events("r1")
    assert len(events) == StorageRunStore.MAX_EVENTS
    assert [e["i"] for e in events] == list(range(5, n))  # the newest, oldest first
    store.EVENTS_BYTES = 10 * 64  # ten of them
    assert [e["i"] for e in store.events("r1")] == list(range(n - 10, n))


def test_checkpoint_shards_are_read_whole_without_a_cap(tmp_path):
    storage = Storage(f"file://{tmp_path}/ckpt")
    storage.put("step-1/shard-0.bin", b"\1" * (20 << 20))  # bigger than any document's cap
    assert len(storage.get("step-1/shard-0.bin")) == 20 << 20
    with pytest.raises(DocumentRefused, match="shard-0.bin is bigger than its cap of 16 MiB"):
        storage.get_bounded("step-1/shard-0.bin", 16 << 20)


def test_a_document_over_its_cap_on_s3_is_refused_unread(s3_server):
    from tests.conftest import new_bucket

    storage = Storage(f"s3://{new_bucket(s3_server)}/runs")
    storage.put("r1/control/status.json", b"{}" + b" " * (1 << 20))
    with pytest.raises(DocumentRefused, match=r"status.json is bigger than its cap of 1 MiB"):
        storage.get_bounded("r1/control/status.json", 1 << 20)
    with pytest.raises(DocumentRefused, match=r"status.json is bigger than its cap of 1 MiB"):
        storage.read_versioned("r1/control/status.json", limit=1 << 20)
    assert storage.get_bounded("r1/control/status.json", 2 << 20).startswith(b"{}")
    assert storage.get_last_bounded("r1/control", ".json", count=5, limit=2 << 20, total=4 << 20).keys() == {
        "r1/control/status.json"}


def test_a_document_over_its_cap_on_another_fsspec_store_is_refused(tmp_path):
    storage = Storage(f"memory://{tmp_path.name}/runs")
    storage.put("doc.json", b"x" * 2048)
    with pytest.raises(DocumentRefused, match="doc.json is bigger than its cap of 1024 bytes"):
        storage.get_bounded("doc.json", 1024)
    assert storage.read_versioned("doc.json", limit=4096)[0] == b"x" * 2048


# --- names planted beside what etrain writes -------------------------------------------------------------


def test_the_prometheus_target_file_is_never_written_through_a_planted_link(tmp_path):
    from trainer.observe.endpoint import MetricsEndpoint
    from trainer.observe.metrics import RunMetrics

    victim = tmp_path / "victim"
    victim.write_text("keep")
    sd = tmp_path / "sd"
    sd.mkdir()
    for name in (f"r1-{os.getpid()}.json.{os.getpid()}.tmp", f"r1-{os.getpid()}.json.tmp"):  # guessable names
        (sd / name).symlink_to(victim)
    endpoint = MetricsEndpoint(RunMetrics("r1"), port=0, file_sd_dir=str(sd))
    try:
        assert json.loads(Path(endpoint.file_sd_path).read_text())[0]["labels"] == {"etrain_run": "r1"}
        assert not os.path.islink(endpoint.file_sd_path)
    finally:
        endpoint.close()
    assert victim.read_text() == "keep"


def test_a_link_planted_in_a_shared_offload_dir_is_refused_naming_it(tmp_path):
    from checkpointing.errors import ConfigError
    from trainer.config.load import load_config
    from trainer.zero.offload import offload_preflight, rank_dir

    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir()
    victim.mkdir()
    cfg = load_config(None, ["parallel.offload=nvme", f"parallel.offload_dir={shared}", "run_id=r1"])
    (shared / "r1").symlink_to(victim)  # another user's link, where this run's directory goes
    with pytest.raises(ConfigError, match=rf"{shared}/r1 is a symbolic link; refused"):
        offload_preflight(cfg, 1, 0)
    assert list(victim.iterdir()) == []
    (shared / "r1").unlink()
    os.makedirs(rank_dir(cfg, 0))
    probe = Path(rank_dir(cfg, 0)) / f".probe-{os.getpid()}"
    probe.symlink_to(victim / "file")
    with pytest.raises(ConfigError, match=r"\.probe-\d+ is a symbolic link"):
        offload_preflight(cfg, 1, 0)
    assert not (victim / "file").exists()
