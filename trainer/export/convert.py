"""``etrain ckpt export``: a committed checkpoint's model as a ``transformers`` directory, one
``safetensors`` file or one ``torch.save`` file.

    etrain ckpt export s3://bucket/runs/tiny/checkpoints/step_000001000 ./tiny-hf --format hf
    etrain ckpt export file:///ckpt/runs/tiny ./tiny.safetensors --format safetensors --dtype bf16

Any layout consolidates (the checkpoint stores each parameter as a global tensor; see
:mod:`checkpointing.export.weights`), one tensor at a time. ``hf`` writes ``config.json``, the weights
(``model.safetensors``, sharded with an index above 5 GB) and the run's tokenizer files; the
names, layouts and ``config.json`` are the model family's (its spec's ``hf_names()``,
:mod:`trainer.models`): the built-in decoder is written as ``LlamaForCausalLM``
(:mod:`trainer.models.names.llama`), a ``transformers`` model keeps its own names and its own
``config.json``. ``safetensors`` and ``torch`` write the model's own state dict (etrain names). The
run config comes from the manifest. The same mapping reads a transformers directory back for
``model.init_from`` (:class:`WeightSource`).

``hf`` needs the ``[hf]`` extra, checked before anything is written (:func:`require_hf_export`: exit 2,
``pip install "etrain[hf]"``). On a local disk an export is written beside OUT and renamed into place
when complete (:class:`checkpointing.export.weights.Output`): a failed one leaves nothing at OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

from checkpointing.cli_args import ArgumentParser
from checkpointing.errors import CheckpointError, ConfigError, EtrainError, StorageError
from checkpointing.export.manifest import CHECKPOINT_KEY, export_dir_state
from checkpointing.export.weights import (
    EXPORT_MANIFEST,
    ModelSource,
    Output,
    write_hf_weights,
    write_safetensors,
    write_torch,
)
from checkpointing.layout import EXPORTS
from checkpointing.names import redact

from ..config import ModelConfig
from ..config.load import build_section
from ..models import spec_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FORMATS = ("hf", "safetensors", "torch")
def run_config(src: ModelSource) -> dict:
    """The resolved run config the checkpoint's manifest records; ConfigError for an adopted one."""
    cfg = src.manifest.config
    if not cfg or "model" not in cfg:
        raise ConfigError(f"{src.url} records no run config (adopted from stock DCP): it cannot say what model "
                          "it holds; export it with the torch format or read it with PyTorch (docs/checkpoint-format.md)")
    return cfg


def model_config(cfg: dict) -> ModelConfig:
    return build_section("model", ModelConfig, dict(cfg["model"]))


# --- the export -------------------------------------------------------------------------------


def plan(src: ModelSource, fmt: str, dtype: torch.dtype):
    """(specs, get, config): what to write, a function returning each output tensor, the run config."""
    cfg = run_config(src)
    names = spec_for(model_config(cfg)).hf_names() if fmt == "hf" else None
    convert = names is not None and names.renames
    specs_in = src.specs()
    back: dict[str, list[str]] = {}  # output name -> its built-in tensors (several: the family merges them)
    for fqn in specs_in:
        back.setdefault(names.hf_name(fqn) if convert else fqn, []).append(fqn)
    specs = []
    for name, fqns in back.items():
        dt, shape = specs_in[fqns[0]]
        if len(fqns) > 1:
            shape = names.merged_shape(name, {f: specs_in[f][1] for f in fqns})
        specs.append((name, dtype if dt.is_floating_point else dt, shape))
    # tensors the family has and the model not (Qwen2-MoE's q/k/v biases): zeros
    added = names.added() if convert and hasattr(names, "added") else {}
    specs += [(name, dtype, shape) for name, shape in added.items()]

    def get(name: str) -> torch.Tensor:
        if name in added:
            return torch.zeros(added[name], dtype=dtype)
        parts = {fqn: names.to_hf(fqn, src.read(fqn)) if convert else src.read(fqn) for fqn in back[name]}
        t = names.merge(name, parts) if len(parts) > 1 else next(iter(parts.values()))
        return t.to(dtype) if t.is_floating_point() else t

    return specs, get, cfg


def export(url: str, out: str, fmt: str = "hf", dtype: str = "fp32", *, overwrite: bool = False,
           shard_bytes: int | None = None) -> dict:
    """Export the checkpoint ``url`` names to ``out``; a summary. ConfigError (exit 2) on bad input."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    src = ModelSource.open(url)
    try:
        if fmt == "hf":  # before anything is written
            require_hf_export(run_config(src))
        specs, get, cfg = plan(src, fmt, DTYPES[dtype])
        target = Output(out, directory=fmt == "hf")
        try:
            target.prepare(overwrite=overwrite)
            src.plan_reads(list(src.specs()))
            files = _write(src, target, fmt, specs, get, cfg, shard_bytes)
            if fmt == "hf":  # the commit: written last, after every file is durable
                target.commit({"run_id": src.manifest.run_id, "step": src.step, "source": src.url,
                               "export_format": fmt, "dtype": dtype, CHECKPOINT_KEY: src.manifest.digest})
                files.append(EXPORT_MANIFEST)
            target.publish()  # on a local disk: renamed into place, complete (a failure above leaves nothing)
        finally:
            target.close()
    finally:
        src.close()
    return {"source": src.url, "step": src.step, "format": fmt, "dtype": dtype, "tensors": len(specs),
            "bytes": sum(_nbytes(s) for s in specs), "files": files, "url": target.url}


def require_hf_export(cfg: dict) -> None:
    """ConfigError (exit 2) saying ``pip install "etrain[hf]"`` when the packages an hf export of the run
    ``cfg`` needs do not import: transformers (``config.json``), and tokenizers for a run with a tokenizer."""
    from ..models.hf.hf_dir import require_hf

    tokenizer = str(cfg.get("data", {}).get("tokenizer", "bytes"))
    require_hf("etrain ckpt export --format hf", "transformers", *(() if tokenizer == "bytes" else ("tokenizers",)))


def _write(src: ModelSource, target: Output, fmt: str, specs, get, cfg: dict, shard_bytes: int | None) -> list[str]:
    """Every file of the export, each handed to ``target`` as it is complete (uploaded there)."""
    if fmt in ("safetensors", "torch"):
        if fmt == "safetensors":
            write_safetensors(target.path(target.name), specs, get, {"etrain_source": src.url})
        else:
            write_torch(target.path(target.name), specs, get)
        target.done(target.name)
        return [target.out]
    kw = {} if shard_bytes is None else {"shard_bytes": shard_bytes}
    files = write_hf_weights(target.dir, specs, get, on_written=target.done, **kw)
    extras = write_hf_extras(target.dir, cfg)
    for name in extras:
        target.done(name)
    return files + extras


def _nbytes(spec) -> int:
    n = spec[1].itemsize
    for d in spec[2]:
        n *= d
    return n


def write_hf_extras(out: str, cfg: dict) -> list[str]:
    """config.json (and generation_config.json from an hf source) and the run's tokenizer files."""
    tokenizer = str(cfg.get("data", {}).get("tokenizer", "bytes"))
    written = ["config.json"]
    config = spec_for(model_config(cfg)).hf_config_json(tokenizer if tokenizer == "bytes" else "files")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    written += copy_tokenizer(tokenizer, out)
    return written


def tokenizer_files(directory: str) -> list[str]:
    """The tokenizer's own files in ``directory`` (not a model's config.json)."""
    from ..data.tokenize import files_of_tokenizer

    return [p for p in files_of_tokenizer(directory) if os.path.basename(p) != "config.json"]


def copy_tokenizer(spec: str, out: str) -> list[str]:
    """Copy the tokenizer files of ``data.tokenizer`` into ``out`` (none for "bytes")."""
    if spec == "bytes" or "://" in spec:
        return []
    if os.path.isfile(spec):
        shutil.copyfile(spec, os.path.join(out, "tokenizer.json"))
        return ["tokenizer.json"] + _tokenizer_config(spec, out, ["tokenizer.json"])
    if not os.path.isdir(spec):
        raise ConfigError(f"the run's data.tokenizer={spec!r} is not on this machine; export where it is")
    names = []
    for path in tokenizer_files(spec):
        shutil.copyfile(path, os.path.join(out, os.path.basename(path)))
        names.append(os.path.basename(path))
    return names + _tokenizer_config(spec, out, names)


def _tokenizer_config(spec: str, out: str, names: list[str]) -> list[str]:
    """tokenizer_config.json beside a bare tokenizer.json: ``AutoTokenizer`` then loads the fast tokenizer
    as it is (not the model type's own class, which may add a BOS), with the end-of-text token the run
    appended after each document."""
    if "tokenizer.json" not in names or "tokenizer_config.json" in names:
        return []
    from ..data.tokenize import load_tokenizer

    tok = load_tokenizer(spec)
    doc = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if tok.eos_id is not None and hasattr(tok, "tok"):
        doc["eos_token"] = tok.tok.id_to_token(tok.eos_id)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
    return ["tokenizer_config.json"]


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="etrain ckpt export",
                                 description="Write a checkpoint's model as a transformers directory, a safetensors "
                                             "file or a torch.save file (any layout; one tensor at a time).")
    ap.add_argument("url", help="<root>/<run_id>[/checkpoints/step_N] (no step: the newest committed)")
    ap.add_argument("out", help="output: a directory (hf) or a file, a local path or a storage URL (s3://, gs://, "
                                "file://); an hf directory ends with MANIFEST.json, written last")
    ap.add_argument("--format", default="hf", help="hf (default), safetensors or torch")
    ap.add_argument("--dtype", default="fp32", help="fp32 (default) or bf16")
    ap.add_argument("--overwrite", action="store_true", help="replace the export in an OUT that exists and is not empty (the old one stays whole if this "
                         "one fails)")
    args = ap.parse_args(argv)
    try:
        summary = export(args.url, args.out, args.format, args.dtype, overwrite=args.overwrite)
    except (ConfigError, CheckpointError) as e:  # bad input: not committed, corrupt, an unknown format
        if isinstance(e, StorageError):
            print(f"etrain ckpt export: {e}", file=sys.stderr)
            return 1
        print(f"etrain ckpt export: {e}", file=sys.stderr)
        return 2
    except EtrainError as e:
        print(f"etrain ckpt export: {e}", file=sys.stderr)
        return 1
    print(f"exported step {summary['step']} ({summary['tensors']} tensors, {summary['bytes'] / 2**20:.1f} MiB, "
          f"{summary['dtype']}) to {redact(args.out)}: {', '.join(os.path.basename(f) for f in summary['files'])}")
    return 0


# --- [model] init_from: pretrained weights into any layout ------------------------------------


class WeightSource:
    """Full tensors by the model's own names from an ``init_from``: a ``transformers`` directory (or one
    weights file), validated by :mod:`trainer.models.hf.hf_dir` and read one tensor at a time, or an etrain
    checkpoint step (:class:`ModelSource`). Weights in the transformers layout of a family that maps its
    names (the built-in decoder reads a LlamaForCausalLM directory) are mapped back through its spec's
    ``hf_names()``. Every tensor read is checked finite."""

    def __init__(self, spec: str, mcfg: ModelConfig):
        from ..models.hf.hf_dir import open_weights

        self.spec, self.mcfg = spec, mcfg
        self.what = f"model.init_from={spec!r}"
        path = os.path.expanduser(spec)
        self.weights = None
        self.ckpt: ModelSource | None = None
        if os.path.isfile(path) and path.endswith((".safetensors", ".bin", ".pt")):
            self.weights = open_weights(path, self.what)
        elif os.path.isdir(path) and not os.path.isdir(os.path.join(path, "checkpoints")) and \
                (parse_step(path) is None or is_export_dir(path)):
            refuse_incomplete_export(path, self.what)
            self.weights = open_weights(path, self.what)
        else:
            self.ckpt = ModelSource.open(spec)
        names = spec_for(mcfg).hf_names() if self.weights is not None else None
        self.names = names if names is not None and names.renames else None
        self.hf_names = self.names is not None and self.names.holds_hf_names(self.weights.entries)

    @property
    def where(self) -> str:
        return self.ckpt.url if self.ckpt is not None else self.spec

    def name_of(self, fqn: str) -> str:
        return self.names.hf_name(fqn) if self.hf_names else fqn

    def shape_of(self, fqn: str) -> tuple[int, ...] | None:
        name = self.name_of(fqn)
        if self.ckpt is not None:
            spec = self.ckpt.specs().get(fqn)
            return None if spec is None else spec[1]
        entry = self.weights.entries.get(name)
        if entry is None or not self.hf_names or not hasattr(self.names, "from_hf_shape"):
            return None if entry is None else entry.shape
        return self.names.from_hf_shape(fqn, tuple(entry.shape))  # one part of a merged tensor (Mixtral's)

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """ConfigError naming the first tensor the source lacks or holds in another shape."""
        for fqn, shape in expected.items():
            got = self.shape_of(fqn)
            name = self.name_of(fqn)
            if got is None:
                raise ConfigError(f"model.init_from={self.spec!r} has no tensor {name!r}, which the model's "
                                  f"{fqn!r} {list(shape)} needs; is it a checkpoint of this model?")
            if tuple(got) != tuple(shape):
                raise ConfigError(f"model.init_from={self.spec!r}: tensor {name!r} has shape {list(got)}, the "
                                  f"model's {fqn!r} has shape {list(shape)}; use weights of this model's sizes")

    def read(self, fqn: str) -> torch.Tensor:
        """The tensor of the model's ``fqn`` (a parameter); ConfigError when it is not floating point or
        holds nan or inf."""
        if self.ckpt is not None:
            from ..models.hf.hf_dir import refuse_nonfinite

            t = self.ckpt.read(fqn)
            refuse_nonfinite(fqn, t, f"{self.what}: {self.ckpt.url}")
        else:
            t = self.weights.read(self.name_of(fqn))
        if not t.is_floating_point():
            raise ConfigError(f"{self.what}: tensor {self.name_of(fqn)!r} is {t.dtype}, but the model's {fqn!r} is a "
                              "floating-point parameter; are these the weights of this model?")
        return self.names.from_hf(fqn, t) if self.hf_names else t


def is_export_dir(path: str) -> bool:
    """Whether ``path`` is a ``<run>/exports/step_N`` directory of ``[checkpoint] export_every``."""
    path = path.rstrip("/")
    return parse_step(path) is not None and os.path.basename(os.path.dirname(path)) == EXPORTS


def refuse_incomplete_export(path: str, what: str) -> None:
    """ConfigError (exit 2) when ``path`` is an ``export_every`` directory that is not complete: no
    manifest, a corrupt one, files that are not what it lists, or stale (made from another checkpoint
    than the step's; :mod:`checkpointing.export.manifest`)."""
    state = export_dir_state(os.path.abspath(path)) if is_export_dir(path) else None
    if state is not None and not state.complete:
        raise ConfigError(f"{what} is an incomplete export ({state.state}: {state.why}); use another step or a "
                          "checkpoint URL")


def parse_step(path: str) -> int | None:
    from checkpointing.manifest import parse_step_dir

    return parse_step_dir(os.path.basename(path.rstrip("/")))


def init_from_preflight(cfg) -> None:
    """Before any process group starts: ``model.init_from`` is valid (:mod:`trainer.models.hf.hf_dir`) and holds every
    parameter of the model (built on the meta device) in its shape, every value finite; ConfigError
    (exit 2) naming the file or the tensor otherwise."""
    model = spec_for(cfg.model).build(device="meta")
    source = WeightSource(cfg.model.init_from, cfg.model)
    expected = {k: tuple(p.shape) for k, p in model.named_parameters()}
    source.check(expected)
    if source.weights is not None:  # local files: every value read once now (a checkpoint's as it loads)
        for fqn in expected:
            source.read(fqn)


@torch.no_grad()
def load_weights(state: dict[str, torch.Tensor], source: WeightSource) -> None:
    """Copy each full tensor of ``source`` into this rank's part of ``state`` ({fqn: tensor or DTensor of
    the global shape}, as the optimizer's checkpoint state holds the weights), one tensor at a time."""
    from ..models.spec import fill_local

    source.check({fqn: tuple(t.shape) for fqn, t in state.items()})
    for fqn, t in state.items():
        try:
            fill_local(t, source.read(fqn))
        except ValueError as e:
            raise ConfigError(f"{fqn}: {e} (model.init_from)") from None
