"""``etrain ckpt export``: a committed checkpoint's model as a ``transformers`` directory, one
``safetensors`` file or one ``torch.save`` file.

    etrain ckpt export s3://bucket/runs/tiny/checkpoints/step_000001000 ./tiny-hf --format hf
    etrain ckpt export file:///ckpt/runs/tiny ./tiny.safetensors --format safetensors --dtype bf16

Any layout consolidates (the checkpoint stores each parameter as a global tensor; see
:mod:`checkpointing.export`), one tensor at a time. ``hf`` writes ``config.json``, the weights
(``model.safetensors``, sharded with an index above 5 GB) and the run's tokenizer files; the
built-in decoder is written as ``LlamaForCausalLM``: its names are mapped and the rows of ``wq``
and ``wk`` permuted per head from interleaved rotary pairs (``trainer.model.apply_rope``) to the
halves that ``transformers``' ``rotate_half`` pairs, so the logits match. A ``transformers``
model keeps its own names and its own ``config.json``. ``safetensors`` and ``torch`` write the
model's own state dict (etrain names). The run config comes from the manifest.

:func:`to_hf` / :func:`from_hf` are the name and layout conversion, used by ``init_from`` as well.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import torch

from checkpointing.cli_args import ArgumentParser
from checkpointing.errors import CheckpointError, ConfigError, EtrainError, StorageError
from checkpointing.export import (
    EXPORT_MANIFEST,
    ModelSource,
    Output,
    write_hf_weights,
    write_safetensors,
    write_torch,
)
from checkpointing.export_manifest import CHECKPOINT_KEY, export_dir_state
from checkpointing.layout import EXPORTS
from checkpointing.names import redact

from .config import ModelConfig
from .config_load import build_section

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FORMATS = ("hf", "safetensors", "torch")
# built-in name -> LlamaForCausalLM name (per block: the part after "layers.<i>.")
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")


def run_config(src: ModelSource) -> dict:
    """The resolved run config the checkpoint's manifest records; ConfigError for an adopted one."""
    cfg = src.manifest.config
    if not cfg or "model" not in cfg:
        raise ConfigError(f"{src.url} records no run config (adopted from stock DCP): it cannot say what model "
                          "it holds; export it with the torch format or read it with PyTorch (docs/checkpoint-format.md)")
    return cfg


def model_config(cfg: dict) -> ModelConfig:
    return build_section("model", ModelConfig, dict(cfg["model"]))


# --- built-in <-> LlamaForCausalLM --------------------------------------------------------------


def hf_name(fqn: str) -> str:
    """The LlamaForCausalLM name of a built-in parameter."""
    if fqn in _TOP:
        return _TOP[fqn]
    m = _LAYER.match(fqn)
    if m is None or m.group(3) not in _BLOCK:
        raise ConfigError(f"{fqn!r} is not a parameter of the built-in decoder")
    return f"model.layers.{m.group(2)}.{_BLOCK[m.group(3)]}"


def builtin_name(name: str) -> str:
    """The built-in name of a LlamaForCausalLM parameter (the inverse of :func:`hf_name`)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = _LAYER.match(name)
    if m is None or not m.group(1) or m.group(3) not in _BLOCK_BACK:
        raise ConfigError(f"{name!r} is not a parameter of a Llama model that the built-in decoder has")
    return f"layers.{m.group(2)}.{_BLOCK_BACK[m.group(3)]}"


def _rope_permute(t: torch.Tensor, head_dim: int, to_hf: bool) -> torch.Tensor:
    """Rows of a q/k projection per head: interleaved pairs (2j, 2j+1) <-> halves (j, j + head_dim/2)."""
    rows, cols = t.shape
    if to_hf:
        return t.reshape(rows // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    return t.reshape(rows // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(fqn: str, t: torch.Tensor, mcfg: ModelConfig) -> torch.Tensor:
    """A built-in tensor in LlamaForCausalLM's layout (q/k rows permuted; everything else as is)."""
    if fqn.endswith(("attention.wq.weight", "attention.wk.weight")):
        return _rope_permute(t, mcfg.head_dim, to_hf=True)
    return t


def from_hf(fqn: str, t: torch.Tensor, mcfg: ModelConfig) -> torch.Tensor:
    """The inverse of :func:`to_hf` (``fqn`` is the built-in name)."""
    if fqn.endswith(("attention.wq.weight", "attention.wk.weight")) and t.dim() == 2 and t.shape[0] % mcfg.head_dim == 0:
        return _rope_permute(t, mcfg.head_dim, to_hf=False)
    return t


def llama_config(mcfg: ModelConfig, tokenizer: str = "bytes") -> dict:
    """The ``config.json`` of the built-in decoder as a LlamaForCausalLM."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=mcfg.vocab_size, hidden_size=mcfg.dim, intermediate_size=mcfg.ffn_hidden,
                      num_hidden_layers=mcfg.n_layers, num_attention_heads=mcfg.n_heads,
                      num_key_value_heads=mcfg.n_kv_heads, head_dim=mcfg.head_dim, rms_norm_eps=mcfg.norm_eps,
                      rope_theta=mcfg.rope_theta, max_position_embeddings=mcfg.max_seq_len,
                      tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False,
                      torch_dtype="float32", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.architectures = ["LlamaForCausalLM"]
    out = cfg.to_dict()
    out["etrain_tokenizer"] = tokenizer  # what `etrain generate` encodes with when no tokenizer files are here
    return out


# --- the export -------------------------------------------------------------------------------


def plan(src: ModelSource, fmt: str, dtype: torch.dtype):
    """(specs, get, config): what to write, a function returning each output tensor, the run config."""
    cfg = run_config(src)
    mcfg = model_config(cfg)
    specs_in = src.specs()
    convert = fmt == "hf" and mcfg.source == "builtin"
    back: dict[str, str] = {}
    specs = []
    for fqn, (dt, shape) in specs_in.items():
        name = hf_name(fqn) if convert else fqn
        back[name] = fqn
        out_dt = dtype if dt.is_floating_point else dt
        specs.append((name, out_dt, shape))

    def get(name: str) -> torch.Tensor:
        fqn = back[name]
        t = src.read(fqn)
        if convert:
            t = to_hf(fqn, t, mcfg)
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
        finally:
            target.close()
    finally:
        src.close()
    return {"source": src.url, "step": src.step, "format": fmt, "dtype": dtype, "tensors": len(specs),
            "bytes": sum(_nbytes(s) for s in specs), "files": files, "url": target.url}


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
    mcfg = model_config(cfg)
    tokenizer = str(cfg.get("data", {}).get("tokenizer", "bytes"))
    written = ["config.json"]
    if mcfg.source == "builtin":
        config = llama_config(mcfg, tokenizer if tokenizer == "bytes" else "files")
    elif mcfg.source == "hf":
        from .hf_dir import read_config

        path = os.path.expanduser(mcfg.hf_config)
        if not os.path.exists(os.path.join(path, "config.json") if os.path.isdir(path) else path):
            raise ConfigError(f"the run's model.hf_config={mcfg.hf_config!r} is not on this machine; export where it "
                              "is, or use --format safetensors")
        config = read_config(path, f"the run's model.hf_config={mcfg.hf_config!r}")
        config.setdefault("etrain_tokenizer", tokenizer if tokenizer == "bytes" else "files")
    else:
        raise ConfigError("--format hf needs a built-in or a transformers model (model.source=\"python\" has no "
                          "transformers config); use --format safetensors or torch")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    written += copy_tokenizer(tokenizer, out)
    return written


def tokenizer_files(directory: str) -> list[str]:
    """The tokenizer's own files in ``directory`` (not a model's config.json)."""
    from .tokenize import files_of_tokenizer

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
    from .tokenize import load_tokenizer

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
    ap.add_argument("--overwrite", action="store_true", help="write into an OUT that exists and is not empty")
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
    weights file), validated by :mod:`trainer.hf_dir` and read one tensor at a time, or an etrain
    checkpoint step (:class:`ModelSource`). A built-in model reads a LlamaForCausalLM export through
    :func:`hf_name`. Every tensor read is checked finite."""

    def __init__(self, spec: str, mcfg: ModelConfig):
        from .hf_dir import open_weights

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
        self.hf_names = mcfg.source == "builtin" and self.weights is not None and \
            "model.embed_tokens.weight" in self.weights.entries

    @property
    def where(self) -> str:
        return self.ckpt.url if self.ckpt is not None else self.spec

    def name_of(self, fqn: str) -> str:
        return hf_name(fqn) if self.hf_names else fqn

    def shape_of(self, fqn: str) -> tuple[int, ...] | None:
        name = self.name_of(fqn)
        if self.ckpt is not None:
            spec = self.ckpt.specs().get(fqn)
            return None if spec is None else spec[1]
        entry = self.weights.entries.get(name)
        return None if entry is None else entry.shape

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
            from .hf_dir import refuse_nonfinite

            t = self.ckpt.read(fqn)
            refuse_nonfinite(fqn, t, f"{self.what}: {self.ckpt.url}")
        else:
            t = self.weights.read(self.name_of(fqn))
        if not t.is_floating_point():
            raise ConfigError(f"{self.what}: tensor {self.name_of(fqn)!r} is {t.dtype}, but the model's {fqn!r} is a "
                              "floating-point parameter; are these the weights of this model?")
        return from_hf(fqn, t, self.mcfg) if self.hf_names else t


def is_export_dir(path: str) -> bool:
    """Whether ``path`` is a ``<run>/exports/step_N`` directory of ``[checkpoint] export_every``."""
    path = path.rstrip("/")
    return parse_step(path) is not None and os.path.basename(os.path.dirname(path)) == EXPORTS


def refuse_incomplete_export(path: str, what: str) -> None:
    """ConfigError (exit 2) when ``path`` is an ``export_every`` directory that is not complete: no
    manifest, a corrupt one, files that are not what it lists, or stale (made from another checkpoint
    than the step's; :mod:`checkpointing.export_manifest`)."""
    state = export_dir_state(os.path.abspath(path)) if is_export_dir(path) else None
    if state is not None and not state.complete:
        raise ConfigError(f"{what} is an incomplete export ({state.state}: {state.why}); use another step or a "
                          "checkpoint URL")


def parse_step(path: str) -> int | None:
    from checkpointing.manifest import parse_step_dir

    return parse_step_dir(os.path.basename(path.rstrip("/")))


def init_from_preflight(cfg) -> None:
    """Before any process group starts: ``model.init_from`` is valid (:mod:`trainer.hf_dir`) and holds every
    parameter of the model (built on the meta device) in its shape, every value finite; ConfigError
    (exit 2) naming the file or the tensor otherwise."""
    if cfg.model.source == "builtin":
        from .model import Transformer

        with torch.device("meta"):
            model = Transformer(cfg.model)
    else:
        from .models import build_model

        model = build_model(cfg, device="meta")
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
    from .model import fill_local

    source.check({fqn: tuple(t.shape) for fqn, t in state.items()})
    for fqn, t in state.items():
        try:
            fill_local(t, source.read(fqn))
        except ValueError as e:
            raise ConfigError(f"{fqn}: {e} (model.init_from)") from None
