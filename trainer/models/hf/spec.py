"""``transformers`` causal LMs as a model family (``[model] source = "hf"``).

    spec = HFSpec(cfg.model)          # model.hf_config: a directory holding config.json, or the file
    model = spec.build("meta")        # AutoModelForCausalLM.from_config, nothing allocated

The model is built from a local ``config.json`` (never from a hub: ``HF_HUB_OFFLINE`` is set), read
by :mod:`trainer.models.hf.hf_dir` first (JSON, an object, its sizes integers). Its own names are transformers'
names, so an export keeps them and its own ``config.json``; its blocks are its ``_no_split_modules``;
its tensor-parallel plan is its ``_tp_plan`` (:mod:`.brought`); under context parallelism its attention
is routed through etrain's (:mod:`.hf_cp`) and its positions are the global ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable

import torch
from torch import nn

from checkpointing.errors import ConfigError
from checkpointing.names import redact

from ...config import ModelConfig, RunConfig
from ..brought import UserModelSpec, hf_max_positions
from ..documents import masked_layouts
from ..spec import ModelInfo, Stage
from .cp import cp_refusal, global_positions, route_attention
from .documents import ATTRIBUTE, attention_mask, document_mask_refusal
from .moe import ExpertLayer, count_load, dense_tp_plan, moe_family, moe_forward, router_aux_loss, sparse_blocks


def load_hf_config(mcfg: ModelConfig):
    """The ``transformers`` config of ``model.hf_config`` (a directory with config.json, or the file)."""
    path = os.path.expanduser(mcfg.hf_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model.hf_config={redact(mcfg.hf_config)!r} does not exist; give a directory holding "
                          "config.json, or the JSON file itself (nothing is downloaded)")
    from .hf_dir import read_config, require_hf

    read_config(path, f"model.hf_config={mcfg.hf_config!r}")  # JSON, an object, its sizes integers
    require_hf('model.source="hf"')
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


def hf_forward(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(input_ids=inputs, position_ids=global_positions(model, inputs),
                 attention_mask=attention_mask(model, inputs), use_cache=False).logits


class HFSpec(UserModelSpec):
    family = "hf"

    def __init__(self, mcfg: ModelConfig):
        super().__init__(mcfg)
        self._hf = None
        self._cp_refusals: dict[int, str | None] = {}
        self._document_refusals: dict[int, str | None] = {}

    def cp_refusal(self, seq_len: int) -> str | None:
        """Why this model's attention cannot take context parallelism at ``seq_len`` (:mod:`.hf_cp`), or None."""
        if seq_len not in self._cp_refusals:
            self._cp_refusals[seq_len] = cp_refusal(self.build("meta"), seq_len)
        return self._cp_refusals[seq_len]

    def allows(self) -> tuple[str, ...]:
        if self.moe_family():  # a Mixture of Experts: data, expert and tensor parallelism (check_moe)
            return tuple(a for a in super().allows() if a == "tp")
        return super().allows() + masked_layouts(self.mcfg, () if self.cp_refusal(self.mcfg.max_seq_len) else ("cp",))

    def document_mask_refusal(self, seq_len: int) -> str | None:
        """Why the model cannot take a document mask at ``seq_len`` (:mod:`.documents`), or None."""
        if seq_len not in self._document_refusals:
            kind = self.moe_family()
            self._document_refusals[seq_len] = (
                f"a {kind} model's balancing loss reads the attention_mask as a padding mask of (batch, seq), "
                "which a document mask is not" if kind else document_mask_refusal(self.build("meta"), seq_len))
        return self._document_refusals[seq_len]

    def apply_document_mask(self, module: nn.Module, eos_id: int) -> None:
        """Its forward (:func:`hf_forward`, the MoE's) hands it a 4D mask of every sample's documents."""
        setattr(module, ATTRIBUTE, eos_id)

    def preflight(self, cfg: RunConfig) -> ModelInfo:
        info = super().preflight(cfg)
        self.check_moe(cfg)
        cp = cfg.parallel.cp
        if cp > 1:
            reason = self.cp_refusal(cfg.data.seq_len)
            if reason:
                raise ConfigError(f"parallel.cp={cp} routes the model's attention through context parallelism, and "
                                  f"{reason}; set parallel.cp=1")
            heads = int(self.hf_config().num_attention_heads)
            if cfg.parallel.cp_style == "ulysses" and heads % cp:
                raise ConfigError(f'parallel.cp_style="ulysses" splits the attention heads across the cp ranks: the '
                                  f"model's num_attention_heads={heads} is not divisible by parallel.cp={cp}; "
                                  'use parallel.cp_style="ring"')
        return info

    def moe_family(self) -> str | None:
        """The model_type of a mapped transformers MoE (:mod:`.hf_moe`), None when dense; ConfigError when unmapped."""
        return moe_family(self.hf_config())

    def check_moe(self, cfg: RunConfig) -> None:
        """A transformers MoE against the layout (ConfigError, exit 2, before any process group)."""
        ep, kind = cfg.parallel.ep, self.moe_family()
        if ep == 0:  # ParallelDims.expert_degree reads model.n_experts, which a transformers config keeps to itself
            raise ConfigError("parallel.ep=0 (automatic) is for the built-in MoE (model.n_experts); with "
                              "model.source=\"hf\" set parallel.ep to a divisor of the model's experts, or 1")
        if kind is None:
            if ep > 1:
                raise ConfigError(f"parallel.ep={ep} splits the experts of a Mixture of Experts, and "
                                  f"model.hf_config={self.mcfg.hf_config!r} is a dense model; set parallel.ep=1")
            return
        sparse_blocks(self.build("meta"))
        if self.mcfg.router_bias_update_rate > 0:
            raise ConfigError(f"model.router_bias_update_rate={self.mcfg.router_bias_update_rate} moves the built-in "
                              f"MoE's routing biases, and a {kind} router has none; set it to 0 (the model balances by "
                              "its own router_aux_loss_coef)")
        if cfg.parallel.pp > 1:
            raise ConfigError(f"parallel.pp={cfg.parallel.pp}: a {kind} model's balancing loss needs the router "
                              "logits of every layer in one forward, which pipeline stages split; set parallel.pp=1")
        n = int(self.hf_config().num_experts)
        if ep > 1 and n % ep:
            raise ConfigError(f"parallel.ep={ep} does not divide the model's {n} experts (model.hf_config="
                              f"{self.mcfg.hf_config!r}); use a divisor of {n}")
        for name in ("cp",):
            if getattr(cfg.parallel, name) > 1:
                raise ConfigError(f"parallel.{name}={getattr(cfg.parallel, name)} is not supported with a {kind} model "
                                  f"(Mixture of Experts); set parallel.{name}=1 and use data or expert parallelism "
                                  "(parallel.ep)")

    def build_stage(self, cfg: RunConfig, stage: int, n_stages: int, device: torch.device) -> Stage:
        built = super().build_stage(cfg, stage, n_stages, device)
        if self.moe_family():
            count_load(built.module)  # the step log's tokens per expert and imbalance
        return built

    def planning_model(self, seq_len: int) -> ModelConfig:
        """A mapped MoE is planned as the built-in MoE of its sizes (experts of its expert width, top k, its
        sparse step; a shared expert of Qwen2-MoE counted as whole experts of that width)."""
        base = super().planning_model(seq_len)
        if not self.moe_family():
            return base
        hf = self.hf_config()
        width = int(getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size)
        shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
        return dataclasses.replace(base, n_experts=int(hf.num_experts), top_k=int(hf.num_experts_per_tok),
                                   moe_every=int(getattr(hf, "decoder_sparse_step", 1) or 1), ffn_hidden=width,
                                   n_shared_experts=-(-shared // width), aux_loss_coef=float(hf.router_aux_loss_coef))

    def expert_layers(self, module: nn.Module) -> list:
        """The sparse blocks of a mapped transformers MoE, for expert parallelism (:mod:`.hf_moe`)."""
        return [ExpertLayer(b) for b in sparse_blocks(module)] if self.moe_family() else []

    def apply_cp(self, module: nn.Module, cp) -> None:
        """Every attention layer over the cp group (:mod:`.hf_cp`); position ids the global ones."""
        route_attention(module, cp)

    def hf_config(self):
        """The model's transformers config (read once)."""
        if self._hf is None:
            self._hf = load_hf_config(self.mcfg)
        return self._hf

    def construct(self) -> nn.Module:
        hf = load_hf_config(self.mcfg)  # first: it checks that transformers is installed
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds for values it cannot build
            raise ConfigError(f"model.hf_config={self.mcfg.hf_config!r} does not build a model "
                              f"({type(e).__name__}: {str(e)[:200]}); fix the config") from None
        if moe_family(hf):  # its sparse blocks replicated across tp (.hf_moe): the plan of the rest
            model._tp_plan = dense_tp_plan(getattr(model, "_tp_plan", None))
        return model

    def own_config(self, model: nn.Module) -> object:
        return model.config

    def planner_tp_plan(self, model: nn.Module) -> dict | None:
        return getattr(model, "_tp_plan", None)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config().vocab_size)

    def vocab_field(self, have: int) -> tuple[str, str]:
        return (f"the vocab_size of model.hf_config={self.mcfg.hf_config!r}",
                f"use a model config with vocab_size >= {have}, or another data.tokenizer")

    def forward_fn(self) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
        return moe_forward if self.moe_family() else hf_forward

    def aux_loss_fn(self) -> Callable[[nn.Module], torch.Tensor | None] | None:
        return router_aux_loss if self.moe_family() else None

    def inference_model(self, state: dict[str, torch.Tensor]) -> tuple[nn.Module, int]:
        from transformers import AutoModelForCausalLM

        hf = load_hf_config(self.mcfg)
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
        load_tied(model, state)
        return model, hf_max_positions(hf) or 1 << 30

    def hf_names(self) -> OwnNames:
        return OwnNames(self.mcfg)


def load_tied(model: nn.Module, state: dict) -> None:
    """load_state_dict, allowing the keys a tied output embedding leaves out of the checkpoint."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if getattr(model.config, "tie_word_embeddings", False) and k.startswith("lm_head")}
    if unexpected or set(missing) - tied:
        raise ConfigError(f"the checkpoint does not match its model: missing {sorted(set(missing) - tied)[:5]}, "
                          f"unexpected {sorted(unexpected)[:5]}")
    if tied:
        model.tie_weights()


class OwnNames:
    """:class:`~trainer.models.spec.HFNames` of a transformers model: its own names, its own config.json."""

    renames = False

    def __init__(self, mcfg: ModelConfig):
        self.mcfg = mcfg

    def hf_name(self, fqn: str) -> str:
        return fqn

    def holds_hf_names(self, names: Iterable[str]) -> bool:
        return False  # nothing to map back

    def to_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        return t

    def from_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        return t

    def config_json(self, tokenizer: str) -> dict:
        """The run's own config.json (with ``etrain_tokenizer``, unless it says one)."""
        from .hf_dir import read_config

        mcfg = self.mcfg
        path = os.path.expanduser(mcfg.hf_config)
        if not os.path.exists(os.path.join(path, "config.json") if os.path.isdir(path) else path):
            raise ConfigError(f"the run's model.hf_config={mcfg.hf_config!r} is not on this machine; export where it "
                              "is, or use --format safetensors")
        config = read_config(path, f"the run's model.hf_config={mcfg.hf_config!r}")
        config.setdefault("etrain_tokenizer", tokenizer)
        return config
