"""Config loading and validation: every mistake names the field and the fix."""

import pytest

from checkpointing.errors import ConfigError
from trainer.config import MODEL_PRESETS
from trainer.config.load import load_config
from trainer.models.decoder.model import Transformer, count_params
from trainer.parallel.dims import ParallelDims, valid_world_sizes


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('run_id = "x"\n[model]\npreset = "small"\n[parallel]\ntp = 2\n')
    cfg = load_config(str(p), ["parallel.tp=4", "train.lr=1e-3", 'data.source="file:///data/*.txt"'])
    assert cfg.run_id == "x"
    assert cfg.model.dim == MODEL_PRESETS["small"]["dim"]
    assert cfg.parallel.tp == 4 and cfg.train.lr == 1e-3
    assert cfg.data.source == "file:///data/*.txt"


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tpp=2"], "unknown key parallel.tpp; did you mean 'tp'"),
    (["trian.lr=1"], "unknown section or key 'trian'; did you mean 'train'"),
    (['parallel.tp="two"'], "parallel.tp must be an integer"),
    (["train.lr=true"], "train.lr must be a number"),
    (["parallel.tp=3"], "parallel.tp=3 does not divide model.n_heads=4; use 1, 2 or 4"),
    (["model.preset=\"huge\""], "model.preset='huge' is unknown"),
    (["parallel.zero_stage=4"], "parallel.zero_stage=4 must be 0, 1, 2 or 3"),
    (["parallel.pp=8"], "exceed model.n_layers=4"),
    (["train.global_batch=10", "train.micro_batch=4"], "train.micro_batch=4 does not divide train.global_batch=10"),
    (['parallel.pp_schedule="zigzag"'], "parallel.pp_schedule='zigzag' is not allowed"),
    (['parallel.offload="cpu"', "parallel.zero_stage=2"], 'parallel.offload="cpu" needs parallel.zero_stage=3'),
    (["data.seq_len=1000"], "data.seq_len=1000 exceeds model.max_seq_len=256"),
    (["checkpoint.interval_steps=10"], "checkpoint.interval_steps=10 needs checkpoint.url"),
    (["parallel.tp"], "must look like section.field=value"),
    (["metrics.port=70000"], "metrics.port=70000 must be 0 (a free port) or a port number up to 65535"),
    (["metrics.every_s=0"], "metrics.every_s=0.0 must be > 0"),
    (["metrics.enable=false"], "unknown key metrics.enable; did you mean 'enabled'"),
])
def test_bad_config_names_field_and_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.tp=2"], 3, "world size 3 is not a multiple of"),
    (["train.global_batch=8", "train.micro_batch=4"], 4, "data-parallel sizes that work: 1, 2"),
    (["parallel.dp_shard=3"], 4, "set parallel.dp_shard=-1"),
    (["parallel.pp=2", "train.global_batch=4", "train.micro_batch=4"], 2, "needs at least pp=2 micro-batches"),
])
def test_layout_checked_against_world_before_any_process_group(overrides, world, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        ParallelDims.from_config(cfg, world)
    assert message in str(e.value)


def test_dims_coords_and_valid_world_sizes():
    cfg = load_config(None, ["parallel.tp=2", "parallel.dp_replicate=1", "train.global_batch=8", "train.micro_batch=2"])
    dims = ParallelDims.from_config(cfg, 8)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (1, 1, 4, 2)
    assert dims.coords(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 2, "tp": 1}
    assert dims.dp_rank(5) == 2
    assert valid_world_sizes(cfg, 16) == [2, 4, 8]


def test_config_hash_ignores_layout():
    a = load_config(None, ["parallel.tp=2"])
    b = load_config(None, ["parallel.zero_stage=1"])
    c = load_config(None, ["train.lr=1e-4"])
    assert a.config_hash() == b.config_hash() != c.config_hash()


@pytest.mark.parametrize("preset, low, high", [("tiny", 0.5e6, 5e6), ("small", 20e6, 30e6),
                                               ("125m", 110e6, 140e6), ("1b", 0.9e9, 1.2e9)])
def test_presets_have_their_sizes(preset, low, high):
    cfg = load_config(None, [f'model.preset="{preset}"', "data.seq_len=64"]).model
    assert low <= count_params(cfg) <= high
    if preset in ("tiny", "small"):
        import torch
        with torch.device("meta"):
            m = Transformer(cfg)
        assert sum(p.numel() for p in m.parameters()) == count_params(cfg)
