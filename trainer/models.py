"""Bring your own model: Hugging Face ``transformers`` causal LMs and ``nn.Module`` factories.

    info = inspect_model(cfg)                      # before any process group: exit 2 on bad input
    parts = build_custom_parts(cfg, dims, mesh, rank, device)   # what build_model_parts returns

``[model] source = "hf"`` builds ``AutoModelForCausalLM.from_config`` from a local ``config.json``
(never from a hub: ``HF_HUB_OFFLINE`` is set); ``source = "python"`` calls ``factory(model_table)``
and expects an ``nn.Module`` mapping token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]``
(or an output with ``.logits``). Both are built on the host under ``torch.manual_seed(train.seed)``,
so every rank and every layout starts from the same weights, and keep their own parameter names
(FQNs) in checkpoints whatever the layout: activation checkpointing and FSDP are composable APIs
that do not wrap modules.

What the layouts need from a model:

* blocks, the unit of FSDP (one all-gather group each) and of activation checkpointing: modules
  whose class is ``model.block_class``, else the model's own ``_no_split_modules`` (HF), else the
  children of its first ``nn.ModuleList``;
* tensor parallelism: a plan ``{module path: style}``: the model's own ``_tp_plan`` (``transformers``
  declares one for Llama, Qwen2, Mistral and others), or ``model.tp_plan = "pkg.mod:fn"`` returning
  ``{path: ParallelStyle}`` for ``fn(model, tp_mesh)``; a model with neither is refused under tp > 1.

* pipeline stages, for ``transformers`` decoders laid out as Llama's (``model.embed_tokens``,
  ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``: Llama, Qwen2, Mistral and
  others): each stage keeps its blocks under their own names and runs them with its own rotary
  positions; stages begin at ``model.pp_split_points`` (block paths), by default at equal block
  counts. A python factory's ``forward`` cannot be cut generically: refused with the reason.

Sequence parallelism is for the built-in model only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import importlib
import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from checkpointing.errors import ConfigError
from checkpointing.names import redact

from .config import ModelConfig, ParallelConfig, RunConfig

log = logging.getLogger("etrain")

# The HF TP styles this module can express with torch's own ParallelStyles.
HF_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")


def resolve_ref(ref: str, field: str) -> Callable:
    """The callable named ``package.module:function``; ConfigError naming ``field`` when it does not import."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's config to fix
        raise ConfigError(f"{field}={ref!r}: module {module_name!r} does not import ({type(e).__name__}: {e}); "
                          "is it on PYTHONPATH (or in the job's working_dir)?") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{field}={ref!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ConfigError(f"{field}={ref!r} is not callable")
    return obj


def load_hf_config(mcfg: ModelConfig):
    """The ``transformers`` config of ``model.hf_config`` (a directory with config.json, or the file)."""
    path = os.path.expanduser(mcfg.hf_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model.hf_config={redact(mcfg.hf_config)!r} does not exist; give a directory holding "
                          "config.json, or the JSON file itself (nothing is downloaded)")
    from .hf_dir import read_config

    read_config(path, f"model.hf_config={mcfg.hf_config!r}")  # JSON, an object, its sizes integers
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad file
        raise ConfigError(f"model.hf_config={mcfg.hf_config!r} is not a transformers config: {e}") from None
    config.use_cache = False
    if getattr(config, "_attn_implementation_internal", None) is None:
        config._attn_implementation = "sdpa"
    return config


def build_model(cfg: RunConfig, device: str | torch.device = "cpu", *, params_on_meta: bool = False) -> nn.Module:
    """The whole model of a hf/python source, its weights drawn from ``train.seed`` (same on every rank).

    ``params_on_meta``: its parameters on the meta device (each one exists on ``device`` only while it is
    created) and its buffers (rotary tables, masks) on ``device``, for a model whose weights are loaded
    later (``model.init_from``): :func:`materialize` allocates it once parallelized."""
    mcfg = cfg.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        with torch.device(device), (_parameters_on_meta() if params_on_meta else contextlib.nullcontext()):
            if mcfg.source == "hf":
                from transformers import AutoModelForCausalLM

                hf = load_hf_config(mcfg)
                try:
                    model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
                except Exception as e:  # noqa: BLE001 - transformers raises many kinds for values it cannot build
                    raise ConfigError(f"model.hf_config={mcfg.hf_config!r} does not build a model "
                                      f"({type(e).__name__}: {str(e)[:200]}); fix the config") from None
            else:
                factory = resolve_ref(mcfg.factory, "model.factory")
                try:
                    model = factory(dataclasses.asdict(mcfg))
                except ConfigError:
                    raise
                except Exception as e:  # noqa: BLE001 - the user's factory failed
                    raise ConfigError(f"model.factory={mcfg.factory!r} raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory={mcfg.factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered meanwhile moves to the meta device as it is registered."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def shares_parameters(model: nn.Module) -> bool:
    """Whether one parameter is registered under two names (tied embeddings)."""
    return len(list(model.named_parameters(remove_duplicate=False))) != len(list(model.parameters()))


@torch.no_grad()
def materialize(model: nn.Module, device: str | torch.device) -> None:
    """Allocate a model built with ``params_on_meta`` (and parallelized: only this rank's shards) on
    ``device``, zero-filled until its weights are loaded; its buffers keep their values."""
    from torch.distributed.tensor import DTensor

    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    model.to_empty(device=device)
    for p in model.parameters():
        (p.to_local() if isinstance(p, DTensor) else p).zero_()
    for m, name, b in buffers:
        m._buffers[name] = b.to(device)


def find_blocks(model: nn.Module, mcfg: ModelConfig) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, in order (module docstring): ConfigError when there are none."""
    names = {mcfg.block_class} if mcfg.block_class else set(getattr(model, "_no_split_modules", None) or ())
    if names:
        blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in names]
        if not blocks:
            field = "model.block_class" if mcfg.block_class else "the model's _no_split_modules"
            raise ConfigError(f"{field} names {sorted(names)}, but the model has no module of that class; "
                              "set model.block_class to the class of its repeated layer")
        return blocks
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            return [(f"{name}.{k}", child) for k, child in m.named_children()]
    raise ConfigError("the model has no nn.ModuleList of blocks; set model.block_class to the class of its "
                      "repeated layer (the unit of FSDP and activation checkpointing)")


def model_vocab_size(cfg: RunConfig) -> int:
    """The vocabulary the model's logits cover."""
    if cfg.model.source == "hf":
        return int(load_hf_config(cfg.model).vocab_size)
    return cfg.model.vocab_size


def hf_max_positions(hf) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(hf, name, None)
        if isinstance(value, int):
            return value
    return None


@dataclass
class ModelInfo:
    """What the preflight learned about a hf/python model (printed at start, used in checks)."""

    source: str
    vocab_size: int
    n_params: int
    blocks: int
    block_class: str
    tp_plan: str  # "model's own", "model.tp_plan" or "none"
    max_seq_len: int | None

    def describe(self) -> str:
        return (f"{self.source} model, {self.n_params / 1e6:.1f}M parameters, {self.blocks} x {self.block_class}, "
                f"vocabulary {self.vocab_size}")


def inspect_model(cfg: RunConfig) -> ModelInfo:
    """Build the model on the meta device and check it against the layout; ConfigError (exit 2) naming the
    field and the fix for anything that cannot train. Runs before any process group starts."""
    mcfg, p = cfg.model, cfg.parallel
    if mcfg.loss:
        resolve_ref(mcfg.loss, "model.loss")
    if mcfg.tp_plan:
        resolve_ref(mcfg.tp_plan, "model.tp_plan")
    try:
        model = build_model(cfg, device="meta")
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - a factory that cannot run on meta is built on the host instead
        model = build_model(cfg, device="cpu")
    blocks = find_blocks(model, mcfg)
    hf = model.config if mcfg.source == "hf" else None
    vocab = int(hf.vocab_size) if hf is not None else mcfg.vocab_size
    max_len = hf_max_positions(hf) if hf is not None else None
    if max_len is not None and cfg.data.seq_len > max_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's {max_len} positions "
                          f"({mcfg.hf_config}); use data.seq_len <= {max_len}")
    plan_kind = "model.tp_plan" if mcfg.tp_plan else ("model's own" if getattr(model, "_tp_plan", None) else "none")
    if p.pp > 1:
        _check_pipeline(model, cfg, [n for n, _ in blocks])
    if p.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel=true is available for model.source=\"builtin\" only; "
                          "set it to false")
    if p.tp > 1:
        if plan_kind == "none":
            raise ConfigError(f"parallel.tp={p.tp}: the model declares no tensor-parallel plan "
                              f"({type(model).__name__} has no _tp_plan); set model.tp_plan=\"package.module:function\" "
                              "returning {module path: ParallelStyle}, or use parallel.tp=1")
        if plan_kind == "model's own":
            _check_hf_plan(model, p)
    n_params = sum(t.numel() for t in model.parameters())
    return ModelInfo(mcfg.source, vocab, n_params, len(blocks), type(blocks[0][1]).__name__, plan_kind, max_len)


def _check_pipeline(model: nn.Module, cfg: RunConfig, block_names: list[str]) -> None:
    mcfg, p = cfg.model, cfg.parallel
    if not llama_like(model):
        what = "a python factory's model" if mcfg.source == "python" else f"{type(model).__name__}"
        raise ConfigError(f"parallel.pp={p.pp}: pipeline stages can be cut from the built-in decoder and from "
                          f"transformers decoders laid out as Llama's, not from {what}; use parallel.pp=1 and "
                          "shard with parallel.zero_stage=3 or tensor parallelism")
    if getattr(model.config, "tie_word_embeddings", False):
        raise ConfigError(f"parallel.pp={p.pp}: the model ties its input and output embeddings, which live on the "
                          "first and the last stage; use parallel.pp=1")
    if mcfg.loss:
        raise ConfigError("model.loss with parallel.pp > 1: the pipeline schedule computes the language-model "
                          "loss itself; drop model.loss or use parallel.pp=1")
    stage_ranges(block_names, p.pp * p.pp_stages_per_rank, mcfg.pp_split_points)


def llama_like(model: nn.Module) -> bool:
    base = getattr(model, "model", None)
    return all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) and hasattr(
        model, "lm_head") and isinstance(base.layers, nn.ModuleList)


def stage_ranges(block_names: list[str], n_stages: int, split_points: list[str]) -> list[range]:
    """Block index ranges per pipeline stage: starting at ``split_points`` (block paths), else even."""
    if n_stages > len(block_names):
        raise ConfigError(f"{n_stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank) exceed the "
                          f"model's {len(block_names)} blocks; use at most {len(block_names)} stages")
    if not split_points:
        base, extra = divmod(len(block_names), n_stages)
        starts = [s * base + min(s, extra) for s in range(n_stages)]
    else:
        if len(split_points) != n_stages - 1:
            raise ConfigError(f"model.pp_split_points has {len(split_points)} entries; {n_stages} stages need "
                              f"{n_stages - 1} (the block where each stage after the first begins)")
        unknown = [x for x in split_points if x not in block_names]
        if unknown:
            raise ConfigError(f"model.pp_split_points: {unknown} are not blocks of the model; blocks are "
                              f"{block_names[0]!r} .. {block_names[-1]!r}")
        starts = [0] + [block_names.index(x) for x in split_points]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ConfigError(f"model.pp_split_points={split_points} must name blocks in increasing order, "
                              "none of them the first")
    ends = starts[1:] + [len(block_names)]
    return [range(a, b) for a, b in zip(starts, ends)]


def cut_hf_stage(model: nn.Module, keep: range, first: bool, last: bool) -> list[nn.Module]:
    """Keep what one pipeline stage of a Llama-like ``transformers`` model runs, in place; its blocks.

    The kept blocks keep their names (``model.layers.5``): the layer list becomes a dict keyed by the
    original indices. The stage's ``forward`` takes token ids (first stage) or hidden states and returns
    hidden states or logits (last stage)."""
    base = model.model
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in keep})
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = None
        model.lm_head = None
    model.forward = types.MethodType(_stage_forward, model)
    return list(base.layers.values())


def _stage_forward(self, x: torch.Tensor) -> torch.Tensor:
    base = self.model
    h = base.embed_tokens(x) if base.embed_tokens is not None else x
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    rotary = base.rotary_emb(h, position_ids=positions)
    for layer in base.layers.values():
        # No mask: the attention runs causal (SDPA's is_causal), as the whole model does on unpadded input.
        h = layer(h, attention_mask=None, position_embeddings=rotary, position_ids=positions)
    if self.lm_head is not None:
        h = self.lm_head(base.norm(h))
    return h


def model_preflight(cfg: RunConfig) -> ModelInfo | None:
    """:func:`inspect_model` for a hf/python model; None for the built-in one (its config checks itself)."""
    return None if cfg.model.source == "builtin" else inspect_model(cfg)


def _check_hf_plan(model: nn.Module, p: ParallelConfig) -> None:
    """The HF plan uses styles we can express and the sizes it shards divide by tp."""
    bad = sorted({s for s in model._tp_plan.values() if s not in HF_STYLES})
    if bad:
        raise ConfigError(f"parallel.tp={p.tp}: the model's tensor-parallel plan uses {bad}, which etrain does not "
                          f"map (it maps {', '.join(HF_STYLES)}); give model.tp_plan, or use parallel.tp=1")
    if getattr(model.config, "tie_word_embeddings", False):
        raise ConfigError(f"parallel.tp={p.tp}: the model ties its input and output embeddings, which this plan "
                          "would shard twice; use parallel.tp=1 (shard with parallel.zero_stage=3)")
    hf = model.config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(hf, name, None)
        if isinstance(value, int) and value % p.tp:
            raise ConfigError(f"parallel.tp={p.tp} does not divide the model's {name}={value}; "
                              f"use a tp that divides it")


def _styles(model: nn.Module, cfg: RunConfig, tp_mesh) -> dict:
    """{module path: ParallelStyle} for this model (module docstring)."""
    if cfg.model.tp_plan:
        plan = resolve_ref(cfg.model.tp_plan, "model.tp_plan")(model, tp_mesh)
        if not isinstance(plan, dict):
            raise ConfigError(f"model.tp_plan={cfg.model.tp_plan!r} returned {type(plan).__name__}, not a dict")
        return plan
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    make = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    names = [n for n, _ in model.named_modules() if n]
    plan = {}
    for pattern, style in model._tp_plan.items():
        for name in names:
            # "*" stands for one path segment (a block index), as in transformers' plans.
            if name.count(".") == pattern.count(".") and fnmatch.fnmatchcase(name, pattern):
                plan[name] = make[style]()
    return plan


def apply_tp_plan(model: nn.Module, cfg: RunConfig, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    plan = _styles(model, cfg, tp_mesh)
    if not plan:
        raise ConfigError("the tensor-parallel plan matches no module of the model; check model.tp_plan")
    parallelize_module(model, tp_mesh, plan)


def apply_block_ac(blocks: list[nn.Module], mode: str, every_k: int) -> None:
    """Activation checkpointing per block with the composable API (no wrapper: FQNs stay the model's)."""
    from torch.distributed._composable import checkpoint

    for i, block in enumerate(blocks):
        if mode == "full" or (mode == "every_k" and i % every_k == 0):
            checkpoint(block)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters to the compute dtype; buffers (rotary tables, masks) keep theirs."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


def logits_of(output) -> torch.Tensor:
    """A model's logits: the tensor itself, or the ``.logits`` of a transformers output."""
    return output if isinstance(output, torch.Tensor) else output.logits


def hf_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(input_ids=inputs, use_cache=False).logits


def plain_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return logits_of(model(inputs))


def local_param_count(model: nn.Module) -> int:
    """Parameters this rank holds after tensor parallelism (DTensor local shards), before ZeRO."""
    from torch.distributed.tensor import DTensor

    return sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in model.parameters())
