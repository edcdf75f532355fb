"""The model as the planner sees it: a built-in-equivalent shape and its parameters counted.

    shape = model_shape(cfg)       # shape.model: a ModelConfig; shape.n_params counted on the meta device

The built-in presets are counted from their config (:func:`trainer.model.count_params`). A
``transformers`` or Python-factory model is built on the meta device (no memory, no weights) by
:func:`trainer.models.build_model`, its parameters counted and its blocks found as training finds
them; the planner then works with a built-in decoder of the same width, depth, heads and
vocabulary whose feed-forward width is chosen so that one block holds as many parameters as the
model's block does. Every formula of :mod:`trainer.memory` then applies unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from checkpointing.errors import ConfigError

from ..config import ModelConfig, RunConfig
from ..model import count_params


@dataclass(frozen=True)
class Shape:
    model: ModelConfig  # the built-in equivalent (source "builtin")
    n_params: int  # the model's own count (meta device for hf/python)
    block_params: int  # one repeated block's parameters, as counted
    how: str  # "config" or "meta device"
    name: str
    allows: tuple[str, ...] = ("tp", "pp", "sp")  # what trainer.models.inspect_model lets this model use


def planning_config(cfg: RunConfig, shape: Shape | None = None) -> RunConfig:
    """``cfg`` with the built-in-equivalent model, remembering what the real model allows
    (``plan_allows``: the search offers tp, pp and sp only where the model source takes them)."""
    shape = shape or model_shape(cfg)
    out = cfg if cfg.model.source == "builtin" else dataclasses.replace(cfg, model=shape.model)
    out.plan_allows = shape.allows
    return out


def _hf_dims(hf) -> dict:
    def get(*names: str) -> int | None:
        return next((int(getattr(hf, n)) for n in names if isinstance(getattr(hf, n, None), int)), None)

    return {"dim": get("hidden_size", "n_embd", "d_model"), "n_heads": get("num_attention_heads", "n_head"),
            "n_kv_heads": get("num_key_value_heads", "num_attention_heads", "n_head"),
            "ffn_hidden": get("intermediate_size", "n_inner"), "vocab_size": get("vocab_size")}


def model_shape(cfg: RunConfig) -> Shape:
    """The planner's view of ``cfg``'s model (see the module docstring); ConfigError when it cannot be built."""
    m = cfg.model
    if m.source == "builtin":
        block = count_params(dataclasses.replace(m, n_layers=2)) - count_params(dataclasses.replace(m, n_layers=1))
        return Shape(m, count_params(m), block, "config", f"built-in decoder (dim {m.dim}, {m.n_layers} layers)")
    import torch

    from ..models import HF_STYLES, build_model, find_blocks, llama_like, model_vocab_size

    try:
        model = build_model(cfg, device="meta")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a factory that cannot run on the meta device
        raise ConfigError(f"model.factory={m.factory!r} cannot build on the meta device ({type(e).__name__}: {e}); "
                          "etrain plan counts models there: make the factory create its tensors on the current "
                          "default device") from None
    blocks = find_blocks(model, m)
    n_params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in blocks[0][1].parameters())
    dims = _hf_dims(model.config) if m.source == "hf" else {}
    embed = next((mod for mod in model.modules() if isinstance(mod, torch.nn.Embedding)), None)
    dim = dims.get("dim") or (embed.embedding_dim if embed is not None else m.dim)
    heads = dims.get("n_heads") or m.n_heads
    kv = dims.get("n_kv_heads") or m.n_kv_heads
    vocab = model_vocab_size(cfg)
    if dim % heads or heads % kv or (dim // heads) % 2:
        heads = kv = next((h for h in (32, 16, 8, 4, 2, 1) if dim % h == 0 and (dim // h) % 2 == 0), 1)
    attn = 2 * dim * dim + 2 * dim * (dim // heads) * kv
    ffn = max(1, round((block - attn - 2 * dim) / (3 * dim)))
    equiv = dataclasses.replace(m, source="builtin", hf_config="", factory="", loss="", tp_plan="", dim=dim,
                                n_layers=len(blocks), n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn, vocab_size=vocab,
                                max_seq_len=max(m.max_seq_len, cfg.data.seq_len), init_from="")
    name = type(model).__name__
    # What training accepts of this model (trainer.models' _check_hf_plan and _check_pipeline): tied embeddings
    # refuse both; the HF plan's styles must be ones etrain maps; stages are cut from Llama-like decoders only.
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    hf_plan = getattr(model, "_tp_plan", None) if m.source == "hf" else None
    tp_ok = bool(m.tp_plan) or (bool(hf_plan) and not tied and all(v in HF_STYLES for v in hf_plan.values()))
    pp_ok = llama_like(model) and not tied and not m.loss
    allows = (("tp",) if tp_ok else ()) + (("pp",) if pp_ok else ())  # SP: the built-in model only
    return Shape(equiv, n_params, block, "meta device", f"{m.source} model {name}", allows)


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
