"""``[model]``: the built-in decoder's presets and sizes, a transformers config, or a Python factory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from checkpointing.errors import ConfigError

from .checks import MAX_TOKENS, check_finite, check_range, divisors, fmt_list

# Each size's bounds (docs/operations.md#bounds), far above any real model: refused at load, before a divisor
# listing or a model's construction crawls through a mistyped value.
SIZE_BOUNDS = {"dim": 2**20, "n_layers": 2**16, "n_heads": 2**16, "n_kv_heads": 2**16, "ffn_hidden": 2**22,
               "vocab_size": 2**24, "max_seq_len": MAX_TOKENS}
MAX_EXPERTS = 2**20

# Model sizes by name. A preset fills every model field that the [model]
# section does not set itself.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # ~0.9M parameters: fast enough for multi-process tests on two CPU cores.
    "tiny": {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "ffn_hidden": 384, "max_seq_len": 256},
    # ~25M parameters.
    "small": {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 8, "ffn_hidden": 1376, "max_seq_len": 1024},
    # GPU sizes.
    "125m": {"dim": 768, "n_layers": 18, "n_heads": 12, "n_kv_heads": 12, "ffn_hidden": 2048, "max_seq_len": 2048},
    "1b": {"dim": 2048, "n_layers": 20, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden": 5632, "max_seq_len": 2048},
    # Mixture of Experts (trainer/models/moe.py): the tiny sizes with 8 experts of ffn_hidden, top 2, every block.
    "moe-tiny": {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "ffn_hidden": 192, "max_seq_len": 256,
                 "n_experts": 8, "top_k": 2, "moe_every": 1},
}

# The model families by their model.source value: "package.module:Class" of each one's spec (a
# trainer.models.spec.ModelSpec), or the class itself once trainer.models has imported it. The one registry:
# trainer.models.register_family adds to it (and resolves from it), and the config checks model.source
# against its names without importing any model code.
MODEL_FAMILIES: dict[str, Any] = {
    "builtin": "trainer.models.decoder.spec:DecoderSpec",
    "hf": "trainer.models.hf.spec:HFSpec",
    "python": "trainer.models.factory:FactorySpec",
}
# The families whose fields this section checks itself; a registered family checks its own in its spec.
BUILTIN_FAMILIES = ("builtin", "hf", "python")


@dataclass(kw_only=True)
class ModelConfig:
    """The model: the built-in Llama-style decoder (``preset`` fills the sizes not given), a Hugging
    Face ``transformers`` causal LM built from a local config, or any ``nn.Module`` from a factory
    (docs/models-and-data.md)."""

    # "builtin": the decoder of trainer/models/decoder/; "hf": AutoModelForCausalLM.from_config(hf_config);
    # "python": factory(model table) -> nn.Module mapping token ids [b, s] to logits [b, s, vocab];
    # or the name of a family registered with trainer.models.register_family (MODEL_FAMILIES).
    source: str = "builtin"
    # source "hf": a directory holding config.json, or the JSON file itself (never fetched from a hub).
    hf_config: str = ""
    # source "python": "package.module:function"; loss: "package.module:function"(output, targets) -> scalar.
    factory: str = ""
    loss: str = ""
    # Class name of the repeated block (the unit of FSDP, activation checkpointing and pipeline cuts);
    # "" = the model's own _no_split_modules (HF), or every direct child of the first ModuleList.
    block_class: str = ""
    # Module paths (FQNs of blocks) where pipeline stages begin after the first; [] = equal block counts.
    pp_split_points: list[str] = field(default_factory=list)
    # "package.module:function"(model, tp_mesh) -> {module path: ParallelStyle}; HF models default to
    # their own base_model_tp_plan.
    tp_plan: str = ""
    # Free-form arguments for a python factory (it receives the whole [model] table).
    args: dict = field(default_factory=dict)
    preset: str = "tiny"
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_hidden: int = 384
    vocab_size: int = 256
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0
    # Mixture of Experts (0 experts: the dense decoder). Every moe_every-th block (index % moe_every ==
    # moe_every - 1) routes each token to its top_k of n_experts SwiGLU experts of ffn_hidden, plus
    # n_shared_experts always used; capacity_factor > 0 drops what overflows capacity_factor x the even
    # share of an expert (0 = dropless); aux_loss_coef x the load-balancing loss joins the loss;
    # router_bias_update_rate > 0 balances by a routing bias instead (auxiliary-loss-free).
    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    moe_every: int = 1
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01
    router_bias_update_rate: float = 0.0
    # Start from these weights (optimizer state fresh): a transformers directory (safetensors) or an etrain
    # checkpoint step URL; any layout. A resumed run keeps its checkpoint's weights.
    init_from: str = ""
    # Document masking: a sample packs documents back to back, each ended by data.tokenizer's end-of-document
    # token; with it, attention stays inside each document (causal and same document), found from the token
    # ids in the model's forward (trainer.models.documents). The built-in decoder and transformers decoders
    # (sdpa or eager attention) take it; pipeline and context parallelism do not (docs/models-and-data.md).
    document_mask: bool = False

    def __post_init__(self) -> None:
        self._check_source()
        for name in ("factory", "loss", "tp_plan"):
            ref = getattr(self, name)
            if ref and (ref.count(":") != 1 or not all(ref.split(":"))):
                raise ConfigError(f"model.{name}={ref!r} must look like \"package.module:function\"")
        if self.preset not in MODEL_PRESETS:
            raise ConfigError(
                f"model.preset={self.preset!r} is unknown; use one of {', '.join(MODEL_PRESETS)}"
            )
        for name, most in SIZE_BOUNDS.items():
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 1")
            check_range("model", name, getattr(self, name), 1, most)
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} does not divide model.dim={self.dim}; "
                f"use one of {fmt_list(divisors(self.dim))}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(
                f"model.dim / model.n_heads = {self.dim // self.n_heads} must be even for rotary embeddings"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}; "
                f"use one of {fmt_list(divisors(self.n_heads))}"
            )
        check_finite(self, "model")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        for name in ("norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be > 0")
        self._check_moe()
        self._check_document_mask()

    def _check_document_mask(self) -> None:
        """What the section alone says against ``document_mask``; the run's layout and data are checked by the
        model's spec before any process group (trainer.models.documents.check_document_run)."""
        if self.document_mask and self.source == "python":
            raise ConfigError('model.document_mask=true hands the model an attention mask, and a model.source="python" '
                              "factory's model takes token ids only; set model.document_mask=false (a factory may "
                              "mask documents itself from the token ids)")

    def _check_source(self) -> None:
        """model.source names a registered family; the fields of the built-in ones go with their source."""
        if self.source not in MODEL_FAMILIES:
            known = ", ".join(repr(name) for name in MODEL_FAMILIES)
            raise ConfigError(f"model.source={self.source!r} is no model family; use one of {known} "
                              "(trainer.models.register_family adds one)")
        if self.source not in BUILTIN_FAMILIES:
            return
        if self.source == "hf" and not self.hf_config:
            raise ConfigError('model.source="hf" needs model.hf_config: a directory with config.json, or the file')
        if self.source == "python" and not self.factory:
            raise ConfigError('model.source="python" needs model.factory="package.module:function"')
        if self.source != "python" and self.factory:
            raise ConfigError(f'model.factory is set but model.source={self.source!r}; set model.source="python"')
        if self.source != "hf" and self.hf_config:
            raise ConfigError(f'model.hf_config is set but model.source={self.source!r}; set model.source="hf"')

    def _check_moe(self) -> None:
        for name in ("n_experts", "n_shared_experts", "capacity_factor", "aux_loss_coef", "router_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 0")
        for name in ("n_experts", "n_shared_experts"):
            check_range("model", name, getattr(self, name), 0, MAX_EXPERTS)
        if not self.n_experts:
            return
        if self.source != "builtin":
            raise ConfigError(f"model.n_experts={self.n_experts} makes the built-in decoder a Mixture of Experts; "
                              f'model.source={self.source!r} brings its own model: set model.n_experts=0')
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"model.top_k={self.top_k} must be in [1, model.n_experts={self.n_experts}]")
        if not 1 <= self.moe_every <= self.n_layers:
            raise ConfigError(f"model.moe_every={self.moe_every} must be in [1, model.n_layers={self.n_layers}]")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` has experts (the last of every ``moe_every``)."""
        return self.n_experts > 0 and index % self.moe_every == self.moe_every - 1

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def seq_len_limit(self) -> int | None:
        """The longest sequence this section alone says the model takes: ``max_seq_len`` for the built-in
        decoder; None for a model a user brings (its own config says; its preflight checks it)."""
        return self.max_seq_len if self.source == "builtin" else None
