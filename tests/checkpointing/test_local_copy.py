"""Copies of memory snapshots between processes of one host, by shared memory (checkpointing.recovery.local_copy):
a copy mapped from another process outlives it, and what is mapped is checked as bytes off the network are."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap

import pytest

from checkpointing.dcp.format import CorruptCheckpointError
from checkpointing.recovery.local_copy import host_key, open_copy, publish
from tests.harness import run_ranks

PUBLISHER = textwrap.dedent("""
    import os, sys
    from checkpointing.recovery.local_copy import publish
    shared = publish([b"head:", bytes(range(256)) * 4096, b":tail"])
    print(os.getpid(), shared.fd, shared.capacity, flush=True)
    sys.stdin.readline()   # mapped by the test: this process ends, its memory file with it
""")


def test_a_mapped_copy_outlives_the_process_that_published_it():
    child = subprocess.Popen([sys.executable, "-c", PUBLISHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    pid, fd, size = map(int, child.stdout.readline().split())
    copy = open_copy(pid, fd, size, "the test's copy")
    child.communicate("done\n", timeout=30)
    assert child.returncode == 0
    want = b"head:" + bytes(range(256)) * 4096 + b":tail"
    assert len(copy) == size == len(want) and bytes(copy) == want
    assert isinstance(copy.obj, mmap.mmap)  # mapped, not copied into this process
    with pytest.raises(TypeError):  # read-only: a holder never writes a peer's bytes
        copy[0] = 0


def test_an_announced_size_or_file_that_is_not_there_is_refused():
    import os

    shared = publish([b"x" * 100])
    try:
        with pytest.raises(CorruptCheckpointError, match="has 100 bytes, 60 from 50 were announced"):
            open_copy(os.getpid(), shared.fd, 60, "a copy", offset=50)
        assert bytes(open_copy(os.getpid(), shared.fd, 40, "a copy", offset=50)) == b"x" * 40
        with pytest.raises(CorruptCheckpointError, match="has no memory file"):
            open_copy(os.getpid(), 10**6, 100, "a copy")
    finally:
        shared.close()
    assert host_key() and host_key() == host_key()


def test_peers_on_one_host_copy_by_shared_memory_and_restore_from_it():
    """Three ranks on this host (replicas 1), three snapshots: every copy is mapped from the memory file its
    sender wrote its own files into (no bytes through gloo, no second copy), byte for byte the sender's,
    and each rank's snapshots take turns in two memory files (the restorable step's and the next)."""
    ranks = run_ranks("tests.memory_tier_jobs:shared_copies", 3, {}, timeout=180)
    for r in ranks:
        assert r["mapped"] == [True], r  # the one copy each rank holds is a mapping of its peer's file
        assert r["own_mapped"] and r["memory_files"] == 2 and r["made_apart"] == 0, r
        assert r["restorable"] == 3 and r["same_bytes"], r
