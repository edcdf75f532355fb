"""What a model a user brings (a ``transformers`` causal LM, an ``nn.Module`` factory) needs from the trainer.

    class MySpec(UserModelSpec):          # trainer.models.hf.spec, trainer.models.factory
        family = "..."
        def construct(self) -> nn.Module: ...

Such a model is built whole on the host under ``torch.manual_seed(train.seed)``, so every rank and
every layout starts from the same weights, and keeps its own parameter names (FQNs) in checkpoints
whatever the layout: activation checkpointing and FSDP are composable APIs that do not wrap modules.
With ``model.init_from`` its weights are loaded later, so its parameters are built on the meta
device and only this rank's shards are allocated, once parallelized.

What the layouts need from a model:

* blocks, the unit of FSDP (one all-gather group each) and of activation checkpointing: modules
  whose class is ``model.block_class``, else the model's own ``_no_split_modules`` (HF), else the
  children of its first ``nn.ModuleList``;
* tensor parallelism: a plan ``{module path: style}``: the model's own ``_tp_plan`` (``transformers``
  declares one for Llama, Qwen2, Mistral and others), or ``model.tp_plan = "pkg.mod:fn"`` returning
  ``{path: ParallelStyle}`` for ``fn(model, tp_mesh)``; a model with neither is refused under tp > 1;
* pipeline stages, for decoders laid out as Llama's (:mod:`.llama_layout`); stages begin at
  ``model.pp_split_points`` (block paths), by default at equal block counts. Any other model's
  ``forward`` cannot be cut generically: refused with the reason.

Sequence parallelism is for the built-in model only. The planner sees such a model as the built-in
decoder of the same width, depth, heads and vocabulary whose feed-forward width gives one block the
parameters the model's block has (:meth:`UserModelSpec.shape`, counted on the meta device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from abc import abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from checkpointing.errors import ConfigError

from ..config import ModelConfig, ParallelConfig, RunConfig
from .blocks import apply_block_ac, find_blocks, parameters_on_meta, shares_parameters, stage_ranges
from .documents import masked_layouts
from .llama_layout import cut_hf_stage, llama_like
from .refs import resolve_ref
from .shape import ModelShape
from .spec import ModelInfo, ModelSpec, Stage, to_empty, zero_parameters

# The HF TP styles this module can express with torch's own ParallelStyles.
HF_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "replicated_with_grad_allreduce")


class UserModelSpec(ModelSpec):
    """The common part of the families a user brings; a family says how to construct its model."""

    cached = True  # counting builds the model on the meta device: once per config

    def __init__(self, mcfg: ModelConfig):
        super().__init__(mcfg)
        self._counted: tuple[ModelShape, tuple[str, ...]] | None = None

    @abstractmethod
    def construct(self) -> nn.Module:
        """The model, under the device and the seed :meth:`build` sets (ConfigError when it cannot be built)."""

    def own_config(self, model: nn.Module) -> object | None:
        """The model's transformers config, when it comes from one (its vocabulary, its positions); else None."""
        return None

    def what_model(self, model: nn.Module) -> str:
        return type(model).__name__

    def planner_tp_plan(self, model: nn.Module) -> dict | None:
        """The model's own TP plan as the planner offers it (only a transformers family's)."""
        return None

    # --- building ------------------------------------------------------------------------------

    def build(self, device: str | torch.device = "meta", seed: int = 0, *, params_on_meta: bool = False) -> nn.Module:
        """The whole model, its weights drawn from ``seed`` (the same on every rank). ``params_on_meta``:
        its parameters on the meta device (each one exists on ``device`` only while it is created) and
        its buffers (rotary tables, masks) on ``device``, for a model whose weights are loaded later."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device(device), (parameters_on_meta() if params_on_meta else contextlib.nullcontext()):
                return self.construct()

    def build_stage(self, cfg: RunConfig, stage: int, n_stages: int, device: torch.device) -> Stage:
        on_meta = bool(self.mcfg.init_from)  # init_from (or a checkpoint on resume) fills every weight
        model = self.build("cpu", cfg.train.seed, params_on_meta=on_meta)
        if on_meta and shares_parameters(model):  # tied weights: built whole, as without init_from
            on_meta, model = False, self.build("cpu", cfg.train.seed)
        named = find_blocks(model, self.mcfg)
        blocks = [m for _, m in named]
        if n_stages > 1:
            keep = stage_ranges([n for n, _ in named], n_stages, self.mcfg.pp_split_points)[stage]
            blocks = cut_hf_stage(model, keep, first=stage == 0, last=stage == n_stages - 1)
        if not on_meta:
            model.to(device)
        return Stage(model, blocks, params_on_meta=on_meta)

    def apply_tp(self, module: nn.Module, tp_mesh, pcfg: ParallelConfig) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        plan = self.tp_styles(module, tp_mesh)
        if not plan:
            raise ConfigError("the tensor-parallel plan matches no module of the model; check model.tp_plan")
        parallelize_module(module, tp_mesh, plan)

    def tp_styles(self, model: nn.Module, tp_mesh) -> dict:
        """{module path: ParallelStyle}: ``model.tp_plan``'s, else the model's own ``_tp_plan`` (module docstring)."""
        if self.mcfg.tp_plan:
            plan = resolve_ref(self.mcfg.tp_plan, "model.tp_plan")(model, tp_mesh)
            if not isinstance(plan, dict):
                raise ConfigError(f"model.tp_plan={self.mcfg.tp_plan!r} returned {type(plan).__name__}, not a dict")
            return plan
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        make = {
            "colwise": ColwiseParallel,
            "rowwise": RowwiseParallel,
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # A per-head norm (Qwen3's q_norm, k_norm) after a column-wise projection: its input (batch, seq, heads,
            # head_dim) holds this rank's heads, its weight is replicated and its gradient summed over tp.
            "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
        }
        names = [n for n, _ in model.named_modules() if n]
        plan = {}
        for pattern, style in model._tp_plan.items():
            for name in names:
                # "*" stands for one path segment (a block index), as in transformers' plans.
                if name.count(".") == pattern.count(".") and fnmatch.fnmatchcase(name, pattern):
                    plan[name] = make[style]()
        return plan

    def apply_ac(self, stage: Stage, mode: str, every_k: int) -> None:
        apply_block_ac(stage.blocks, mode, every_k)

    @torch.no_grad()
    def materialize(self, stage: Stage, device: str | torch.device, seed: int, draw: bool = True) -> None:
        """Allocate a stage built with its parameters on meta (and parallelized: only this rank's shards)
        on ``device``, zero-filled until its weights are loaded; its buffers keep their values. A stage
        built whole on the host (its weights drawn already) is left as it is."""
        if not stage.params_on_meta:
            return
        model = stage.module
        buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
        to_empty(model, device)
        zero_parameters(model)
        for m, name, b in buffers:
            m._buffers[name] = b.to(device)

    def cast(self, module: nn.Module, dtype: torch.dtype) -> None:
        """Parameters to the compute dtype; buffers (rotary tables, masks) keep theirs."""
        for p in module.parameters():
            p.data = p.data.to(dtype)

    def local_params(self, module: nn.Module) -> int:
        """Parameters this rank holds after tensor parallelism (DTensor local shards), before ZeRO."""
        from torch.distributed.tensor import DTensor

        return sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in module.parameters())

    def forward_fn(self) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
        return plain_forward

    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        return resolve_ref(self.mcfg.loss, "model.loss") if self.mcfg.loss else None

    # --- what the model is -----------------------------------------------------------------------

    def shape(self) -> ModelShape:
        return self._count()[0]

    def allows(self) -> tuple[str, ...]:
        return masked_layouts(self.mcfg, self._count()[1])

    def _count(self) -> tuple[ModelShape, tuple[str, ...]]:
        """The model built on the meta device, counted (module docstring), and the layouts it takes."""
        if self._counted is not None:
            return self._counted
        m = self.mcfg
        try:
            model = self.build("meta")
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a factory that cannot run on the meta device
            raise ConfigError(f"model.factory={m.factory!r} cannot build on the meta device ({type(e).__name__}: "
                              f"{e}); etrain plan counts models there: make the factory create its tensors on the "
                              "current default device") from None
        blocks = find_blocks(model, m)
        block = sum(p.numel() for p in blocks[0][1].parameters())
        hf = self.own_config(model)
        sizes = hf_sizes(hf) if hf is not None else {}
        embed = next((mod for mod in model.modules() if isinstance(mod, nn.Embedding)), None)
        dim = sizes.get("dim") or (embed.embedding_dim if embed is not None else m.dim)
        heads = sizes.get("n_heads") or m.n_heads
        kv = sizes.get("n_kv_heads") or m.n_kv_heads
        if dim % heads or heads % kv or (dim // heads) % 2:
            heads = kv = next((h for h in (32, 16, 8, 4, 2, 1) if dim % h == 0 and (dim // h) % 2 == 0), 1)
        attn = 2 * dim * dim + 2 * dim * (dim // heads) * kv
        ffn = max(1, round((block - attn - 2 * dim) / (3 * dim)))
        shape = ModelShape(dim, len(blocks), heads, kv, ffn, self.vocab_size, m.max_seq_len,
                           f"{self.family} model {type(model).__name__}", "meta device",
                           params=sum(p.numel() for p in model.parameters()), block=block,
                           weights=sum(p.numel() for p in model.parameters() if p.dim() >= 2))
        # What training accepts of this model (preflight): tied embeddings refuse both; the HF plan's styles
        # must be ones etrain maps; stages are cut from Llama-like decoders only.
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        own = self.planner_tp_plan(model)
        tp_ok = bool(m.tp_plan) or (bool(own) and not tied and all(v in HF_STYLES for v in own.values()))
        pp_ok = llama_like(model) and not tied and not m.loss
        self._counted = shape, (("tp",) if tp_ok else ()) + (("pp",) if pp_ok else ())  # SP: the built-in only
        return self._counted

    def planning_model(self, seq_len: int) -> ModelConfig:
        s = self.shape()
        return dataclasses.replace(self.mcfg, source="builtin", hf_config="", factory="", loss="", tp_plan="",
                                   dim=s.dim, n_layers=s.n_layers, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads,
                                   ffn_hidden=s.ffn_hidden, vocab_size=s.vocab_size,
                                   max_seq_len=max(self.mcfg.max_seq_len, seq_len), init_from="")

    # --- the preflight ---------------------------------------------------------------------------

    def preflight(self, cfg: RunConfig) -> ModelInfo:
        """Build the model on the meta device and check it against the layout; ConfigError (exit 2) naming the
        field and the fix for anything that cannot train. Runs before any process group starts."""
        super().preflight(cfg)  # model.document_mask against the run
        mcfg, p = self.mcfg, cfg.parallel
        if mcfg.loss:
            resolve_ref(mcfg.loss, "model.loss")
        if mcfg.tp_plan:
            resolve_ref(mcfg.tp_plan, "model.tp_plan")
        try:
            model = self.build(device="meta")
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - a factory that cannot run on meta is built on the host instead
            model = self.build(device="cpu")
        blocks = find_blocks(model, mcfg)
        hf = self.own_config(model)
        vocab = int(hf.vocab_size) if hf is not None else mcfg.vocab_size
        max_len = hf_max_positions(hf) if hf is not None else None
        if max_len is not None and cfg.data.seq_len > max_len:
            raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's {max_len} positions "
                              f"({mcfg.hf_config}); use data.seq_len <= {max_len}")
        plan_kind = "model.tp_plan" if mcfg.tp_plan else ("model's own" if getattr(model, "_tp_plan", None) else "none")
        if p.pp > 1:
            self.check_pipeline(model, cfg, [n for n, _ in blocks])
        if p.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel=true is available for model.source=\"builtin\" only; "
                              "set it to false")
        if p.tp > 1:
            if plan_kind == "none":
                raise ConfigError(f"parallel.tp={p.tp}: the model declares no tensor-parallel plan "
                                  f"({type(model).__name__} has no _tp_plan); set "
                                  "model.tp_plan=\"package.module:function\" returning {module path: ParallelStyle}, "
                                  "or use parallel.tp=1")
            if plan_kind == "model's own":
                check_hf_plan(model, p)
        n_params = sum(t.numel() for t in model.parameters())
        return ModelInfo(mcfg.source, vocab, n_params, len(blocks), type(blocks[0][1]).__name__, plan_kind, max_len)

    def check_pipeline(self, model: nn.Module, cfg: RunConfig, block_names: list[str]) -> None:
        mcfg, p = self.mcfg, cfg.parallel
        if not llama_like(model):
            raise ConfigError(f"parallel.pp={p.pp}: pipeline stages can be cut from the built-in decoder and from "
                              f"transformers decoders laid out as Llama's, not from {self.what_model(model)}; use "
                              "parallel.pp=1 and shard with parallel.zero_stage=3 or tensor parallelism")
        if getattr(model.config, "tie_word_embeddings", False):
            raise ConfigError(f"parallel.pp={p.pp}: the model ties its input and output embeddings, which live on "
                              "the first and the last stage; use parallel.pp=1")
        if mcfg.loss:
            raise ConfigError("model.loss with parallel.pp > 1: the pipeline schedule computes the language-model "
                              "loss itself; drop model.loss or use parallel.pp=1")
        stage_ranges(block_names, p.pp * p.pp_stages_per_rank, mcfg.pp_split_points)


def check_hf_plan(model: nn.Module, p: ParallelConfig) -> None:
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


def hf_sizes(hf) -> dict:
    """A transformers config's width, heads, key/value heads, feed-forward width and vocabulary (None: not given)."""
    def get(*names: str) -> int | None:
        return next((int(getattr(hf, n)) for n in names if isinstance(getattr(hf, n, None), int)), None)

    return {"dim": get("hidden_size", "n_embd", "d_model"), "n_heads": get("num_attention_heads", "n_head"),
            "n_kv_heads": get("num_key_value_heads", "num_attention_heads", "n_head"),
            "ffn_hidden": get("intermediate_size", "n_inner"), "vocab_size": get("vocab_size")}


def hf_max_positions(hf) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(hf, name, None)
        if isinstance(value, int):
            return value
    return None


def logits_of(output) -> torch.Tensor:
    """A model's logits: the tensor itself, or the ``.logits`` of a transformers output."""
    return output if isinstance(output, torch.Tensor) else output.logits


def plain_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return logits_of(model(inputs))
