"""What needs the ``[hf]`` extra says so, and an export is whole or absent.

Without transformers (hidden here by a meta-path finder that refuses to import it, in a subprocess:
nothing is uninstalled), ``etrain ckpt export --format hf`` and ``model.source = "hf"`` exit 2 saying
``pip install "etrain[hf]"`` before anything is written; without safetensors, ``model.init_from`` of a
transformers directory does the same. An export that fails midway (a failure injected after its weights
are written) leaves nothing at OUT, and one that fails while replacing an export (``--overwrite``)
leaves the old export whole. README's quick start exports the directory its ``init_from`` line reads,
and both lines work as written, in that order.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.harness import ROOT

# Run the etrain command with some top-level packages impossible to import, as if they were not installed.
HIDE = """
import sys
HIDDEN = set(sys.argv[1].split(","))

class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ImportError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Hide())
from orchestrator.cli.main import main
sys.exit(main(sys.argv[2:]))
"""
TRAIN = ["--set", "train.steps=2", "--set", "train.global_batch=2", "--set", "train.micro_batch=1",
         "--set", "data.max_bytes=60000", "--set", "metrics.enabled=false"]


def env(tmp_path) -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, ETRAIN_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")


def etrain_without(hidden: str, args: list[str], cwd, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE, hidden, *args], cwd=cwd, env=env(tmp_path),
                          capture_output=True, text=True, check=False, timeout=300)


def etrain(args: list[str], cwd, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], cwd=cwd, env=env(tmp_path),
                          capture_output=True, text=True, check=False, timeout=300)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A directory as README's quick start leaves it: examples/ and runs/tiny with a committed checkpoint."""
    work = tmp_path_factory.mktemp("quick")
    os.symlink(os.path.join(ROOT, "examples"), work / "examples")
    res = etrain(["train", "examples/tiny.toml", *TRAIN, "--set", f'checkpoint.url="file://{work}/runs"'], work, work)
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.listdir(work / "runs" / "tiny" / "checkpoints") == ["step_000000002"]
    return work


def leftovers(parent) -> list[str]:
    return [n for n in os.listdir(parent) if ".partial-" in n]


def test_export_without_transformers_exits_2_and_writes_nothing(work, tmp_path):
    out = tmp_path / "tiny-hf"
    res = etrain_without("transformers", ["ckpt", "export", f"file://{work}/runs/tiny", str(out)], work, tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert 'pip install "etrain[hf]"' in res.stderr and "transformers" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert not out.exists() and not leftovers(tmp_path)
    # the formats that need no [hf] package still export
    res = etrain_without("transformers,safetensors,tokenizers", ["ckpt", "export", f"file://{work}/runs/tiny",
                                                                 str(tmp_path / "t.safetensors"), "--format",
                                                                 "safetensors"], work, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_init_from_a_transformers_directory_without_safetensors_exits_2(work, tmp_path):
    out = tmp_path / "tiny-hf"
    assert etrain(["ckpt", "export", f"file://{work}/runs/tiny", str(out)], work, tmp_path).returncode == 0
    res = etrain_without("safetensors", ["train", "examples/tiny.toml", *TRAIN, "--set", 'run_id="ft"',
                                         "--set", f'model.init_from="{out}"'], work, tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert 'pip install "etrain[hf]"' in res.stderr and "model.init_from" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "step 1/" not in res.stdout, res.stdout + res.stderr


def test_generate_from_an_export_without_transformers_exits_2(work, tmp_path):
    out = tmp_path / "tiny-hf"
    assert etrain(["ckpt", "export", f"file://{work}/runs/tiny", str(out)], work, tmp_path).returncode == 0
    res = etrain_without("transformers", ["generate", str(out), "--prompt", "def ", "--max-new-tokens", "2"], work,
                         tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert 'pip install "etrain[hf]"' in res.stderr and "etrain generate" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr


def test_an_hf_model_without_transformers_exits_2_before_training(tmp_path):
    res = etrain_without("transformers", ["train", "examples/llama-small.toml", "--set", "train.steps=1", "--set",
                                          f'checkpoint.url="file://{tmp_path}/runs"'], ROOT, tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert 'model.source="hf" needs transformers' in res.stderr and 'pip install "etrain[hf]"' in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "runs").exists(), res.stderr


def test_an_export_that_fails_midway_leaves_nothing(work, tmp_path, monkeypatch):
    from trainer.export import convert

    url = f"file://{work}/runs/tiny"

    def fail(out, cfg):  # after every weights file is written and fsync'ed
        assert "model.safetensors" in os.listdir(out)
        raise OSError(28, "No space left on device", os.path.join(out, "config.json"))

    monkeypatch.setattr(convert, "write_hf_extras", fail)
    with pytest.raises(OSError, match="No space left"):
        convert.export(url, str(tmp_path / "hf"), "hf")
    assert not (tmp_path / "hf").exists() and not leftovers(tmp_path)
    (tmp_path / "empty").mkdir()  # an empty directory given as OUT stays empty
    with pytest.raises(OSError):
        convert.export(url, str(tmp_path / "empty"), "hf")
    assert os.listdir(tmp_path / "empty") == [] and not leftovers(tmp_path)
    monkeypatch.undo()

    # one file: a tensor that cannot be read midway
    real_read = convert.ModelSource.read
    calls = []

    def flaky(self, fqn):
        calls.append(fqn)
        if len(calls) == 5:
            raise OSError(5, "Input/output error")
        return real_read(self, fqn)

    monkeypatch.setattr(convert.ModelSource, "read", flaky)
    for fmt in ("safetensors", "torch"):
        calls.clear()
        with pytest.raises(OSError, match="Input/output"):
            convert.export(url, str(tmp_path / f"model.{fmt}"), fmt)
        assert not (tmp_path / f"model.{fmt}").exists() and not leftovers(tmp_path), os.listdir(tmp_path)


def test_overwrite_replaces_an_export_whole_or_not_at_all(work, tmp_path, monkeypatch):
    from trainer.export import convert

    url, out = f"file://{work}/runs/tiny", tmp_path / "hf"
    convert.export(url, str(out), "hf", shard_bytes=1 << 20)  # sharded: several files and an index
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    assert "model.safetensors.index.json" in before and "MANIFEST.json" in before
    (out / "NOTES.txt").write_text("mine")  # not the export's: kept

    def fail(out_dir, cfg):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert, "write_hf_extras", fail)
    with pytest.raises(OSError):
        convert.export(url, str(out), "hf", overwrite=True)
    assert {n: (out / n).read_bytes() for n in before} == before and not leftovers(tmp_path)
    assert complete(out)
    monkeypatch.undo()

    with pytest.raises(Exception, match="exists and is not empty"):  # the contract: no --overwrite, no change
        convert.export(url, str(out), "hf")
    convert.export(url, str(out), "hf", dtype="bf16", overwrite=True)  # one file now: the old shards go
    names = set(os.listdir(out))
    assert names == {"model.safetensors", "config.json", "MANIFEST.json", "NOTES.txt"}, names
    assert json.loads((out / "MANIFEST.json").read_text())["dtype"] == "bf16"
    assert complete(out) and not leftovers(tmp_path)
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~_umask())


def complete(out) -> bool:
    """Whether the export's manifest lists exactly its weights, config and manifest-less files, each of its size."""
    doc = json.loads((out / "MANIFEST.json").read_text())
    return all((out / f["path"]).stat().st_size == f["size"] for f in doc["files"]) and \
        {f["path"] for f in doc["files"]} == set(os.listdir(out)) - {"MANIFEST.json", "NOTES.txt"}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def quick_start() -> list[str]:
    """README's quick start commands (comment lines dropped, each command without its comment)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = f.read().split("\n## Quick start\n", 1)[1].split("```", 2)[1]
    return [ln.split("   #", 1)[0].strip() for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


def test_the_quick_start_exports_the_directory_its_init_from_reads(work):
    commands = quick_start()
    init = next(i for i, c in enumerate(commands) if "model.init_from" in c)
    target = shlex.split(commands[init].split("model.init_from=", 1)[1])[0].strip('"')
    exports = [i for i, c in enumerate(commands) if c.startswith("etrain ckpt export ")]
    assert exports and exports[-1] < init, commands
    export_line = commands[exports[-1]]
    assert shlex.split(export_line)[4] == target, export_line
    # both lines as written (the training a few steps only), after a run that left runs/tiny
    for line in (export_line, commands[init] + " " + shlex.join(TRAIN)):
        res = subprocess.run(["bash", "-c", line.replace("etrain ", f"{sys.executable} -m orchestrator.cli.main ", 1)],
                             cwd=work, env=env(work), capture_output=True, text=True, check=False, timeout=300)
        assert res.returncode == 0, line + "\n" + res.stdout + res.stderr
    assert "MANIFEST.json" in os.listdir(work / target)
