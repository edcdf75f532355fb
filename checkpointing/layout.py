"""The run root: every object a run keeps under ``<root>/<run_id>/``, named in one place.

    run = RunRoot("tiny")
    run.step(1000)          # "tiny/checkpoints/step_000001000"
    run.export(2000)        # "tiny/exports/step_000002000"
    run.fence               # "tiny/FENCE": the newest epoch, {"epoch": N}
    epoch = parse_fence(blob)             # ValueError saying what is wrong
    storage.put(run.fence, fence_blob(4))

::

    <root>/<run_id>/
      FENCE                     the newest controller epoch (fencing token)
      LOCK/<generation>.json    the writer lock (checkpointing.lock)
      checkpoints/step_<N>/     one checkpoint (checkpointing.manifest)
      exports/step_<N>/         one transformers export of [checkpoint] export_every (checkpointing.export.weights)
      control/                  the embedded run store's documents (orchestrator.store.run_store)
      _probe/                   write probes before a run starts

The checkpoint manager, the writer lock and the embedded run store all name
these objects through this module; the run id is validated on the way in.
"""

from __future__ import annotations

import json

from .errors import EtrainError
from .manifest import parse_step_dir, step_dir
from .names import redact, validate_run_id

FENCE = "FENCE"
LOCK_DIR = "LOCK"
CHECKPOINTS = "checkpoints"
EXPORTS = "exports"
CONTROL = "control"
PROBE_DIR = "_probe"


class RunRoot:
    """The keys of one run's objects, relative to the storage root."""

    def __init__(self, run_id: str):
        self.run_id = validate_run_id(run_id)
        self.fence = f"{run_id}/{FENCE}"
        self.lock_dir = f"{run_id}/{LOCK_DIR}"
        self.checkpoints = f"{run_id}/{CHECKPOINTS}"
        self.exports = f"{run_id}/{EXPORTS}"
        self.control = f"{run_id}/{CONTROL}"
        self.probe_dir = f"{run_id}/{PROBE_DIR}"

    def step(self, step: int) -> str:
        return f"{self.checkpoints}/{step_dir(step)}"

    def export(self, step: int) -> str:
        return f"{self.exports}/{step_dir(step)}"


def fence_blob(epoch: int) -> bytes:
    return json.dumps({"epoch": epoch}).encode()


def parse_fence(blob: bytes) -> int:
    """The epoch a FENCE object holds; ValueError saying what is wrong with it."""
    try:
        doc = json.loads(blob)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not valid JSON ({str(e)[:60]})") from None
    epoch = doc.get("epoch") if isinstance(doc, dict) else None
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"it should hold {{\"epoch\": N}} with N an integer >= 0, not {str(doc)[:40]}")
    return epoch


def parse_url(url: str) -> tuple[str, str, int | None]:
    """``<root>/<run>[/checkpoints[/step_N]]`` -> (root, run_id, step or None)."""
    if "?" in url or "#" in url:
        raise EtrainError(f"{redact(url)!r}: a checkpoint URL takes no query or fragment (?, #); give "
                          "<root>/<run_id>[/checkpoints/step_N] and credentials through the environment")
    parts = url.rstrip("/").split("/")
    step = parse_step_dir(parts[-1])
    if step is not None:
        parts = parts[:-1]
    if parts[-1] == "checkpoints":
        parts = parts[:-1]
    elif parts[-1] == "exports" and step is not None and len(parts) >= 3:
        root, run = redact("/".join(parts[:-2])), parts[-2]
        raise EtrainError(f"{redact(url)!r} is an export of run {run!r} (a transformers directory), not a "
                          f"checkpoint; `etrain ckpt ls {root} --run {run}` lists the run's checkpoints and exports")
    if len(parts) < 2 or not parts[-1] or parts[-1].endswith(":"):
        raise EtrainError(f"{redact(url)!r} does not name a run directory; use <root>/<run_id>[/checkpoints/step_N]")
    return "/".join(parts[:-1]), parts[-1], step
