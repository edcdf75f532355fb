"""The model as the planner sees it: a built-in-equivalent shape and its parameters counted.

    shape = model_shape(cfg)       # shape.model: a ModelConfig; shape.n_params counted on the meta device

The model's spec answers (:mod:`trainer.models`): the built-in presets are counted from their
config; a ``transformers`` or Python-factory model is built on the meta device (no memory, no
weights), its parameters counted and its blocks found as training finds them; the planner then
works with a built-in decoder of the same width, depth, heads and vocabulary whose feed-forward
width is chosen so that one block holds as many parameters as the model's block does
(:meth:`~trainer.models.spec.ModelSpec.planning_model`). Every formula of :mod:`trainer.observe.device_memory`
then applies unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ModelConfig, RunConfig
from ..models import spec_for


@dataclass(frozen=True)
class Shape:
    model: ModelConfig  # the built-in equivalent (source "builtin")
    n_params: int  # the model's own count (meta device for hf/python)
    block_params: int  # one repeated block's parameters, as counted
    how: str  # "config" or "meta device"
    name: str
    allows: tuple[str, ...] = ("tp", "pp", "sp")  # what the model's preflight lets it use


def planning_config(cfg: RunConfig, shape: Shape | None = None) -> RunConfig:
    """``cfg`` with the built-in-equivalent model, remembering what the real model allows
    (``plan_allows``: the search offers tp, pp and sp only where the model takes them)."""
    shape = shape or model_shape(cfg)
    out = cfg if shape.model is cfg.model else dataclasses.replace(cfg, model=shape.model)
    out.plan_allows = shape.allows
    return out


def model_shape(cfg: RunConfig) -> Shape:
    """The planner's view of ``cfg``'s model (see the module docstring); ConfigError when it cannot be built."""
    spec = spec_for(cfg.model)
    s = spec.shape()
    return Shape(spec.planning_model(cfg.data.seq_len), s.n_params, s.one_block_params, s.counted, s.name,
                 spec.allows())


# Public shapes for the worked examples and tests (Llama 3 model card / config.json: dim, layers, heads, kv heads,
# ffn, vocabulary). Built-in decoders of these sizes count 8.03e9 and 70.55e9 parameters, as Meta states.
LLAMA3 = {
    "8b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336, "vocab_size": 128256,
           "max_seq_len": 8192},
    "70b": {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_hidden": 28672, "vocab_size": 128256,
            "max_seq_len": 8192},
    "7b2": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "ffn_hidden": 11008, "vocab_size": 32000,
            "max_seq_len": 4096},  # Llama 2 7B
}
