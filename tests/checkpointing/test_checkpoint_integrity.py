"""Checkpoint integrity and safety: a save never touches committed data, stored bytes never run, a
run id never escapes its root, and every failure is loud.

Hostile and corrupt checkpoints are made the way an attacker or a broken disk would: by writing
the bytes of a real committed checkpoint's files (manifest checksums updated to match where the
attack needs it). The trainer runs as a real process (``python -m trainer``) where the exit status
and the message are the point; on a local directory, and on the moto S3 server where the backend
matters.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from checkpointing import cli as ckpt_cli
from checkpointing.errors import CheckpointError, ConfigError, FencedError, UnsafePathError
from checkpointing.lock import WriterLock, WriterLockHeld
from checkpointing.manager import CheckpointManager
from checkpointing.manifest import MANIFEST_NAME, checksum
from checkpointing.storage.base import MiB, Storage
from tests.harness import ROOT, run_ranks

PY = sys.executable
SMALL = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.ffn_hidden=64",
         "--set", "data.max_bytes=60000", "--set", "data.seq_len=16", "--set", "train.global_batch=4",
         "--set", "train.warmup_steps=1", "--set", "parallel.zero_stage=0", "--set", "metrics.enabled=false"]


def trainer(url: str, *args: str, run_id: str = "tiny", timeout: float = 240, steps: int = 3, interval: int = 1,
            background: bool = False):
    cmd = [PY, "-m", "trainer", "--config", "examples/tiny.toml", *SMALL, "--set", f"train.steps={steps}",
           "--set", f'checkpoint.url="{url}"', "--set", f"checkpoint.interval_steps={interval}",
           "--set", f'run_id="{run_id}"', "--quiet", *args]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def state_of(value: float) -> dict:
    return {"model": {"w": torch.full((64,), value), "b": torch.arange(8, dtype=torch.float32) + value},
            "optim": {"w": {"exp_avg": torch.full((64,), value / 2), "step": torch.tensor(float(value))}},
            "extra": {"note": f"v{value}"}}


def save(mgr: CheckpointManager, step: int, value: float):
    res = mgr.save(step, state_of(value), layout={"world_size": 1}, config_hash="h",
                   trainer_state={"step": step, "samples_consumed": 4 * step})
    mgr.wait()
    return res


def two_steps(url: str, run_id: str = "r") -> CheckpointManager:
    mgr = CheckpointManager(url, run_id, async_save=False, keep_last=10)
    assert save(mgr, 1, 1.0).status == "committed"
    assert save(mgr, 2, 2.0).status == "committed"
    return mgr


def load(mgr: CheckpointManager):
    into = state_of(0.0)
    into["extra"] = {"note": ""}
    m = mgr.load(into)
    return m, into


def put_manifest(mgr: CheckpointManager, step: int, doc) -> None:
    blob = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    # Through the file system, as a broken disk or an attacker would (the storage layer
    # never writes into a committed step).
    mgr.storage.fs.pipe_file(mgr.storage._path(f"{mgr.step_rel(step)}/{MANIFEST_NAME}"), blob)


# --- immutability ---------------------------------------------------------------------


def test_a_restarted_run_that_does_not_resume_is_refused_and_leaves_its_checkpoints_alone(tmp_path):
    url = f"file://{tmp_path}/ck"
    first = trainer(url)
    assert first.returncode == 0, first.stderr
    mgr = CheckpointManager(url, "tiny")
    before = {s: mgr.read_manifest(s).to_json() for s in mgr.committed_steps()}
    assert sorted(before) == [1, 2, 3]
    again = trainer(url)
    assert again.returncode == 2, again.stderr
    assert (f"run 'tiny' already has committed checkpoints at {url}/tiny/checkpoints (newest step 3); "
            "pass --resume to continue it, or choose another run_id") in again.stderr
    assert "Traceback" not in again.stderr
    assert {s: mgr.read_manifest(s).to_json() for s in mgr.committed_steps()} == before
    assert all(mgr.verify(s) == [] for s in before)
    resumed = trainer(url, "--resume", steps=5)
    assert resumed.returncode == 0, resumed.stderr
    assert mgr.committed_steps()[-1] == 5 and all(mgr.verify(s) == [] for s in mgr.committed_steps())


def test_a_second_writer_of_the_same_run_is_refused_while_the_first_holds_it(tmp_path):
    url = f"file://{tmp_path}/ck"
    # The first run is killed below, never finishes: it must hold the lock however fast this machine is.
    first = trainer(url, steps=1_000_000, interval=50, background=True)
    try:
        lock_dir = tmp_path / "ck" / "tiny" / "LOCK"
        deadline = time.monotonic() + 120
        while not (lock_dir.exists() and any(lock_dir.iterdir())):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run never took the writer lock"
            time.sleep(0.2)
        second = trainer(url, "--resume", steps=400, interval=50)
        assert second.returncode == 2, second.stderr
        assert "run 'tiny' is being written by another process: pid" in second.stderr
        assert f"pid {first.pid} on " in second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # Its holder is gone (this host, pid dead): the next writer takes the run at once.
    third = trainer(url, "--resume", steps=1)
    assert third.returncode == 0, third.stderr


def test_writer_lock_rules(storage_url):
    storage = Storage(storage_url)
    a = WriterLock(storage, "r", ttl_s=30)
    a.acquire()
    b = WriterLock(storage, "r", ttl_s=30)
    with pytest.raises(WriterLockHeld, match=f"pid {os.getpid()} on"):
        b.acquire()
    # Same owner, newer epoch: the orchestrator's next group takes over, the old holder is fenced.
    a2 = WriterLock(storage, "r2", owner="store-x", epoch=3)
    a2.acquire()
    newer = WriterLock(storage, "r2", owner="store-x", epoch=4)
    newer.acquire()
    with pytest.raises(FencedError, match="taken over"):
        a2.check()
    older = WriterLock(storage, "r2", owner="store-x", epoch=2)
    with pytest.raises(WriterLockHeld):
        older.acquire()
    other_owner = WriterLock(storage, "r2", owner="store-y", epoch=9)
    with pytest.raises(WriterLockHeld):
        other_owner.acquire()
    # Released: the next writer starts at once.
    a.release()
    b.acquire()
    b.release()
    newer.release()
    # An expired lease (its holder on another host, gone) is taken over.
    stale = WriterLock(storage, "r3", ttl_s=0.2)
    stale.host = "elsewhere"
    stale.acquire()
    stale._stop.set()  # it stops renewing, as a dead holder would
    time.sleep(0.5)
    fresh = WriterLock(storage, "r3")
    fresh.acquire()
    with pytest.raises(FencedError):
        stale.check()
    fresh.release()


def test_a_save_by_a_writer_that_lost_its_lock_fails(tmp_path):
    url = f"file://{tmp_path}/ck"
    mgr = CheckpointManager(url, "r", async_save=False, epoch=1)
    mgr.take_writer_lock(owner="o")
    assert save(mgr, 1, 1.0).status == "committed"
    newer = CheckpointManager(url, "r", async_save=False, epoch=2)
    newer.take_writer_lock(owner="o")
    res = save(mgr, 2, 2.0)
    assert res.status == "failed" and "taken over" in res.error
    assert not mgr.is_committed(2)
    assert [n for n in os.listdir(tmp_path / "ck/r/checkpoints") if n.startswith("step_")] == ["step_000000001"]
    newer.close()


def test_exclusive_writes_never_replace_an_object(storage_url):
    storage = Storage(storage_url, part_size=5 * MiB)
    storage.put("x/small", b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        storage.put("x/small", b"second", exclusive=True)
    big = os.urandom(11 * MiB)  # a multipart upload on S3
    storage.put_parts("x/big", [big], exclusive=True)
    with pytest.raises(FileExistsError):
        storage.put_parts("x/big", [b"z" * (11 * MiB)], exclusive=True)
    assert storage.get("x/small") == b"first" and storage.get("x/big") == big


def test_every_save_attempt_writes_files_of_its_own(tmp_path):
    url = f"file://{tmp_path}/ck"
    mgr = CheckpointManager(url, "r", async_save=False, keep_last=10)
    names = set()
    for step in range(1, 4):
        assert save(mgr, step, float(step)).status == "committed"
        files = {f.path for f in mgr.read_manifest(step).files if f.path.endswith(".distcp")}
        assert files and not files & names
        names |= files
    # A save of a committed step is refused before anything is written.
    before = sorted(os.listdir(tmp_path / "ck/r/checkpoints/step_000000002"))
    res = save(mgr, 2, 9.0)
    assert res.status == "exists" and "already committed" in res.error
    assert sorted(os.listdir(tmp_path / "ck/r/checkpoints/step_000000002")) == before
    assert mgr.verify(2) == []


# --- stored bytes are data ---------------------------------------------------------------------


class _Payload:
    """Unpickling this runs code: it creates a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.compat
def test_traversal_and_pickle_payloads_are_never_read_or_run(tmp_path):
    url = f"file://{tmp_path}/ck"
    mgr = two_steps(url)
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(str(marker)))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.metadata").write_bytes(payload)
    doc = json.loads(mgr.read_manifest(2).to_json())
    # 1. A manifest entry that points outside the checkpoint.
    evil = dict(doc)
    evil["files"] = [f for f in doc["files"] if f["path"] != ".metadata"] + [
        {"path": "../../../../outside/x.metadata", "size": len(payload), "crc32c": checksum(payload)}]
    evil.pop("total_bytes")
    put_manifest(mgr, 2, evil)
    m, state = load(mgr)
    assert m.step == 1 and torch.equal(state["model"]["w"], torch.full((64,), 1.0))
    assert not marker.exists()
    # 2. The DCP metadata replaced by a pickle payload, the manifest's checksum updated to match.
    step2 = tmp_path / "ck/r/checkpoints/step_000000002"
    (step2 / ".metadata").write_bytes(payload)
    doc2 = dict(doc)
    doc2["files"] = [dict(f, size=len(payload), crc32c=checksum(payload)) if f["path"] == ".metadata" else f
                     for f in doc["files"]]
    doc2.pop("total_bytes")
    put_manifest(mgr, 2, doc2)
    m, _ = load(mgr)
    assert m.step == 1 and not marker.exists()
    assert any("not allowed in DCP metadata" in p or "posix.system" in p for p in [str(e) for e in [
        _load_error(mgr, 2)]])
    # 3. A non-tensor item replaced by a pickle payload (inside a shard, checksums updated).
    mgr3 = two_steps(f"file://{tmp_path}/ck3")
    _replace_bytes_item(mgr3, 2, payload)
    m, state = load(mgr3)
    assert m.step == 1 and state["extra"]["note"] == "v1.0" and not marker.exists()
    # The storage layer itself refuses keys outside its root.
    for bad in ("../x", "a/../../x", "/etc/passwd", "a/./b", "a\\b", "a\x00b"):
        with pytest.raises(UnsafePathError):
            mgr.storage.get(bad)
    assert not marker.exists()


def _load_error(mgr: CheckpointManager, step: int) -> Exception:
    try:
        mgr.load(state_of(0.0), step=step)
    except CheckpointError as e:
        return e
    raise AssertionError(f"step {step} loaded")


def _replace_bytes_item(mgr: CheckpointManager, step: int, payload: bytes) -> None:
    """Overwrite the serialized ``extra.note`` item in its shard with ``payload`` (same length or less,
    padded), then fix the manifest's checksum of that shard: only the content is hostile."""
    from checkpointing.dcp.reader import load_metadata

    rel = mgr.step_rel(step)
    md = load_metadata(mgr.storage.get(f"{rel}/.metadata"), "x")
    (loc,) = [loc for idx, loc in md.storage_data.items() if idx.fqn == "extra.note"]
    assert len(payload) <= loc.length + 64, (len(payload), loc.length)
    path = mgr.storage._path(f"{rel}/{loc.relative_path}")
    data = bytearray(open(path, "rb").read())
    padded = payload + b"." * max(0, loc.length - len(payload))
    data[loc.offset : loc.offset + loc.length] = padded[: loc.length]
    open(path, "wb").write(bytes(data))
    doc = json.loads(mgr.read_manifest(step).to_json())
    doc["files"] = [dict(f, size=len(data), crc32c=checksum(bytes(data))) if f["path"] == loc.relative_path else f
                    for f in doc["files"]]
    doc.pop("total_bytes")
    put_manifest(mgr, step, doc)


def test_a_corrupt_metadata_file_is_skipped_not_a_crash(tmp_path):
    url = f"file://{tmp_path}/ck"
    r = trainer(url, steps=3)
    assert r.returncode == 0, r.stderr
    mgr = CheckpointManager(url, "tiny")
    garbage = os.urandom(300)
    (tmp_path / "ck/tiny/checkpoints/step_000000003/.metadata").write_bytes(garbage)
    doc = json.loads(mgr.read_manifest(3).to_json())
    doc["files"] = [dict(f, size=300, crc32c=checksum(garbage)) if f["path"] == ".metadata" else f
                    for f in doc["files"]]
    doc.pop("total_bytes")
    put_manifest(mgr, 3, doc)
    resumed = trainer(url, "--resume", steps=4, interval=0)
    assert resumed.returncode == 0, resumed.stderr
    assert "step_000000003/.metadata is not valid DCP metadata" in resumed.stderr
    assert mgr.committed_steps() == [2, 3, 4] or mgr.latest_committed() == 4


def test_resume_when_no_committed_checkpoint_loads_exits_nonzero_listing_each(tmp_path):
    url = f"file://{tmp_path}/ck"
    assert trainer(url, steps=2).returncode == 0
    mgr = CheckpointManager(url, "tiny")
    for step in (1, 2):
        doc = json.loads(mgr.read_manifest(step).to_json())
        doc["run_id"] = "someone-else"
        put_manifest(mgr, step, doc)
    r = trainer(url, "--resume", steps=4)
    assert r.returncode == 1, r.stderr
    assert "has 2 committed checkpoint(s)" in r.stderr and "none of them loads" in r.stderr
    assert "step 2: " in r.stderr and "step 1: " in r.stderr and "run_id is 'someone-else'" in r.stderr
    assert "starting at step 0" not in r.stdout


def test_a_copied_step_directory_or_another_runs_manifest_is_refused(tmp_path):
    import shutil

    url = f"file://{tmp_path}/ck"
    mgr = two_steps(url)
    base = tmp_path / "ck/r/checkpoints"
    shutil.copytree(base / "step_000000002", base / "step_000000009")
    assert mgr.committed_steps() == [1, 2, 9]
    problems = mgr.verify(9)
    assert problems and "step is 2 but the manifest is in the directory of step 9" in problems[0]
    m, state = load(mgr)
    assert m.step == 2 and torch.equal(state["model"]["w"], torch.full((64,), 2.0))


# --- the fuzz ------------------------------------------------------------------------------------


def _mutations(doc: dict, rng: random.Random):
    """Ways to make a valid manifest invalid: each yields (what, mutated document or bytes)."""
    files = doc["files"]
    shard = next(i for i, f in enumerate(files) if f["path"].endswith(".distcp"))

    def with_file(i, **changes):
        d = json.loads(json.dumps(doc))
        d["files"][i].update(changes)
        return d

    def with_field(key, value):
        d = json.loads(json.dumps(doc))
        if value is _DROP:
            d.pop(key, None)
        else:
            d[key] = value
        return d

    odd = [None, "7", 7.5, [], {}, True, -1, "", "x" * 300, "\u202e", 2 ** 70]
    choices = [
        lambda: ("size type", with_file(shard, size=rng.choice(["12", 1.5, None, [], True]))),
        lambda: ("size off", with_file(shard, size=files[shard]["size"] + rng.choice([-1, 1, 64, -64, 10 ** 6]))),
        lambda: ("negative size", with_file(shard, size=-rng.randint(1, 100))),
        lambda: ("path", with_file(rng.randrange(len(files)), path=rng.choice(
            ["../x.distcp", "../../outside/x.metadata", "/etc/passwd", "a/b.distcp", "..", ".", "",
             "x.pkl", "e1.metadata/../x", "ok.distcp\n", "\u202ex.distcp", 5, None]))),
        lambda: ("duplicate path", with_field("files", files + [files[shard]])),
        lambda: ("checksum format", with_file(rng.randrange(len(files)), crc32c=rng.choice(
            ["", "xyz", "0" * 7, "0" * 9, "DEADBEEF", 12345678, None]))),
        lambda: ("checksum value", with_file(shard, crc32c=f"{(int(files[shard]['crc32c'], 16) + rng.randint(1, 999)) % 2 ** 32:08x}")),
        lambda: ("step", with_field("step", rng.choice([1, 3, 9, -2, "2", 2.0, None]))),
        lambda: ("run id", with_field("run_id", rng.choice(["other", "", "..", "r/..", None, 5]))),
        lambda: ("epoch", with_field("epoch", rng.choice([-1, "0", 0.5, None]))),
        lambda: ("world size", with_field("world_size", rng.choice([0, -3, "2", None]))),
        lambda: ("field type", with_field(rng.choice(["layout", "trainer_state", "extra"]),
                                          rng.choice([None, "7", 7.5, [], True]))),
        lambda: ("field type", with_field(rng.choice(["files", "config_hash"]), rng.choice([None, 7.5, {}, True]))),
        lambda: ("missing field", with_field(rng.choice(["run_id", "step", "epoch", "files", "world_size",
                                                         "format", "format_version"]), _DROP)),
        lambda: ("unknown field", with_field(f"x{rng.randint(0, 99)}", rng.choice(odd))),
        lambda: ("cursor", with_field("trainer_state", {"step": 2, "samples_consumed": rng.choice(
            [-4, "8", 8.5, None])})),
        lambda: ("format", with_field("format_version", rng.choice([0, 99, "2", None, True]))),
        lambda: ("files empty", with_field("files", [])),
        lambda: ("no metadata", with_field("files", [f for f in files if f["path"] != ".metadata"])),
        lambda: ("not json", json.dumps(doc).encode()[: rng.randint(1, 200)]),
        lambda: ("not utf-8", b"\xff\xfe" + os.urandom(rng.randint(0, 50))),
        lambda: ("deep", ("[" * 100_000).encode()),
        lambda: ("not an object", json.dumps(rng.choice([[], 3, "x", None])).encode()),
        lambda: ("created", with_field("created_unix", rng.choice(["now", None, [], float("nan")]))),
        lambda: ("total bytes", with_field("total_bytes", rng.randint(0, 10))),
    ]
    return choices


_DROP = object()


def test_fuzzed_manifests_never_crash_the_tools_and_never_load(tmp_path, capsys):
    url = f"file://{tmp_path}/ck"
    mgr = two_steps(url)
    doc = json.loads(mgr.read_manifest(2).to_json())
    rng = random.Random(20261123)
    choices = _mutations(doc, rng)
    seen: dict[str, int] = {}
    for i in range(220):
        what, mutated = rng.choice(choices)()
        seen[what] = seen.get(what, 0) + 1
        blob = mutated if isinstance(mutated, bytes) else json.dumps(mutated).encode()
        put_manifest(mgr, 2, blob)
        for argv in (["ls", f"{url}/r"], ["ls", f"{url}/r", "--json"], ["verify", f"{url}/r"],
                     ["inspect", f"{url}/r", "--step", "2"], ["inspect", f"{url}/r/checkpoints/step_000000002"]):
            code = ckpt_cli.main(argv)  # never raises
            assert code in (0, 1), (what, argv, code)
            # inspect shows a well-formed manifest as it is; verify checks the bytes too.
            if argv[0] == "verify" or (argv[0] == "inspect" and what != "checksum value"):
                assert code == 1, (what, argv)
        m, state = load(mgr)
        assert m.step == 1, (i, what)
        assert torch.equal(state["model"]["w"], torch.full((64,), 1.0)), what
    capsys.readouterr()
    assert len(seen) >= 20, seen  # the seeded draw covered the kinds of mutation
    put_manifest(mgr, 2, doc)
    assert load(mgr)[0].step == 2  # the untouched manifest still loads


# --- run ids ------------------------------------------------------------------------------------


@pytest.mark.parametrize("run_id", ["..", ".", "a/b", "x" * 300, "a\tb", "a\nb", "a\u200fb", "-a", ""])
def test_the_checkpoint_manager_refuses_unsafe_run_ids(tmp_path, run_id):
    with pytest.raises(ConfigError, match="is not a valid run id"):
        CheckpointManager(f"file://{tmp_path}/ck", run_id)
    assert not (tmp_path / "ck").exists() and sorted(os.listdir(tmp_path)) == []


# --- storage that cannot be written ---------------------------------------------------------------


def _mount_tmpfs(path, size: str, ro: bool = False):
    os.makedirs(path, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True, capture_output=True)


def _umount(path):
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@pytest.mark.slow  # about 10 s
def test_a_url_that_cannot_be_written_is_found_before_training(tmp_path):
    a_file = tmp_path / "plain-file"
    a_file.write_text("x")
    r = trainer(f"file://{a_file}")
    assert r.returncode == 2 and f"cannot write checkpoints to file://{a_file}/tiny" in r.stderr, r.stderr
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "1m", ro=True)
    try:
        r = trainer(f"file://{ro}")
        assert r.returncode == 2 and f"cannot write checkpoints to file://{ro}/tiny" in r.stderr, r.stderr
        assert "Read-only file system" in r.stderr
    finally:
        _umount(ro)
    # An S3 endpoint nobody listens on.
    env_port = _closed_port()
    r = subprocess.run(
        [PY, "-m", "trainer", "--config", "examples/tiny.toml", *SMALL, "--set", 'checkpoint.url="s3://b/x"',
         "--set", "checkpoint.interval_steps=1", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT, AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{env_port}",
                 AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1"))
    assert r.returncode == 2 and "cannot write checkpoints to s3://b/x/tiny" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_s3_without_credentials_is_refused_before_training(s3_server):
    from tests.conftest import new_bucket

    bucket = new_bucket(s3_server)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k == "AWS_ENDPOINT_URL_S3"}
    env.update(PYTHONPATH=ROOT, AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true")
    r = subprocess.run([PY, "-m", "trainer", "--config", "examples/tiny.toml", *SMALL, "--set",
                        f'checkpoint.url="s3://{bucket}/x"', "--set", "checkpoint.interval_steps=1", "--quiet"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert f"cannot write checkpoints to s3://{bucket}/x/tiny" in r.stderr and "credentials" in r.stderr.lower()


def _closed_port() -> int:
    from tests.harness import free_port

    return free_port()


def test_a_full_disk_fails_the_save_and_leaves_no_partial_files(tmp_path):
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "400k")
    try:
        url = f"file://{disk}"
        mgr = CheckpointManager(url, "r", async_save=False, keep_last=10)
        assert save(mgr, 1, 1.0).status == "committed"
        big = {"model": {"w": torch.zeros(200_000)}}  # 800 KB: cannot fit
        res = mgr.save(2, big, layout={}, config_hash="h", trainer_state={"step": 2, "samples_consumed": 8})
        assert res.status == "failed" and "No space left on device" in res.error, res.error
        left = [n for n in os.listdir(disk / "r/checkpoints/step_000000002") if n != "_ranks"]
        assert left == []  # the partial file and the rest of that attempt are gone
        # The disk has room again: the next save commits.
        assert save(mgr, 3, 3.0).status == "committed"
        assert mgr.verify(1) == [] and mgr.verify(3) == []
    finally:
        _umount(disk)


@pytest.mark.slow
def test_consecutive_failed_saves_and_a_failed_final_save_fail_the_run(tmp_path):
    url = f"file://{tmp_path}/ck"
    failing = '--set', 'checkpoint.faults={error_rate = 1.0, ops = ["put"], path_contains = ".distcp"}'
    r = trainer(url, *failing, "--set", "checkpoint.timeout_s=5", steps=8)
    assert r.returncode == 1, r.stderr
    import re

    # Saves are asynchronous: the third failure may be learnt a step later, with a fourth in flight.
    failed = re.search(r"error: (\d+) checkpoints in a row failed", r.stderr)
    assert failed and int(failed.group(1)) in (3, 4) and "not being made durable" in r.stderr, r.stderr
    steps_dir = tmp_path / "ck/tiny/checkpoints"
    # Each failed save removed its own files.
    assert not any(n.endswith(".distcp") for d in steps_dir.iterdir() for n in os.listdir(d))
    # Only the final save fails: exit 1, saying so.
    final = ('--set', 'checkpoint.faults={error_rate = 1.0, ops = ["put"], path_contains = "step_000000004/"}')
    r = trainer(f"file://{tmp_path}/ck2", *final, "--set", "checkpoint.timeout_s=5", steps=4, interval=2)
    assert r.returncode == 1, r.stderr
    assert "the final checkpoint (step 4) failed" in r.stderr
    assert CheckpointManager(f"file://{tmp_path}/ck2", "tiny").committed_steps() == [2]


def test_url_without_interval_saves_the_final_step_and_keep_last_1_keeps_one(tmp_path):
    url = f"file://{tmp_path}/ck"
    r = trainer(url, steps=3, interval=0, timeout=240)
    assert r.returncode == 0, r.stderr
    assert CheckpointManager(url, "tiny").committed_steps() == [3]
    r = trainer(f"file://{tmp_path}/ck2", "--set", "checkpoint.keep_last=1", steps=3, interval=1)
    assert r.returncode == 0, r.stderr
    assert CheckpointManager(f"file://{tmp_path}/ck2", "tiny").committed_steps() == [3]


def test_a_garbage_fence_is_an_error_naming_it(tmp_path):
    mgr = CheckpointManager(f"file://{tmp_path}/ck", "r")
    mgr.storage.put("r/FENCE", b"{not json")
    with pytest.raises(CheckpointError, match=f"the fence file://{tmp_path}/ck/r/FENCE is unreadable"):
        mgr.read_fence()
    mgr.storage.fs.pipe_file(mgr.storage._path("r/FENCE"), b'{"epoch": "7"}')
    with pytest.raises(CheckpointError, match="FENCE is unreadable"):
        mgr.read_fence()


# --- the busy-save decision ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_busy_save_decision_holds_beside_a_cpu_hog(tmp_path):
    """The skip/wait branch is one vote for all ranks: 10 rounds beside a CPU hog, never a hang."""
    hog = subprocess.Popen([PY, "-c", "while True: pass"])
    try:
        for i in range(10):
            res = run_ranks("tests.ckpt_jobs:busy_saves", 2,
                            {"base": BUSY_BASE + [f'checkpoint.url="file://{tmp_path}/ck{i}"']}, timeout=120)
            skip = dict(res[0]["skip"])
            assert skip[1] == "committed" and skip[2] in ("skipped", "committed"), res[0]
            assert res[1]["skip"] == res[0]["skip"], res  # both ranks took the same branch
            assert res[0]["skip_committed"] == [s for s, st in res[0]["skip"] if st == "committed"]
    finally:
        hog.kill()
        hog.wait()


BUSY_BASE = ["data.max_bytes=300000", "data.seq_len=16", "train.global_batch=24", "train.micro_batch=2",
             "model.dim=64", "model.n_layers=2", "model.ffn_hidden=128", "train.warmup_steps=2", "train.steps=40",
             "train.grad_clip=1.0", "checkpoint.timeout_s=20"]


def test_etrain_resume_probes_the_checkpoint_url_first(tmp_path):
    """A run whose checkpoint storage went away is not resumed into saves that all fail."""
    import shutil

    from orchestrator.driver.run import prepare_resume, prepare_run

    ck, store = tmp_path / "ck", f"file://{tmp_path}/store"
    spec, _ = prepare_run("examples/tiny.toml", [f'checkpoint.url="file://{ck}"', "checkpoint.interval_steps=5"],
                          run_id="gone", store=store)
    shutil.rmtree(ck, ignore_errors=True)
    ck.write_text("not a directory any more")
    with pytest.raises(ConfigError, match=f"cannot write checkpoints to file://{ck}/gone"):
        prepare_resume("gone", store, workers=None)
    ck.unlink()
    prepare_resume("gone", store, workers=None)  # writable again: the resume is recorded
