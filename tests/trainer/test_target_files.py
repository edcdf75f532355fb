"""Prometheus target files whose endpoint is gone (the process killed, an allocator whose Ray was stopped) are
swept when a new endpoint writes its own; live ones, other nodes' and other files are kept."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from trainer.observe.endpoint import MetricsEndpoint, stale_target, sweep_stale_targets
from trainer.observe.metrics import RunMetrics


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def target_file(directory, name: str, target: str) -> str:
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        json.dump([{"targets": [target], "labels": {"etrain_run": name.rsplit("-", 1)[0]}}], f)
    return path


def test_stale_target_files_are_swept_when_an_endpoint_registers(tmp_path):
    gone = dead_pid()
    stale = target_file(tmp_path, f"allocator-{gone}.json", f"127.0.0.1:{closed_port()}")
    live_pid = target_file(tmp_path, f"r1-{os.getppid()}.json", f"127.0.0.1:{closed_port()}")  # its process lives
    elsewhere = target_file(tmp_path, f"r2-{gone}.json", "192.0.2.7:9100")  # another node's: not judged here
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        answers = target_file(tmp_path, f"r3-{gone}.json", f"127.0.0.1:{listening.getsockname()[1]}")
        other = tmp_path / "notes.json"
        other.write_text("{}")
        assert stale_target(stale, gone) and not stale_target(elsewhere, gone) and not stale_target(answers, gone)
        ep = MetricsEndpoint(RunMetrics("r4"), addr="127.0.0.1", port=0, file_sd_dir=str(tmp_path))
        try:
            left = set(os.listdir(tmp_path))
            assert os.path.basename(stale) not in left, left
            assert {os.path.basename(p) for p in (live_pid, elsewhere, answers)} | {"notes.json"} <= left
            assert os.path.basename(ep.file_sd_path) in left
            assert sweep_stale_targets(str(tmp_path)) == []  # the endpoint's own file is live
        finally:
            ep.close()
    assert not os.path.exists(ep.file_sd_path)


def test_a_file_that_is_not_a_target_file_is_never_stale(tmp_path):
    gone = dead_pid()
    (tmp_path / f"x-{gone}.json").write_text("not json")
    (tmp_path / f"y-{gone}.json").write_text(json.dumps([{"targets": ["no-port"]}]))
    os.symlink("/etc/hostname", tmp_path / f"z-{gone}.json")
    assert sweep_stale_targets(str(tmp_path)) == []
    assert sweep_stale_targets(str(tmp_path / "missing")) == []
