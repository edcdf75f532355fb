"""The model-spec seam (trainer.models): every family answers the same questions, and the answers are right.

Pure logic on the meta device (no process group): FLOPs per token (MFU) against counts made here by
hand from each model's config, parameter counts against the model built, the registry. The numerics of
training under every layout are tests/trainer/test_parity.py's and tests/trainer/test_models.py's.
"""

from __future__ import annotations

import json

import pytest
import torch

from checkpointing.errors import ConfigError
from tests.trainer.test_models import LLAMA
from trainer.config.load import load_config
from trainer.models.decoder.spec import DecoderSpec
from trainer.observe.telemetry import flops_per_token, mfu

SEQ = 48


def hf_cfg(tmp_path, doc: dict, *extra: str):
    (tmp_path / "config.json").write_text(json.dumps(doc))
    return load_config(None, ['model.source="hf"', f'model.hf_config="{tmp_path}"', f"data.seq_len={SEQ}", *extra])


def test_mfu_of_a_transformers_model_counts_its_own_flops(tmp_path, monkeypatch):
    """Before: flops_per_token used the built-in model's default sizes (dim 128, 4 layers, vocabulary 256)
    for any model, so the MFU of a transformers model was that of another model."""
    cfg = hf_cfg(tmp_path, {**LLAMA, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
                            "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 320})
    d, f, n_layers, h, kv, vocab = 96, 160, 3, 6, 2, 320
    hd = d // h
    per_block = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f  # q, k and v, o; gate, up, down
    weights = n_layers * per_block + 2 * vocab * d  # the embedding and the untied head
    expected = 6 * weights + 12 * n_layers * d * SEQ  # 6N plus the attention scores and their use
    assert flops_per_token(cfg) == expected
    monkeypatch.setenv("ETRAIN_PEAK_FLOPS", "1e12")
    assert mfu(cfg, torch.device("cpu"), 1000.0, 2) == pytest.approx(1000.0 * expected / 2e12)



def test_the_peak_of_a_card_is_its_own_not_its_sxm_namesakes():
    from trainer.observe.telemetry import peak_for_name

    assert peak_for_name("NVIDIA H100 80GB HBM3") == peak_for_name("NVIDIA H200") == 989e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12 and peak_for_name("NVIDIA H100 NVL") == 835e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB") == 312e12 and peak_for_name("Tesla T4") is None

def test_a_factory_model_counts_its_own_flops():
    cfg = load_config(None, ['model.source="python"', 'model.factory="tests.custom_model:build"', "model.vocab_size=300",
                             "model.args.width=40", "model.args.hidden=72", "model.args.depth=5", f"data.seq_len={SEQ}"])
    vocab, w, hidden, depth = 300, 40, 72, 5
    weights = 2 * vocab * w + depth * 2 * w * hidden  # embedding, head; each block's up and down (not norms, biases)
    assert flops_per_token(cfg) == 6 * weights + 12 * depth * w * SEQ


def test_the_builtin_flops_are_the_formula_they_always_were():
    cfg = load_config(None, ['model.preset="small"', f"data.seq_len={SEQ}"])
    m = cfg.model
    hd = m.dim // m.n_heads
    block = m.dim * m.n_heads * hd * 2 + m.dim * m.n_kv_heads * hd * 2 + 3 * m.dim * m.ffn_hidden
    assert flops_per_token(cfg) == 6.0 * (m.n_layers * block + 2 * m.vocab_size * m.dim) + 12.0 * m.n_layers * m.dim * SEQ


@pytest.mark.parametrize("preset", ["tiny", "small", "1b"])
def test_the_builtin_shape_counts_what_the_model_holds(preset):
    from trainer.models import spec_for

    cfg = load_config(None, [f'model.preset="{preset}"', "model.n_kv_heads=2", "data.seq_len=64"])
    spec = spec_for(cfg.model)
    model = spec.build("meta")
    shape = spec.shape()
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert shape.weight_params == sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert shape.one_block_params == sum(p.numel() for p in model.layers["0"].parameters())
    # A pipeline of 3 stages without TP holds every parameter once.
    held = sum(shape.local_counts(1, [s], 3)[1] for s in range(3))
    assert held == shape.n_params


def test_every_family_is_a_whole_spec(tmp_path):
    """Each registered family implements every method of the interface (none left abstract) and is the one
    spec_for gives for its source; a model a user brings is counted once per config."""
    from trainer.models import FAMILIES, ModelSpec, family, spec_for

    for source in FAMILIES:
        cls = family(source)
        assert issubclass(cls, ModelSpec) and cls.family == source and not cls.__abstractmethods__
    cfg = hf_cfg(tmp_path, LLAMA)
    assert spec_for(cfg.model) is spec_for(cfg.model)  # cached: MFU asks every step
    assert spec_for(cfg.model).vocab_size == LLAMA["vocab_size"]
    assert spec_for(cfg.model).hf_names().renames is False  # its own names are transformers'
    builtin = load_config(None, []).model
    assert spec_for(builtin).hf_names().hf_name("layers.1.attention.wq.weight") == \
        "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="model.source='moe' is no model family"):
        family("moe")


def test_a_new_family_is_registered_by_its_source():
    """What a Mixture-of-Experts decoder will do: register its spec; everything asks it from then on."""
    from trainer.models import FAMILIES, register_family, spec_for
    from trainer.models.decoder.spec import DecoderSpec

    class Wider(DecoderSpec):
        family = "builtin"

        def flops_per_token(self, seq_len: int) -> float:
            return 2 * super().flops_per_token(seq_len)

    cfg = load_config(None, [f"data.seq_len={SEQ}"])
    before = flops_per_token(cfg)
    saved = FAMILIES["builtin"]
    register_family("builtin", Wider)
    try:
        assert isinstance(spec_for(cfg.model), Wider) and flops_per_token(cfg) == 2 * before
    finally:
        register_family("builtin", saved)
    assert flops_per_token(cfg) == before


class OutsideSpec(DecoderSpec):
    """A family defined outside trainer/ (the built-in decoder under another name)."""

    family = "outside"


def test_a_family_registered_from_outside_is_a_source_the_config_takes():
    """model.source is a registered name, not a fixed list: a family registered ("pkg.mod:Class") before the
    config is loaded is accepted and spec_for gives its spec; an unknown name is refused (exit 2) naming the
    field and the families known, the registered one among them."""
    from trainer.models import FAMILIES, register_family, spec_for

    with pytest.raises(ConfigError, match=r"model.source='outside' is no model family; use one of 'builtin', "
                                          r"'hf', 'python' \(trainer.models.register_family adds one\)"):
        load_config(None, ['model.source="outside"'])
    register_family("outside", "tests.trainer.test_model_spec:OutsideSpec")
    try:
        cfg = load_config(None, ['model.source="outside"', f"data.seq_len={SEQ}"])
        spec = spec_for(cfg.model)
        assert type(spec).__name__ == "OutsideSpec" and spec.family == "outside" and spec.mcfg is cfg.model
        assert flops_per_token(cfg) == flops_per_token(load_config(None, [f"data.seq_len={SEQ}"]))
        with pytest.raises(ConfigError, match="model.source='moe' is no model family; use one of 'builtin', "
                                              "'hf', 'python', 'outside'"):
            load_config(None, ['model.source="moe"'])
    finally:
        FAMILIES.pop("outside")
    with pytest.raises(ConfigError, match="model.source='outside' is no model family"):
        load_config(None, ['model.source="outside"'])


def test_a_factory_that_cannot_build_on_meta_is_named(tmp_path):
    from trainer.models import spec_for

    cfg = load_config(None, ['model.source="python"', 'model.factory="tests.custom_model:not_a_module"'])
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        spec_for(cfg.model).shape()
