"""Model families: the built-in decoder, ``transformers`` models, Python factories; one spec each.

    spec = spec_for(cfg.model)              # the ModelSpec of [model] source
    spec.shape().n_params                   # sizes and counts, FLOPs per token (trainer.models.shape)
    info = model_preflight(cfg)             # exit 2 before any process group for what cannot train

Everything outside this package asks the spec (:class:`~trainer.models.spec.ModelSpec`) and never
which source a model came from. A family is registered by its ``model.source`` value and the
``package.module:Class`` of its spec, imported when first asked for (this module imports no torch). The
registry, ``FAMILIES``, is the config's ``MODEL_FAMILIES`` (trainer/config/model.py), so that a ``[model]``
section can check its source against it without importing any model code: register a family before the
config naming it is loaded.

    builtin   .decoder.spec:DecoderSpec   the Llama-style decoder (.decoder.model), its TP plan (.decoder.tp),
                                          its transformers names (.names)
    hf        .hf.spec:HFSpec             AutoModelForCausalLM.from_config of a local config.json
    python    .factory:FactorySpec        factory(model table) -> nn.Module
    (yours)   register_family("myfam", "pkg.mod:MySpec"), then model.source = "myfam"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.model import MODEL_FAMILIES
from .refs import resolve_ref
from .spec import ModelInfo, ModelSpec

if TYPE_CHECKING:
    from ..config import ModelConfig, RunConfig

__all__ = ["FAMILIES", "ModelInfo", "ModelSpec", "model_preflight", "register_family", "resolve_ref", "spec_for"]

# model.source -> "package.module:Class" of its spec (or the class itself): the config's registry itself.
FAMILIES: dict[str, str | type[ModelSpec]] = MODEL_FAMILIES
_CACHE: dict[tuple[str, str], ModelSpec] = {}
_CACHE_SIZE = 16


def register_family(source: str, spec: str | type[ModelSpec]) -> None:
    """Register (or replace) the spec of ``model.source = source``: from then on a ``[model]`` section may
    name it (register it before loading the config, in every process that loads one)."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"a model family is registered by its model.source name, a non-empty string; got {source!r}")
    FAMILIES[source] = spec
    for key in [k for k in _CACHE if k[0] == source]:
        del _CACHE[key]


def family(source: str) -> type[ModelSpec]:
    """The spec class of ``model.source``; ValueError naming the known ones."""
    entry = FAMILIES.get(source)
    if entry is None:
        raise ValueError(f"model.source={source!r} is no model family; known: {', '.join(FAMILIES)}")
    if isinstance(entry, str):
        entry = FAMILIES[source] = resolve_ref(entry, f"the model family of model.source={source!r}")
    return entry


def spec_for(mcfg: ModelConfig) -> ModelSpec:
    """The spec of a ``[model]`` section. A family whose answers are costly (it builds the model to count it)
    is kept, one per distinct section, so asking again (MFU every step, the planner's search) is cheap."""
    cls = family(mcfg.source)
    if not cls.cached:
        return cls(mcfg)
    key = (mcfg.source, repr(mcfg))
    spec = _CACHE.get(key)
    if spec is None:
        if len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        spec = _CACHE[key] = cls(mcfg)
    return spec


def model_preflight(cfg: RunConfig) -> ModelInfo | None:
    """The model's checks against the run before any process group starts (ConfigError, exit 2); what a
    model a user brings turned out to be (None for the built-in one: its config checks itself)."""
    spec = spec_for(cfg.model)
    info = spec.preflight(cfg)
    if cfg.parallel.cp > 1 and "cp" not in spec.allows():
        from checkpointing.errors import ConfigError

        raise ConfigError(f"parallel.cp={cfg.parallel.cp} splits sequences across ranks, and model.source="
                          f"{cfg.model.source!r} has attention etrain cannot route through context parallelism "
                          '(the built-in decoder, model.source="builtin", has); set parallel.cp=1')
    return info
