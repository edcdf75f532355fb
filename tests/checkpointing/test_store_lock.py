"""The local compare-and-swap lock never loses an update: real file stores under tmp_path, real processes.

A holder stopped (SIGSTOP) while another writer waits keeps the lock, however old its file looks; a
killed holder's lock costs its waiters nothing and lets them in one at a time; a lock file dated in
the future or left behind blocks nobody; a lock held past the wait is named, not "unreachable".
The directory lock used where the file system has no record locks is tested the same way.

    pytest tests/checkpointing/test_store_lock.py -x -q
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from checkpointing.storage import local
from checkpointing.storage.base import LockHeld, Storage
from checkpointing.storage.doc_lock import LockLost, OwnerDir
from orchestrator.store.run_store import RunSpec, StoreUnavailable, open_store

ROOT = str(Path(__file__).resolve().parents[2])

# One compare-and-swap writer: reads the document, then writes its own bytes if it is unchanged. With
# "slow", it sits 1 s (a slow fsync) between its compare and its write, the lock in hand.
WRITER = """
import sys
from checkpointing.storage.base import Storage
from checkpointing.storage.faults import StorageFaults
url, rel, mine, slow = sys.argv[1:5]
faults = StorageFaults(ops=("cas",), delay_s=float(slow)) if float(slow) else None
s = Storage(url, faults=faults)
_, version = s.read_versioned(rel)
print("read", flush=True)
print(s.write_if(rel, mine.encode(), version), flush=True)
"""

# Adds 1 to a counter document N times by compare-and-swap; prints how many of its writes were accepted.
COUNTER = """
import sys, time
from checkpointing.storage.base import Storage
url, rel, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s, won, t0 = Storage(url), 0, time.monotonic()
while won < n:
    data, version = s.read_versioned(rel)
    won += s.write_if(rel, str(int(data) + 1).encode(), version)
print(won, round(time.monotonic() - t0, 3), flush=True)
"""

# The same through the directory lock alone (file systems without record locks), on a counter file.
OWNER_COUNTER = """
import sys, time
from checkpointing.storage.doc_lock import OwnerDir
from checkpointing.storage.local import replace_file
lock, counter, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for _ in range(n):
    held = OwnerDir(lock)
    held.take(time.monotonic() + 10, 10)
    with open(counter) as f:
        value = int(f.read())
    replace_file(counter, str(value + 1).encode(), before_replace=held.check)
    held.release()
"""


def spawn(script: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": ROOT})


def lock_is_held(path: str) -> bool:
    """Whether another process holds the record lock on ``path`` (tried, never waited for)."""
    if not os.path.exists(path):
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def stopped_holder(url: str, rel: str, lock: str, slow: float = 1.0) -> subprocess.Popen:
    """A writer stopped (SIGSTOP) between its compare and its write, the lock in hand."""
    holder = spawn(WRITER, url, rel, "A", slow)
    wait_until(lambda: lock_is_held(lock))
    os.kill(holder.pid, signal.SIGSTOP)
    return holder


def finish(proc: subprocess.Popen, timeout: float = 20.0) -> list[str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out.split()


def test_a_stopped_holder_keeps_the_lock_and_neither_writer_is_told_a_lost_write_landed(tmp_path):
    url, rel = f"file://{tmp_path}/s", "doc"
    store = Storage(url)
    assert store.write_if(rel, b"v0", None)
    lock = f"{tmp_path}/s/doc.lock"
    holder = stopped_holder(url, rel, lock)
    try:
        old = time.time() - 600  # what an age-based breaker would take for a dead writer's lock
        os.utime(lock, (old, old))
        waiter = spawn(WRITER, url, rel, "B", 0)
        wait_until(lambda: waiter.stdout.readline().strip() == "read")  # it read v0, as the holder did
        time.sleep(1.0)
        assert waiter.poll() is None  # still waiting: the holder is stopped, not dead
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert finish(holder) == ["read", "True"]
    assert finish(waiter) == ["False"]  # refused: the version it read is gone, and it says so
    assert store.read_versioned(rel)[0] == b"A"


def test_a_lock_held_past_the_wait_is_named_as_held_not_as_an_unreachable_store(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/runs"
    store = open_store(url)
    store.create_run(RunSpec(run_id="r1", config={"run_id": "r1"}, workers=2, min_workers=1, max_workers=4))
    rel, lock = "r1/control/spec.json", f"{tmp_path}/runs/r1/control/spec.json.lock"
    holder = stopped_holder(url, rel, lock)
    try:
        monkeypatch.setattr(local, "LOCK_WAIT_S", 0.3)
        with pytest.raises(StoreUnavailable) as e:
            store.update_spec("r1", workers=3)
        assert "spec.json.lock is held by another writer" in str(e.value)
        assert "unreachable" not in str(e.value)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert finish(holder) == ["read", "True"]


def test_two_waiters_on_a_killed_holders_lock_take_turns_and_lose_no_update(tmp_path):
    url, rel = f"file://{tmp_path}/s", "counter"
    store = Storage(url)
    assert store.write_if(rel, b"0", None)
    holder = stopped_holder(url, rel, f"{tmp_path}/s/counter.lock", slow=30)
    holder.kill()
    holder.wait()
    t0 = time.monotonic()
    waiters = [spawn(COUNTER, url, rel, 40) for _ in range(2)]
    results = [finish(w) for w in waiters]
    assert time.monotonic() - t0 < 8  # the dead holder's lock cost nothing (the old one: 5 s, then an error)
    assert [int(won) for won, _ in results] == [40, 40]
    assert int(store.read_versioned(rel)[0]) == 80  # every accepted write landed: none was in with another


def test_a_lock_file_dated_in_the_future_or_left_behind_blocks_nobody(tmp_path):
    store = Storage(f"file://{tmp_path}/s")
    assert store.write_if("doc", b"v0", None)
    lock = f"{tmp_path}/s/doc.lock"
    future = time.time() + 3600  # a clock ahead on another machine of a shared file system
    os.utime(lock, (future, future))
    t0 = time.monotonic()
    _, version = store.read_versioned("doc")
    assert store.write_if("doc", b"v1", version)
    assert time.monotonic() - t0 < 1
    os.remove(lock)
    open(lock, "w").close()  # an empty file, as a writer of the old lock left it when it died
    _, version = store.read_versioned("doc")
    assert store.write_if("doc", b"v2", version)
    assert time.monotonic() - t0 < 2


def test_threads_of_one_process_take_turns_on_the_lock(tmp_path):
    url = f"file://{tmp_path}/s"
    Storage(url).write_if("counter", b"0", None)
    won = []

    def add(n):
        s, mine = Storage(url), 0  # one client per thread, as separate callers would have
        while mine < n:
            data, version = s.read_versioned("counter")
            mine += s.write_if("counter", str(int(data) + 1).encode(), version)
        won.append(mine)

    threads = [threading.Thread(target=add, args=(25,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert won == [25] * 4 and Storage(url).read_versioned("counter")[0] == b"100"


# --- the directory lock, where the file system has no record locks ---------------------------------------


def test_the_directory_lock_lets_processes_in_one_at_a_time(tmp_path):
    counter = tmp_path / "counter"
    counter.write_text("0")
    lock = str(tmp_path / "counter.lock.owner")
    procs = [spawn(OWNER_COUNTER, lock, counter, 40) for _ in range(2)]
    for p in procs:
        finish(p)
    assert counter.read_text() == "80"
    assert not os.path.exists(lock)  # released


def test_the_directory_lock_of_a_killed_holder_of_this_machine_is_broken_at_once(tmp_path):
    lock = str(tmp_path / "doc.lock.owner")
    holder = spawn("import sys, time\nfrom checkpointing.storage.doc_lock import OwnerDir\n"
                   "OwnerDir(sys.argv[1]).take(time.monotonic() + 5, 5)\nprint('held', flush=True)\ntime.sleep(60)",
                   lock)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()  # a zombie until reaped: already dead for the lock
    t0 = time.monotonic()
    mine = OwnerDir(lock)
    mine.take(time.monotonic() + 5, 5)
    assert time.monotonic() - t0 < 1
    mine.check()
    mine.release()
    holder.wait()


def test_the_directory_lock_of_another_machine_is_never_broken_by_age(tmp_path):
    lock = tmp_path / "doc.lock.owner"
    lock.mkdir()
    other = "0" * 32
    (lock / other).write_text(json.dumps({"id": other, "host": "elsewhere", "boot": "b", "pidns": "p", "pid": 1,
                                          "since_unix": time.time() - 86400}))
    old = time.time() - 86400
    os.utime(lock, (old, old))
    with pytest.raises(LockHeld, match=r"pid 1 on elsewhere .*never broken by age.*remove"):
        OwnerDir(str(lock)).take(time.monotonic() + 0.3, 0.3)
    assert (lock / other).exists()


def test_a_directory_lock_taken_from_its_holder_refuses_the_holders_write(tmp_path):
    doc = tmp_path / "doc"
    doc.write_bytes(b"v0")
    held = OwnerDir(str(tmp_path / "doc.lock.owner"))
    held.take(time.monotonic() + 1, 1)
    os.remove(os.path.join(held.path, held.id))  # removed by hand, say
    with pytest.raises(LockLost):
        local.replace_file(str(doc), b"v1", before_replace=held.check)
    assert doc.read_bytes() == b"v0"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
