"""``etrain ckpt`` driven by a hostile user: ``verify`` fails what a load refuses, ``adopt`` bounds
what it reads and names the values it refuses, and no command prints a URL's credentials.

Hostile checkpoints are made as in ``test_checkpoint_integrity``: the bytes of a real committed
checkpoint's files replaced, the manifest's checksums updated to match, so that only the content
is hostile.
"""

from __future__ import annotations

import json
import pickle
import resource

import pytest

from checkpointing import cli as ckpt_cli
from checkpointing.errors import CheckpointError
from checkpointing.manifest import MANIFEST_NAME, checksum
from tests.checkpointing.test_checkpoint_dcp import _stock_dir
from tests.checkpointing.test_checkpoint_integrity import _load_error, _Payload, _replace_bytes_item, put_manifest, two_steps


def _replace_metadata(mgr, step: int, blob: bytes) -> None:
    """The step's ``.metadata`` replaced by ``blob``, its manifest entry updated to match."""
    path = mgr.storage._path(f"{mgr.step_rel(step)}/.metadata")
    with open(path, "wb") as f:
        f.write(blob)
    doc = json.loads(mgr.read_manifest(step).to_json())
    doc["files"] = [dict(f, size=len(blob), crc32c=checksum(blob)) if f["path"] == ".metadata" else f
                    for f in doc["files"]]
    doc.pop("total_bytes")
    put_manifest(mgr, step, doc)


def test_verify_fails_what_a_load_refuses(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(str(marker)))
    cases = {
        "pickle payload as the metadata": (lambda mgr: _replace_metadata(mgr, 2, payload),
                                           "not allowed in DCP metadata"),
        "bytes after the metadata": (lambda mgr: _replace_metadata(
            mgr, 2, mgr.storage.get(f"{mgr.step_rel(2)}/.metadata") + b"\0" * 64), "64 bytes after its end"),
        "pickle payload as an item": (lambda mgr: _replace_bytes_item(mgr, 2, payload), "is not plain data"),
    }
    for i, (what, (spoil, expect)) in enumerate(cases.items()):
        url = f"file://{tmp_path}/ck{i}"
        mgr = two_steps(url)
        assert ckpt_cli.main(["verify", f"{url}/r"]) == 0
        spoil(mgr)
        assert expect in str(_load_error(mgr, 2)), what  # what a load (resume) says of it
        assert ckpt_cli.main(["verify", f"{url}/r"]) == 1, what
        out = capsys.readouterr().out
        assert "ok   r/checkpoints/step_000000001" in out and expect in out, (what, out)
        assert [line for line in out.splitlines() if line.startswith("FAIL")][0].startswith(
            "FAIL r/checkpoints/step_000000002/"), out
    assert not marker.exists()


def test_adopt_bounds_the_metadata_it_reads_and_names_the_steps_it_refuses(tmp_path, capsys):
    step = tmp_path / "ck" / "r" / "checkpoints" / "step_000000005"
    good = _stock_dir(step)
    url = f"file://{step}"

    def refused(*expect: str, args=("--samples-consumed", "20"), target=url) -> str:
        code = ckpt_cli.main(["adopt", target, *args])
        err = capsys.readouterr().err
        assert code == 2, err
        for e in expect:
            assert e in err, err
        assert not (step / MANIFEST_NAME).exists()
        return err

    # 1 GiB of trailing bytes (a sparse file): refused on its size, before any of it is read
    with open(step / ".metadata", "r+b") as f:
        f.truncate(len(good[".metadata"]) + (1 << 30))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(".metadata is 1073", "bytes; DCP metadata is at most 268435456 (256 MiB), so this is not one")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: never read in
    # a few trailing bytes: not one pickle and nothing after it, as a load reads it
    (step / ".metadata").write_bytes(good[".metadata"] + b"\0" * 16)
    refused("is not valid DCP metadata (16 bytes after its end)")
    (step / ".metadata").write_bytes(good[".metadata"])
    # --step names each value it disagrees with, never "None"
    into = f"file://{tmp_path}/ck/r2"
    err = refused("--step says 3", "step_000000005 says 5", args=("--into", into, "--step", "3",
                                                               "--samples-consumed", "20"))
    assert "None" not in err
    err = refused("--step says 3, --into says 7", args=("--into", f"{into}/checkpoints/step_000000007", "--step", "3",
                                                        "--samples-consumed", "20"))
    assert "None" not in err
    refused("--step must be an integer >= 0, not -1", args=("--into", into, "--step", "-1", "--samples-consumed", "20"))
    # and the directory itself is adopted
    assert ckpt_cli.main(["adopt", url, "--samples-consumed", "20"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("cmd", ["ls", "inspect", "verify", "adopt"])
def test_ckpt_commands_never_print_a_urls_credentials(tmp_path, capsys, cmd):
    secret = "Zq9sEkr1tK3y"
    url = f"file://{tmp_path}/ck"
    two_steps(url)
    extra = ["--samples-consumed", "1"] if cmd == "adopt" else []
    for bad in (f"s3://AKIAEXAMPLE:{secret}@bucket/runs/r", f"{url}/r?X-Amz-Signature={secret}",
                f"{url}/r/checkpoints/step_000000002?token={secret}", f"{url}?sig={secret}"):
        assert ckpt_cli.main([cmd, bad, *extra]) == 2, (cmd, bad)
        cap = capsys.readouterr()
        assert secret not in cap.out + cap.err and "carries credentials" in cap.err, (cmd, bad, cap)
    if cmd != "adopt":  # a URL without credentials is shown, its query redacted all the same
        assert ckpt_cli.main([cmd, f"{url}/nothere?versionId=v{secret}"]) == 1
        cap = capsys.readouterr()
        assert secret not in cap.out + cap.err, cap


def test_a_load_refuses_an_oversized_metadata_listed_in_the_manifest(tmp_path):
    """The manifest's size of the metadata is checked before the file is read."""
    mgr = two_steps(f"file://{tmp_path}/ck")
    rel = f"{mgr.step_rel(2)}/.metadata"
    with open(mgr.storage._path(rel), "r+b") as f:
        f.truncate(300 << 20)
    doc = json.loads(mgr.read_manifest(2).to_json())
    doc["files"] = [dict(f, size=300 << 20) if f["path"] == ".metadata" else f for f in doc["files"]]
    doc.pop("total_bytes")
    put_manifest(mgr, 2, doc)
    err = _load_error(mgr, 2)
    assert isinstance(err, CheckpointError) and "DCP metadata is at most" in str(err), err
