"""What every model family answers: the interface the rest of the trainer asks instead of ``model.source``.

    spec = spec_for(cfg.model)                       # trainer.models: the family of [model] source
    stage = spec.build_stage(cfg, s, n_stages, dev)  # one pipeline stage, its blocks (FSDP/AC units)
    spec.apply_tp(stage.module, tp_mesh, cfg.parallel)
    spec.shape().flops_per_token(seq_len)            # sizes and counts (trainer.models.shape)
    names = spec.hf_names()                          # to and from Hugging Face names, or None

A family implements the abstract methods; the others have defaults that fit a model a user brings.
The order in which :func:`trainer.parallel.parallelize.build_model_parts` calls them is fixed there: build and
cut a stage, tensor parallelism, activation checkpointing, FSDP on the blocks, allocate and fill
the weights, the compute dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..config import ModelConfig, ParallelConfig, RunConfig
    from .shape import ModelShape


@dataclass
class Stage:
    """One pipeline stage of a model as built (the whole model when there is no pipeline)."""

    module: nn.Module
    blocks: list[nn.Module]  # the repeated blocks it keeps, in order: the unit of FSDP and of checkpointing
    params_on_meta: bool = False  # its parameters not allocated yet (:meth:`ModelSpec.materialize` does it)


@dataclass
class ModelInfo:
    """What the preflight learned about a model a user brings (printed at start, used in checks)."""

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


class HFNames(Protocol):
    """A family's mapping to a ``transformers`` model: names, tensor layouts and config.json."""

    renames: bool  # whether any name or layout differs (False: the model's own names are transformers')

    def hf_name(self, fqn: str) -> str: ...

    def holds_hf_names(self, names: Iterable[str]) -> bool:
        """Whether weights with these names are in the transformers layout (to be mapped back)."""
        ...

    def to_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor: ...

    def from_hf(self, fqn: str, t: torch.Tensor) -> torch.Tensor: ...

    def config_json(self, tokenizer: str) -> dict:
        """config.json of the export; ``tokenizer``: "bytes" or "files" (``etrain_tokenizer``)."""
        ...

    # Where several tensors map to one transformers name (hf_name), a family also has
    # merged_shape(name, {fqn: shape}) -> shape and merge(name, {fqn: tensor in the HF layout}) -> tensor.
    # Where the transformers model has tensors the model lacks, added() -> {name: shape}: exported as zeros.


def dtensor_like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor of ``template``'s mesh, placements, global shape and stride (as it is when
    ``template`` is a plain tensor): a new tensor like a parameter made from a local one, without DTensor's
    sharding propagation, which a re-formed group redoes per shape (1-2 ms each on CPU)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def to_empty(module: nn.Module, device: str | torch.device) -> None:
    """``module.to_empty(device=device)``, each DTensor made from an empty local tensor (:func:`dtensor_like`),
    inside every re-formation's build of the model. The same tensors, the same module hooks (FSDP2's
    ``_apply``, through which ``to_empty`` goes too, re-registers its shards)."""
    import torch
    from torch.distributed.tensor import DTensor

    module._apply(lambda t: dtensor_like(t, torch.empty_like(t._local_tensor if isinstance(t, DTensor) else t,
                                                             device=device)))


def fill_local(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the whole tensor ``full`` into ``p``: a plain tensor of the same shape, or a
    DTensor of that global shape (TP, FSDP, both), whose local block is located as DCP locates it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        p.copy_(full)
        return
    local = p.to_local()
    chunks = p.__create_chunk_list__()
    if not chunks or not local.numel():
        return
    if len(chunks) != 1:
        raise ValueError(f"a local shard of {len(chunks)} blocks cannot be filled from a whole tensor")
    block = full
    for dim, (off, size) in enumerate(zip(chunks[0].offsets, chunks[0].sizes)):
        block = block.narrow(dim, off, size)
    local.copy_(block.reshape(local.shape))


def zero_parameters(module: nn.Module) -> None:
    """Every parameter's local part (a DTensor's own shard) set to zero: weights that are loaded (or drawn)
    over next, allocated uninitialized (``to_empty``)."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in module.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).zero_()


class ModelSpec(ABC):
    """A model family: built from the ``[model]`` section, asked by everything that needs the model."""

    family: ClassVar[str]  # the value of model.source
    cached: ClassVar[bool] = False  # whether trainer.models.spec_for keeps one per config (costly to answer)
    # whether building it imports and runs code its config names (a factory): a config read back from a
    # checkpoint is data, so such a model is built from one only when the user says so (etrain generate)
    runs_code: ClassVar[bool] = False

    def __init__(self, mcfg: ModelConfig):
        self.mcfg = mcfg

    # --- what the model is -------------------------------------------------------------------

    @abstractmethod
    def shape(self) -> ModelShape:
        """Sizes and counts (:class:`~trainer.models.shape.ModelShape`)."""

    def flops_per_token(self, seq_len: int) -> float:
        return self.shape().flops_per_token(seq_len)

    @property
    def vocab_size(self) -> int:
        return self.mcfg.vocab_size

    def vocab_field(self, have: int) -> tuple[str, str]:
        """(what sets the vocabulary, the fix when ``have`` ids do not fit), for an error message."""
        return f"model.vocab_size={self.mcfg.vocab_size}", f"set model.vocab_size >= {have}"

    @property
    def draws_random(self) -> bool:
        """Whether the forward pass may draw random numbers (dropout): the step loop seeds it per sample."""
        return True

    @property
    def compile_fullgraph(self) -> bool:
        """Whether one block compiles to a single graph (``parallel.compile``: ``fullgraph=True``); a model a
        user brings may break the graph (data-dependent branches, hooks), and then runs the breaks eagerly."""
        return False

    def allows(self) -> tuple[str, ...]:
        """What layouts the model can take: "tp", "pp", "sp", "cp" (the planner offers nothing else; "cp": its
        attention can be routed through context parallelism, :meth:`apply_cp`)."""
        return ("tp", "pp", "sp")

    def planning_model(self, seq_len: int) -> ModelConfig:
        """The ``[model]`` the planner accounts with: this one, or a built-in decoder of the same shape."""
        return self.mcfg

    def preflight(self, cfg: RunConfig) -> ModelInfo | None:
        """Before any process group: ConfigError (exit 2) for what cannot train; what was learned, if anything."""
        from .documents import check_document_run

        check_document_run(cfg, self.document_mask_refusal)
        return None

    def document_mask_refusal(self, seq_len: int) -> str | None:
        """Why the model cannot keep attention inside each document of a packed sample (``model.document_mask``,
        :meth:`apply_document_mask`) at ``seq_len``; None when it can."""
        return f"model.source={self.family!r} takes no attention mask from etrain"

    # --- building and parallelizing --------------------------------------------------------------

    @abstractmethod
    def build(self, device: str | torch.device = "meta", seed: int = 0) -> nn.Module:
        """The whole model on ``device`` (meta: no memory); off meta its weights are drawn from ``seed``."""

    @abstractmethod
    def build_stage(self, cfg: RunConfig, stage: int, n_stages: int, device: torch.device) -> Stage:
        """Pipeline stage ``stage`` of ``n_stages`` (1: the whole model), keeping parameter names (FQNs)."""

    @abstractmethod
    def apply_tp(self, module: nn.Module, tp_mesh, pcfg: ParallelConfig) -> None:
        """Tensor parallelism from the family's plan, in place."""

    def apply_cp(self, module: nn.Module, cp) -> None:
        """Route the stage's attention through context parallelism (``cp``: a
        :class:`trainer.parallel.context.ContextParallel`); only for families that allow "cp"."""
        from checkpointing.errors import ConfigError

        raise ConfigError(f"parallel.cp > 1 needs a model whose attention etrain can route; model.source="
                          f"{self.family!r} has none: set parallel.cp=1")

    def apply_document_mask(self, module: nn.Module, eos_id: int) -> None:
        """Keep the stage's attention inside each document of a packed sample, whose documents end with token
        ``eos_id`` (:mod:`trainer.models.documents`); only for families whose :meth:`document_mask_refusal` is
        None."""
        from checkpointing.errors import ConfigError

        raise ConfigError(f"model.document_mask=true: model.source={self.family!r} has no way to hand its model the "
                          "mask (its spec defines no apply_document_mask); set model.document_mask=false")

    @abstractmethod
    def apply_ac(self, stage: Stage, mode: str, every_k: int) -> None:
        """Activation checkpointing of the stage's blocks ("full", "every_k" or "selective")."""

    @abstractmethod
    def materialize(self, stage: Stage, device: str | torch.device, seed: int, draw: bool = True) -> None:
        """Allocate what is still on the meta device (this rank's shards only) on ``device``, and fill it.
        ``draw=False``: the weights this model would draw stay zero, for a checkpoint's to be loaded over
        them (a group that re-forms to restore), or for :meth:`initial_weight` to draw them later."""

    @property
    def draws_weights(self) -> bool:
        """Whether ``materialize`` draws initial weights (so that ``draw=False`` leaves some undrawn); a model
        a user brings draws none here (its weights come from ``model.init_from``, or were built whole)."""
        return False

    def initial_weight(self, fqn: str, shape: tuple[int, ...], seed: int) -> torch.Tensor | None:
        """The whole initial value of parameter ``fqn`` that ``materialize(draw=False)`` left undrawn (where
        :attr:`draws_weights`); None for a parameter the model does not draw."""
        return None

    @abstractmethod
    def cast(self, module: nn.Module, dtype: torch.dtype) -> None:
        """Parameters to the compute dtype (ZeRO 0-2; FSDP casts itself)."""

    def local_params(self, module: nn.Module) -> int:
        """Parameters a stage holds after TP, before ZeRO, for the memory prediction; 0: from the shape."""
        return 0

    def forward_fn(self) -> Callable[[nn.Module, torch.Tensor], torch.Tensor] | None:
        """How to get logits from token ids; None: call the module."""
        return None

    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The training loss of (logits, targets); None: the language-model loss."""
        return None

    def aux_loss_fn(self) -> Callable[[nn.Module], torch.Tensor | None] | None:
        """A Mixture of Experts of the model's own: its weighted balancing loss after a forward (added to the
        loss); None: the built-in MoE layers' (trainer.models.moe), if any."""
        return None

    def expert_layers(self, module: nn.Module) -> list:
        """The Mixture-of-Experts layers expert parallelism splits (trainer.parallel.expert: each has ``experts``,
        ``n_experts`` and a settable ``ep``); the MoE layers of trainer.models.moe by default."""
        from .moe import moe_layers

        return moe_layers(module)

    def logits(self, module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        fn = self.forward_fn()
        return fn(module, tokens) if fn is not None else module(tokens)

    # --- weights in and out ----------------------------------------------------------------------

    @abstractmethod
    def inference_model(self, state: dict[str, torch.Tensor]) -> tuple[nn.Module, int]:
        """The whole model on the host holding ``state`` (full tensors by FQN), and the longest input it takes."""

    def hf_names(self) -> HFNames | None:
        """The mapping to a ``transformers`` model; None when there is none."""
        return None

    def hf_config_json(self, tokenizer: str) -> dict:
        """config.json of a transformers export (``tokenizer``: "bytes" or "files"); ConfigError when there is none."""
        names = self.hf_names()
        if names is None:
            from checkpointing.errors import ConfigError

            raise ConfigError(f"--format hf needs a model with a transformers config; model.source={self.family!r} "
                              "has none: use --format safetensors or torch")
        return names.config_json(tokenizer)
