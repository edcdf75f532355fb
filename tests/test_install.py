"""etrain's dependencies resolve with the pip that Python 3.11 bundles (23.2), not only with a new one.

A fresh virtual environment made by ``python -m venv`` (its own pip, not upgraded) resolves, with
``pip install --dry-run --ignore-installed --report``, every dependency pyproject.toml names except torch
(which is a large download and pins nothing of this pair) and those of the ``[hf]`` extra (datasets caps
fsspec of its own), against PyPI, without the machine's pip configuration (its constraints, indexes and
local wheels). The resolution must succeed and pick s3fs and fsspec of one release (s3fs X requires
fsspec==X: docs/dependencies.md). Nothing is installed; a minute or two of metadata downloads, so the slow
tier. Skipped, saying why, only when PyPI cannot be reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import urllib.request

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.slow

INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")


def requirements() -> list[str]:
    """pyproject.toml's dependencies and its [hf] extra, torch left out."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["hf"]
    return [r for r in reqs if not r.replace(" ", "").startswith(("torch>", "torch=", "torch<", "torch;"))]


def test_requirements_leave_torch_out_and_let_s3fs_choose_fsspec():
    reqs = requirements()
    assert any(r.startswith("s3fs") for r in reqs) and not any(r.startswith("torch") for r in reqs), reqs
    # fsspec is chosen by s3fs's exact pin alone: a range of its own is a second choice an old resolver can
    # make first, against that pin
    assert not any(r.startswith("fsspec") for r in reqs), reqs


def _reachable(url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/s3fs/", timeout=15) as r:
            r.read(1)
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def test_the_bundled_pip_of_a_fresh_venv_resolves_the_dependencies(tmp_path):
    why = _reachable(INDEX)
    if why is not None:
        pytest.skip(f"the package index {INDEX} cannot be reached from here ({why})")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    version = subprocess.run([*pip, "--version"], capture_output=True, text=True, check=True).stdout
    # The machine's pip configuration (constraints, extra indexes, local wheels) is not the user's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_INDEX_URL")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    report = tmp_path / "report.json"
    res = subprocess.run([*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--index-url", INDEX,
                          "--report", str(report), *requirements()],
                         env=env, capture_output=True, text=True, check=False, timeout=1200)
    assert res.returncode == 0, f"{version}: {res.stderr[-4000:]}"
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert chosen["s3fs"] == chosen["fsspec"], (version, chosen["s3fs"], chosen["fsspec"])
