"""Checkpointing pieces on their own: manifest, retention, errors, retries, and the storage seam
against a real local directory and a real S3 protocol server (moto, on loopback)."""

import os
import time

import pytest

from checkpointing.cli import parse_url
from checkpointing.errors import CheckpointError, EtrainError, StorageError
from checkpointing.storage.faults import StorageFaults
from checkpointing.manager import group_rank_errors, retained_steps
from checkpointing.manifest import FORMAT_VERSION, FileEntry, Manifest, checksum, parse_step_dir, step_dir
from checkpointing.storage.retry import RetryPolicy, TransientStorageError, describe, is_transient
from checkpointing.storage.base import MiB, Storage


def test_retention_keeps_last_k_and_every_nth():
    steps = list(range(10, 210, 10))
    assert retained_steps(steps, 3, 0) == {180, 190, 200}
    assert retained_steps(steps, 2, 50) == {50, 100, 150, 190, 200}
    assert retained_steps([], 3, 50) == set()


def test_rank_errors_are_grouped():
    msg = group_rank_errors({3: "ConnectionResetError", 1: "ConnectionResetError", 2: "timeout"})
    assert msg == "ranks 1,3: ConnectionResetError; rank 2: timeout"


def test_manifest_round_trip_and_rejections():
    m = Manifest(run_id="r", step=7, epoch=2, world_size=4, layout={"tp": 1}, config_hash="abc",
                 trainer_state={"samples_consumed": 56}, files=[FileEntry(".metadata", 10, checksum(b"x" * 10))])
    back = Manifest.from_json(m.to_json())
    assert back == m and back.total_bytes == 10
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Manifest.from_json(b'{"format": "etrain-che')
    with pytest.raises(CheckpointError, match="not an etrain manifest"):
        Manifest.from_json(b'{"hello": 1}')
    bad_version = m.to_json().replace(f'"format_version": {FORMAT_VERSION}'.encode(), b'"format_version": 99')
    with pytest.raises(CheckpointError, match="format version 99"):
        Manifest.from_json(bad_version)
    assert step_dir(42) == "step_000000042" and parse_step_dir("step_000000042") == 42
    assert parse_step_dir("step_42") is None and parse_step_dir("step_000000042.tmp") is None


def test_ckpt_url_parsing():
    assert parse_url("s3://b/runs/r1") == ("s3://b/runs", "r1", None)
    assert parse_url("s3://b/runs/r1/checkpoints/") == ("s3://b/runs", "r1", None)
    assert parse_url("file:///x/r1/checkpoints/step_000000010") == ("file:///x", "r1", 10)
    with pytest.raises(EtrainError):
        parse_url("s3://")


def test_transient_classification():
    class ClientError(Exception):
        def __init__(self, code, status):
            self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}

    assert is_transient(TransientStorageError("x"))
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(ClientError("SlowDown", 503))
    assert is_transient(ClientError("InternalError", 500))
    assert not is_transient(ClientError("AccessDenied", 403))
    assert not is_transient(ClientError("NoSuchBucket", 404))
    assert not is_transient(ValueError("bad"))


def test_retry_policy_retries_then_gives_up():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    policy = RetryPolicy(attempts=5, backoff_s=0.001, max_backoff_s=0.01)
    assert policy.call(flaky, what="flaky") == "ok" and len(calls) == 3
    with pytest.raises(StorageError, match="always failed: ConnectionResetError"):
        policy.call(lambda: (_ for _ in ()).throw(ConnectionResetError("down")), what="always")
    calls.clear()

    def denied():
        calls.append(1)
        raise PermissionError("denied")

    with pytest.raises(StorageError):
        policy.call(denied, what="denied")
    assert len(calls) == 1  # not transient: no retry


def test_storage_round_trip(storage_url):
    s = Storage(storage_url, part_size=5 * MiB, concurrency=4)
    big = os.urandom(12 * MiB + 123)  # three multipart parts on S3
    s.put_many([("a/small.bin", b"hello"), ("a/big.bin", big), ("a/sub/x.json", b"{}")])
    assert s.get("a/small.bin") == b"hello"
    assert s.get_many(["a/big.bin"])["a/big.bin"] == big
    listing = s.list_dir("a")
    assert listing == {"small.bin": 5, "big.bin": len(big), "sub": None}
    assert s.exists("a/small.bin") and not s.exists("a/nope.bin")
    with pytest.raises(FileNotFoundError):
        s.get("a/nope.bin")
    s.put("a/commit.json", b"1", exclusive=True)
    with pytest.raises(FileExistsError):
        s.put("a/commit.json", b"2", exclusive=True)
    assert s.get("a/commit.json") == b"1"
    s.delete_tree("a")
    assert s.list_dir("a") == {}
    assert s.list_dir("never/was") == {}


def test_a_rewritten_local_object_is_read_whole_or_not_at_all(tmp_path):
    """The writer lock's holder rewrites its generation while other processes read it: a reader in
    another process must see one whole version, never an empty or half-written file."""
    import subprocess
    import sys
    s = Storage(f"file://{tmp_path}/r")
    versions = [bytes([65 + i]) * (256 * 1024) for i in range(4)]
    s.put("LOCK/000000000001.json", versions[0], exclusive=True)
    reader = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from checkpointing.storage.base import Storage\n"
        f"s = Storage('file://{tmp_path}/r'); bad = 0; end = time.monotonic() + 1.5\n"
        "while time.monotonic() < end:\n"
        "    b = s.get('LOCK/000000000001.json'); bad += len(b) != 256 * 1024 or len(set(b)) != 1\n"
        "    assert set(s.list_dir('LOCK')) == {'000000000001.json'}, s.list_dir('LOCK')\n"
        "print(bad)\n")], stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    i = 0
    while reader.poll() is None:
        i += 1
        s.put("LOCK/000000000001.json", versions[i % 4])
    out, _ = reader.communicate()
    assert reader.returncode == 0 and out.strip() == "0", out
    assert i > 20 and os.listdir(tmp_path / "r" / "LOCK") == ["000000000001.json"]


def test_storage_retries_injected_faults(storage_url):
    faults = StorageFaults(error_rate=0.4, delay_s=0.01, seed=3)
    s = Storage(storage_url, part_size=5 * MiB, faults=faults,
                retry=RetryPolicy(attempts=12, backoff_s=0.001, max_backoff_s=0.01))
    data = os.urandom(11 * MiB)
    s.put_many([(f"f/{i}.bin", data) for i in range(3)])
    assert all(v == data for v in s.get_many([f"f/{i}.bin" for i in range(3)]).values())
    assert faults.injected["error"] > 0


def test_storage_outage_fails_within_its_bound(storage_url):
    s = Storage(storage_url, faults=StorageFaults(fail_after=0),
                retry=RetryPolicy(attempts=100, backoff_s=0.05, max_backoff_s=0.2, deadline_s=1.5))
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="injected storage fault"):
        s.put("x.bin", b"data")
    assert time.monotonic() - t0 < 5


def test_stalled_request_is_cut_off(storage_url):
    s = Storage(storage_url, faults=StorageFaults(delay_s=30),
                retry=RetryPolicy(attempts=2, backoff_s=0.01, request_timeout_s=0.5, deadline_s=2))
    t0 = time.monotonic()
    with pytest.raises(StorageError):
        s.put("slow.bin", b"data")
    assert time.monotonic() - t0 < 5


def test_errors_never_show_credentials(s3_server):
    s = Storage("s3://no-such-bucket-here/x")
    with pytest.raises((StorageError, FileNotFoundError)) as e:
        s.put("a.bin", b"1")
    assert "testing" not in str(e.value)  # the access key and secret used here


def test_a_dcp_failure_is_described_by_each_ranks_own_error():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise ValueError("chunk sizes disagree for model.w")
    except ValueError as e:
        wrapped = _wrap_exception(e)
    text = describe(CheckpointException("step", {1: wrapped}))
    assert text == "rank 1: ValueError: chunk sizes disagree for model.w"


def test_a_fenced_writer_never_touches_the_files_of_a_committed_checkpoint(tmp_path):
    """A stale writer (an old epoch, cut off or paused while a newer epoch formed) that saves the same step
    after the newer epoch committed it: its commit is refused, and the committed checkpoint stays whole
    (each epoch writes files of its own names, the DCP metadata included)."""
    import torch

    from checkpointing.manager import CheckpointManager

    url = f"file://{tmp_path}/ckpt"

    def save(epoch: int, value: float, n: int):
        mgr = CheckpointManager(url, "r", epoch=epoch, async_save=False)
        state = {"model": {"w": torch.full((n,), value)}}
        return mgr, mgr.save(5, state, layout={"world_size": 1}, config_hash="h",
                             trainer_state={"step": 5, "samples_consumed": 10})

    new, res = save(2, 1.0, 1000)
    new.write_fence(2)
    assert res.status == "committed"
    stale_mgr, stale = save(1, 7.0, 300)  # the old epoch's save of the same step, with another layout
    assert stale.status == "exists" and "already committed" in stale.error  # refused before any upload
    assert sorted(os.listdir(f"{tmp_path}/ckpt/r/checkpoints/step_000000005")) == sorted(
        [f.path for f in new.read_manifest(5).files] + ["MANIFEST.json", "_ranks"])
    # A step the new epoch has not committed yet: the stale writer uploads, the fence refuses
    # its commit, and it removes what it wrote.
    late = stale_mgr.save(6, {"model": {"w": torch.full((300,), 7.0)}}, layout={"world_size": 1},
                          config_hash="h", trainer_state={"step": 6, "samples_consumed": 12})
    assert late.status == "failed" and "fenced off by epoch 2" in late.error
    assert [n for n in os.listdir(f"{tmp_path}/ckpt/r/checkpoints/step_000000006") if n != "_ranks"] == []
    assert new.verify(5) == []
    into = {"model": {"w": torch.zeros(1000)}}
    assert new.load(into).epoch == 2 and torch.equal(into["model"]["w"], torch.full((1000,), 1.0))


def test_a_device_copy_that_fails_in_the_save_thread_fails_that_save_only(tmp_path):
    """Async saves of CUDA state wait for their side-stream copy in the save thread (the trainer goes on). A
    copy that fails there (simulated: no GPU here) fails that save, commits nothing, and the next save
    commits as usual."""
    import torch

    from checkpointing.manager import CheckpointManager

    class FailedCopy:
        def wait(self):
            raise RuntimeError("CUDA error: an illegal memory access (injected)")

    mgr = CheckpointManager(f"file://{tmp_path}/ckpt", "r", async_save=True)
    real = mgr._host.copy_async
    mgr._host.copy_async = lambda state, **kw: FailedCopy()
    state = {"model": {"w": torch.full((64,), 1.0)}}
    assert mgr.save(3, state, layout={"world_size": 1}, config_hash="h",
                    trainer_state={"step": 3, "samples_consumed": 6}) is None  # the caller did not wait
    mgr.wait()
    (res,) = mgr.poll()
    assert res.status == "failed" and "staging failed: RuntimeError: CUDA error" in res.error, res
    assert mgr.committed_steps() == []
    mgr._host.copy_async = real
    mgr.save(4, state, layout={"world_size": 1}, config_hash="h", trainer_state={"step": 4, "samples_consumed": 8})
    mgr.wait()
    assert [r.status for r in mgr.poll()] == ["committed"] and mgr.committed_steps() == [4]


def test_an_async_save_holds_the_state_as_of_the_save_though_its_host_copy_is_made_later(tmp_path):
    """An async save of host state returns before copying it (after the first save of a layout, which indexes
    it): the save thread makes the copy, or the training thread does in ``fence_writes()`` before the optimizer
    writes in place, or the manager before a load writes the state. Here the save thread is held, so the copy
    can only come from the fence or the load: the committed steps hold the values as of their saves."""
    import threading

    import torch

    from checkpointing.host_copy import fence_writes
    from checkpointing.manager import CheckpointManager

    mgr = CheckpointManager(f"file://{tmp_path}/ckpt", "r", async_save=True, keep_last=10)
    state = {"model": {"w": torch.full((4096,), 1.0)}, "optim": {"w": {"exp_avg": torch.full((4096,), -1.0)}}}

    def save(step):
        return mgr.save(step, state, layout={"world_size": 1}, config_hash="h",
                        trainer_state={"step": step, "samples_consumed": 2 * step})

    assert save(1) is None  # a new layout: indexed and copied in the call
    mgr.wait()
    go, run = threading.Event(), mgr._save_when_copied
    mgr._save_when_copied = lambda *a: (go.wait(timeout=60), run(*a))[1]
    for t in state["model"]["w"], state["optim"]["w"]["exp_avg"]:
        t.fill_(2.0)
    assert save(2) is None
    fence_writes()  # what the training loop calls before optimizer.step
    state["model"]["w"].fill_(5.0)  # the optimizer's in-place write, before the save thread ran
    go.set()
    mgr.wait()
    go.clear()
    state["optim"]["w"]["exp_avg"].fill_(7.0)
    assert save(3) is None
    loaded = mgr.load(state)  # the newest committed step is 2: its values overwrite the state saved as 3
    assert loaded.step == 2 and torch.equal(state["model"]["w"], torch.full((4096,), 2.0))
    go.set()
    mgr.wait()
    assert [r.status for r in mgr.poll()] == ["committed"] * 3
    into = {"model": {"w": torch.zeros(4096)}, "optim": {"w": {"exp_avg": torch.zeros(4096)}}}
    assert mgr.load(into, step=3).step == 3
    assert torch.equal(into["model"]["w"], torch.full((4096,), 5.0))
    assert torch.equal(into["optim"]["w"]["exp_avg"], torch.full((4096,), 7.0))
