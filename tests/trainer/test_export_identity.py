"""An export is tied to the exact checkpoint it was made from, and its manifest is data.

The reproduction: a run exports step 2 (``[checkpoint] export_every``), its checkpoints are deleted
and the same run id trains again (another seed): the old export is stale, not "complete already";
it is exported again, bitwise what ``etrain ckpt export`` makes of the new checkpoint. A stale
export put back is flagged by ``etrain ckpt ls`` (and ``--json``), failed by ``etrain ckpt verify``,
refused by ``init_from``/``etrain generate`` and written again by the export process.

The fuzz: 240 seeded mutations of a committed export (its manifest's fields and bytes, its files'
bytes and sizes, hostile paths, files added and removed). Every reader (the export's state, ``ckpt
ls``, ``ckpt verify``, ``init_from``'s gate) answers without a traceback and without running
anything, and an export that any of them calls complete holds exactly the files and identity it
was committed with.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil

import pytest

from checkpointing import cli as ckpt_cli
from checkpointing.errors import ConfigError
from checkpointing.manager import CheckpointManager
from checkpointing.storage.base import Storage
from orchestrator.cli.main import main as etrain
from tests.harness import run_ranks
from tests.checkpointing.test_checkpoint_integrity import _Payload, two_steps


def _train(root, *extra: str) -> list[tuple[int, str]]:
    """``python -m trainer``'s run (world 1): 2 steps of run "tiny", a checkpoint and an export of step 2;
    the statuses of the run's exports in this process so far."""
    overrides = ["data.max_bytes=60000", "data.seq_len=16", "train.global_batch=4", "train.micro_batch=2",
                 "train.warmup_steps=1", "train.steps=2", "metrics.enabled=false", 'run_id="tiny"',
                 f'checkpoint.url="file://{root}/ck"', f'data.cache_dir="{root}/cache"',
                 "checkpoint.interval_steps=2", "checkpoint.export_every=2", *extra]
    (res,) = run_ranks("tests.trainer.test_export_every:train_job", 1, {"overrides": overrides}, timeout=300)
    assert res["exit"] == 0, res
    return [(e["step"], e["status"]) for e in res["exports"]]


def _export_dir(root, run: str = "tiny", step: int = 2):
    return root / "ck" / run / "exports" / f"step_{step:09d}"


def _files(d) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A root where run "tiny" trained 2 steps and exported step 2 (export_every=2)."""
    root = tmp_path_factory.mktemp("trained")
    assert _train(root)[-1] == (2, "exported")
    return root


def test_a_run_id_trained_again_exports_its_step_again_not_the_stale_export(trained, tmp_path, capsys):
    url = f"file://{tmp_path}/ck"
    shutil.copytree(trained / "ck", tmp_path / "ck")  # the first run, as it left its root
    stale = _files(_export_dir(tmp_path))
    assert {"model.safetensors", "config.json", "MANIFEST.json"} <= stale.keys()
    shutil.rmtree(tmp_path / "ck" / "tiny" / "checkpoints")  # the run's checkpoints deleted ...
    assert _train(tmp_path, "train.seed=7")[-1] == (2, "exported")  # ... and the run id trained again
    fresh = _files(_export_dir(tmp_path))
    assert fresh["model.safetensors"] != stale["model.safetensors"], "the old run's export was kept"
    by_hand = tmp_path / "by-hand"
    assert etrain(["ckpt", "export", f"{url}/tiny/checkpoints/step_000000002", str(by_hand)]) == 0
    assert {n: b for n, b in _files(by_hand).items() if n != "MANIFEST.json"} == \
        {n: b for n, b in fresh.items() if n != "MANIFEST.json"}
    from checkpointing.export.manifest import CHECKPOINT_KEY, export_state

    made_from = json.loads(fresh["MANIFEST.json"])[CHECKPOINT_KEY]
    assert made_from == CheckpointManager(url, "tiny").read_manifest(2).digest != \
        json.loads(stale["MANIFEST.json"])[CHECKPOINT_KEY]
    assert export_state(Storage(url), "tiny", 2).complete
    capsys.readouterr()

    # The stale export put back: flagged, failed, refused, and written again.
    d = _export_dir(tmp_path)
    for name in os.listdir(d):
        os.remove(d / name)
    for name, blob in stale.items():
        (d / name).write_bytes(blob)
    st = export_state(Storage(url), "tiny", 2)
    assert st.state == "stale" and st.made_from != st.checkpoint == made_from, st
    assert ckpt_cli.main(["ls", f"{url}/tiny"]) == 0
    out = capsys.readouterr().out
    assert "STALE" in out and f"now {made_from[:12]}" in out, out
    assert ckpt_cli.main(["ls", f"{url}/tiny", "--json"]) == 0
    row = {r["step"]: r for r in json.loads(capsys.readouterr().out)}[2]
    assert row["export"].startswith("stale: ") and row["export_checkpoint"] == st.made_from
    assert row["manifest_sha256"] == made_from
    assert ckpt_cli.main(["verify", f"{url}/tiny/exports/step_000000002"]) == 1
    assert "FAIL " in capsys.readouterr().out
    from trainer.export.convert import WeightSource, model_config
    from trainer.generate import load as load_for_generate

    mcfg = model_config(CheckpointManager(url, "tiny").read_manifest(2).config)
    with pytest.raises(ConfigError, match="incomplete export .stale: made from checkpoint"):
        WeightSource(str(d), mcfg)
    with pytest.raises(ConfigError, match="stale"):
        load_for_generate(str(d))
    from trainer.export.every import main as export_step

    assert export_step([url, "tiny", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "exported"
    assert _files(d)["model.safetensors"] == fresh["model.safetensors"]
    assert export_state(Storage(url), "tiny", 2, contents=True).complete


def test_ckpt_export_to_an_out_it_cannot_create_or_with_credentials_exits_2(trained, tmp_path, capsys):
    """No traceback, OUT and the fix named; a URL's credentials (as userinfo or a presigned query) never
    printed, in the checkpoint's URL or in OUT; nothing is written."""
    import subprocess
    import sys

    from tests.harness import ROOT

    step = f"file://{trained}/ck/tiny/checkpoints/step_000000002"
    (tmp_path / "a-file").write_text("x")
    secret = "Zq9sEkr1tK3y"
    cases = [
        ([step, str(tmp_path / "a-file" / "sub" / "out")], ["OUT", "a-file", "choose a directory you can write"]),
        ([step, f"file://{tmp_path}/a-file/out.safetensors", "--format", "safetensors"], ["OUT", "a-file"]),
        ([step, f"s3://AKIAEXAMPLE:{secret}@bucket/out"], ["OUT=s3://***@bucket/out carries credentials"]),
        ([step, f"s3://bucket/out?X-Amz-Credential=AKIA&X-Amz-Signature={secret}"], ["OUT=s3://bucket/out?***"]),
        ([f"{step}?token={secret}", str(tmp_path / "ok")], ["URL=", "carries credentials"]),
        ([f"s3://AKIAEXAMPLE:{secret}@bucket/runs/tiny", str(tmp_path / "ok")], ["URL=s3://***@bucket"]),
    ]
    for argv, expect in cases:
        assert etrain(["ckpt", "export", *argv]) == 2, argv
        cap = capsys.readouterr()
        assert secret not in cap.out + cap.err, cap
        for e in expect:
            assert e in cap.err, (argv, cap.err)
    assert not (tmp_path / "ok").exists()
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "ckpt", "export", step,
                        str(tmp_path / "a-file" / "out")], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "OUT " in r.stderr, r.stderr


def test_two_commits_of_the_same_step_and_state_have_two_identities(tmp_path):
    """Even a bitwise-identical retrain is another checkpoint: each manifest records its own commit."""
    a, b = two_steps(f"file://{tmp_path}/a"), two_steps(f"file://{tmp_path}/b")
    ma, mb = a.read_manifest(2), b.read_manifest(2)
    assert [f.crc32c for f in ma.files if f.path.endswith(".distcp")] == \
        [f.crc32c for f in mb.files if f.path.endswith(".distcp")]  # the same bytes saved
    assert ma.digest != mb.digest and len(ma.digest) == 64
    assert ma.digest == CheckpointManager(f"file://{tmp_path}/a", "r").read_manifest(2).digest


# --- the fuzz -------------------------------------------------------------------------------------


def _committed_export(tmp_path):
    """A checkpoint (step 2 of run "r") and an export of it written and committed as an export is, by
    :class:`checkpointing.export.weights.Output`, with three files."""
    from checkpointing.export.weights import Output

    url = f"file://{tmp_path}/ck"
    mgr = two_steps(url)
    target = Output(f"{url}/r/exports/step_000000002", directory=True)
    target.prepare(overwrite=False)
    for name, blob in (("model.safetensors", os.urandom(4096)), ("config.json", b'{"model_type": "llama"}'),
                       ("tokenizer.json", b'{"version": "1.0"}')):
        with open(target.path(name), "wb") as f:
            f.write(blob)
        target.done(name)
    from checkpointing.export.manifest import CHECKPOINT_KEY

    target.commit({"run_id": "r", "step": 2, "source": mgr.url_of(2), "export_format": "hf", "dtype": "fp32",
                   CHECKPOINT_KEY: mgr.read_manifest(2).digest})
    target.close()
    return url, _export_dir(tmp_path, "r")


_DROP = object()


def _mutations(doc: dict, files: dict[str, bytes], rng: random.Random, payload: bytes):
    """Ways to change a committed export: each returns (what, manifest bytes or None to keep it,
    {name: bytes or None to remove} for its files)."""
    entries = doc["files"]

    def field(key, value):  # the manifest with ``key`` set to ``value`` (or dropped)
        changed = {k: v for k, v in doc.items() if k != key} | ({} if value is _DROP else {key: value})
        return json.dumps(changed, indent=1).encode()

    def entry(**changes):
        d = json.loads(json.dumps(doc))
        d["files"][rng.randrange(len(entries))].update(changes)
        return json.dumps(d, indent=1).encode()

    blob = json.dumps(doc, indent=1).encode()
    data = [n for n in files if n != "MANIFEST.json"]

    def flip(b: bytes) -> bytes:
        i = rng.randrange(len(b))
        return b[:i] + bytes([b[i] ^ (1 << rng.randrange(8))]) + b[i + 1:]

    odd = [None, "7", 7.5, [], {}, True, -1, "", "x" * 5000, "\u202e", 2 ** 70, float("nan")]
    hostile = ["../x", "../../outside/model.safetensors", "/etc/passwd", "a/b", "..", ".", "", "MANIFEST.json",
               "x\n", "model.safetensors\x00", "\\windows", 5, None, ["a"]]
    return [
        lambda: ("manifest bit flip", flip(blob), {}),
        lambda: ("manifest truncated", blob[: rng.randrange(len(blob))], {}),
        lambda: ("manifest not utf-8", b"\xff\xfe" + os.urandom(rng.randint(0, 40)), {}),
        lambda: ("manifest deep", b"[" * 100_000, {}),
        lambda: ("manifest not an object", json.dumps(rng.choice([[], 3, "x", None])).encode(), {}),
        lambda: ("manifest removed", None, {"MANIFEST.json": None}),
        lambda: ("missing key", field(rng.choice(sorted(doc)), _DROP), {}),
        lambda: ("extra key", field(f"x{rng.randint(0, 99)}", rng.choice(odd)), {}),
        lambda: ("field type", field(rng.choice(sorted(doc)), rng.choice(odd)), {}),
        lambda: ("step", field("step", rng.choice([0, 1, 3, -2, "2", 2.0, True])), {}),
        lambda: ("run id", field("run_id", rng.choice(["other", "", "..", "r/..", "../r", None])), {}),
        lambda: ("identity", field("checkpoint_manifest_sha256", rng.choice(
            ["0" * 64, doc["checkpoint_manifest_sha256"][::-1], doc["checkpoint_manifest_sha256"].upper(),
             doc["checkpoint_manifest_sha256"][:63], None, 5])), {}),
        lambda: ("format", field(rng.choice(["format", "format_version"]),
                                 rng.choice(["etrain-checkpoint", 2, 0, "1", True])), {}),
        lambda: ("hostile path", entry(path=rng.choice(hostile)), {}),
        lambda: ("wrong size", entry(size=rng.choice([0, 1, 4095, 4097, 10 ** 12, -1, "4096", 4096.0, True])), {}),
        lambda: ("wrong checksum", entry(crc32c=rng.choice(["00000000", "ffffffff", "DEADBEEF", "xyz", 5])), {}),
        lambda: ("entry keys", entry(extra=1), {}),
        lambda: ("entry dropped", field("files", [e for e in entries if e["path"] != rng.choice(data)]), {}),
        lambda: ("entry twice", field("files", entries + [rng.choice(entries)]), {}),
        lambda: ("files empty", field("files", rng.choice([[], {}, None, "model.safetensors"])), {}),
        lambda: ("file bit flip", None, {(n := rng.choice(data)): flip(files[n])}),
        lambda: ("file truncated", None, {(n := rng.choice(data)): files[n][: rng.randrange(len(files[n]))]}),
        lambda: ("file grown", None, {(n := rng.choice(data)): files[n] + b"\0"}),
        lambda: ("file removed", None, {rng.choice(data): None}),
        lambda: ("file added", None, {rng.choice(["model.safetensors.index.json", "modeling_evil.py",
                                                   "pytorch_model.bin"]): payload}),
        lambda: ("file swapped for a pickle", None, {"model.safetensors": (payload * 4096)[:4096]}),
        lambda: ("benign: created_unix", field("created_unix", 12345.5), {}),
        lambda: ("benign: reformatted", json.dumps(doc, separators=(",", ":")).encode(), {}),
    ]


def test_fuzzed_exports_are_never_used_unless_unchanged(tmp_path, capsys):
    from checkpointing.export.manifest import export_state
    from trainer.export.convert import refuse_incomplete_export

    url, d = _committed_export(tmp_path)
    pristine = tmp_path / "pristine"
    shutil.copytree(d, pristine)
    original = _files(pristine)
    doc = json.loads(original["MANIFEST.json"])
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(str(marker)))
    rng = random.Random(20261125)
    choices = _mutations(doc, original, rng, payload)
    storage = Storage(url)
    assert export_state(storage, "r", 2, contents=True).complete
    seen: dict[str, int] = {}
    for i in range(240):
        what, manifest, changes = rng.choice(choices)()
        seen[what.split(":")[0]] = seen.get(what.split(":")[0], 0) + 1
        shutil.rmtree(d)
        shutil.copytree(pristine, d)
        if manifest is not None:
            (d / "MANIFEST.json").write_bytes(manifest)
        for name, blob in changes.items():
            if blob is None:
                os.remove(d / name)
            else:
                (d / name).write_bytes(blob)
        full = export_state(storage, "r", 2, contents=True)  # never raises
        cheap = export_state(storage, "r", 2)
        unchanged = _files(d).keys() == original.keys() and all(
            v == original[k] for k, v in _files(d).items() if k != "MANIFEST.json")
        if full.complete:  # used only when provably the export that was committed
            got = json.loads((d / "MANIFEST.json").read_bytes())
            assert unchanged and got["files"] == doc["files"] and full.made_from == doc[
                "checkpoint_manifest_sha256"] and (got["step"], got["run_id"]) == (2, "r"), (i, what)
        else:
            assert not what.startswith("benign"), (i, what, full)
        if cheap.complete:  # it reads no contents: the names and sizes are those committed
            assert {n: len(b) for n, b in _files(d).items() if n != "MANIFEST.json"} == \
                {n: len(b) for n, b in original.items() if n != "MANIFEST.json"}, (i, what)
        try:
            refuse_incomplete_export(str(d), "model.init_from")
            assert full.complete, (i, what)
        except ConfigError:
            assert not full.complete, (i, what)
        assert ckpt_cli.main(["ls", f"{url}/r", "--json"]) == 0
        assert ckpt_cli.main(["verify", f"{url}/r/exports/step_000000002"]) == (0 if full.complete else 1), what
        assert not marker.exists(), (i, what)
    capsys.readouterr()
    assert len(seen) >= 25, seen  # the seeded draw covered the kinds of mutation
    shutil.rmtree(d)
    shutil.copytree(pristine, d)
    assert export_state(storage, "r", 2, contents=True).complete  # the untouched export is complete again
