"""Config bounds (docs/operations.md#bounds), the valid sizes in O(the batch's divisors), and refusals that name the
rule that refused: a size no layout rule allows is not blamed on the batch."""

import random
import time

import pytest

from checkpointing.errors import ConfigError
from orchestrator.config import ElasticConfig, check_sizes, elastic_from_raw
from trainer.config import divisors
from trainer.config.load import config_from_dict, load_config, load_raw
from trainer.parallel.dims import ParallelDims, config_dp_shard, fixed_degree, valid_dp_sizes, valid_world_sizes


def reference_world_sizes(cfg, max_world: int) -> list[int]:
    """The valid sizes as they were first computed: every multiple of the fixed degree up to ``max_world``."""
    p = cfg.parallel
    fixed = fixed_degree(p.dp_replicate, p.tp, p.pp, p.cp)
    out = []
    for world in range(fixed, max_world + 1, fixed):
        if config_dp_shard(p, world) != world // fixed:
            continue
        try:
            ParallelDims.from_config(cfg, world)
        except ConfigError:
            continue
        out.append(world)
    return out


def random_layout(rng: random.Random) -> list[str]:
    """Overrides of a small random layout; some of them refused at load, some allowing no size at all."""
    gb = rng.randint(1, 48)
    moe = rng.random() < 0.3
    sets = [f"train.global_batch={gb}", f"train.micro_batch={rng.choice(divisors(gb))}",
            f"parallel.tp={rng.choice([1, 1, 2, 4])}", f"parallel.pp={rng.choice([1, 1, 2, 3])}",
            f"parallel.cp={rng.choice([1, 1, 2, 3])}", f"parallel.dp_replicate={rng.choice([1, 1, 2, 3])}",
            f"parallel.dp_shard={rng.choice([-1, -1, -1, 1, 2, 4, 6])}",
            f"parallel.zero_stage={rng.choice([0, 1, 3])}",
            f'parallel.pp_schedule="{rng.choice(["1f1b", "gpipe"])}"',
            f"parallel.pp_microbatches={rng.choice([0, 0, 1, 2, 4])}",
            f"data.seq_len={rng.choice([64, 60, 48])}"]
    if moe:
        sets += ['model.preset="moe-tiny"', f"parallel.ep={rng.choice([0, 1, 2, 4, 8])}"]
    if rng.random() < 0.2:
        sets += [f"parallel.hpz_partition_size={rng.choice([2, 3, 4])}", "parallel.zero_stage=3"]
    if rng.random() < 0.2:
        sets += ['parallel.cp_style="ulysses"']
    return sets


def test_valid_world_sizes_equal_the_plain_loop_over_random_small_configs():
    rng = random.Random(20240611)
    compared = nonempty = 0
    for _ in range(400):
        try:
            cfg = load_config(None, random_layout(rng))
        except ConfigError:
            continue
        max_world = rng.randint(1, 64)
        want = reference_world_sizes(cfg, max_world)
        assert valid_world_sizes(cfg, max_world) == want, (cfg.parallel, cfg.train, max_world)
        compared, nonempty = compared + 1, nonempty + bool(want)
    assert compared >= 150 and nonempty >= 50, (compared, nonempty)


def test_divisors_and_data_parallel_sizes_equal_their_plain_definitions():
    for n in range(1200):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    for gb, mb in ((12, 1), (12, 4), (48, 3), (7, 7), (64, 2)):
        cfg = load_config(None, [f"train.global_batch={gb}", f"train.micro_batch={mb}"])
        for max_dp in (1, 5, 64, 10**9):
            assert valid_dp_sizes(cfg, max_dp) == [d for d in range(1, min(max_dp, 100) + 1) if gb % (d * mb) == 0]


def within(seconds: float, fn, *args, **kwargs):
    start = time.monotonic()
    out = fn(*args, **kwargs)
    assert time.monotonic() - start < seconds, f"{fn.__name__} took {time.monotonic() - start:.2f} s"
    return out


def test_huge_sizes_return_or_are_refused_within_a_second():
    cfg = load_config(None, ["train.global_batch=16777216", "train.micro_batch=1"])
    ParallelDims.from_config(cfg, 1)  # the first call's imports are not the computation's
    sizes = within(1.0, valid_world_sizes, cfg, 10**9)
    assert sizes == [2**k for k in range(25)]
    assert within(1.0, divisors, 1000000007) == [1, 1000000007]
    with pytest.raises(ConfigError, match="model.n_experts=1000000007"):
        within(1.0, load_config, None, ["model.n_experts=1000000007", "parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"elastic.max_workers=1000000000 is above 1_000_000"):
        within(1.0, elastic_from_raw, load_raw(None, ["elastic.max_workers=1000000000"]))
    with pytest.raises(ConfigError, match=r"--max-workers 1000000000 \(elastic.max_workers\)"):
        within(1.0, elastic_from_raw, {}, max_workers=10**9)
    top = within(1.0, check_sizes, cfg, ElasticConfig(workers=2, max_workers=1_000_000))
    assert top[-1] == 2**19


def test_the_command_line_exits_2_naming_the_field(capsys, tmp_path):
    from orchestrator.cli.main import main

    start = time.monotonic()
    assert main(["plan", "examples/tiny.toml", "--set", "model.n_experts=1000000007", "--set", "parallel.ep=2"]) == 2
    assert "model.n_experts=1000000007" in capsys.readouterr().err
    assert main(["run", "examples/tiny.toml", "--max-workers", "1000000000", "--store", f"file://{tmp_path}/runs"]) == 2
    assert "elastic.max_workers" in capsys.readouterr().err
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("overrides, field", [
    (["parallel.offload_buffer_mb=1e-9"], "parallel.offload_buffer_mb=1e-09 must be in [0.001, 1_048_576.0]"),
    (["parallel.offload_buffer_mb=1e7"], "parallel.offload_buffer_mb"),
    ([f"parallel.quantization_block={2**62}"], "parallel.quantization_block=4611686018427387904 must be a multiple"),
    ([f"model.n_experts={2**40}"], "model.n_experts=1099511627776 must be in [0, 1_048_576]"),
    ([f"model.dim={2**21}"], "model.dim"),
    ([f"model.n_layers={2**17}"], "model.n_layers"),
    ([f"model.n_heads={2**17}"], "model.n_heads"),
    ([f"model.ffn_hidden={2**23}"], "model.ffn_hidden"),
    ([f"model.vocab_size={2**25}"], "model.vocab_size"),
    ([f"model.max_seq_len={2**25}"], "model.max_seq_len"),
    ([f"data.seq_len={2**25}"], "data.seq_len"),
    ([f"train.global_batch={2**62}"], "train.global_batch"),
    ([f"train.seed={2**63}"], None),  # beyond TOML's integers: parsed as text, refused as one
    ([f"parallel.tp={2**62}"], "parallel.tp=4611686018427387904 must be in [1, 1_000_000]"),
    ([f"parallel.dp_shard={10**7}"], "parallel.dp_shard"),
    ([f"parallel.hpz_partition_size={10**7}"], "parallel.hpz_partition_size"),
    (["parallel.bucket_mb=1e12"], "parallel.bucket_mb"),
    (['parallel.offload_dir=" "'], "parallel.offload_dir=' ' is blank"),
    (['parallel.offload_dir="../x"'], "parallel.offload_dir='../x' climbs with '..'"),
    (['parallel.offload_dir="/scratch/../etc"'], "climbs with '..'"),
    (['parallel.offload="nvme"', 'parallel.offload_dir="   "'], "parallel.offload_dir='   ' is blank"),
    (['parallel.offload_dir="/x\\u0000y"'], "parallel.offload_dir holds a NUL byte"),
    (['data.source="file:///a\\u0000b"'], "data.source holds a NUL byte"),
    (['data.data_files=["ok", "a\\u0000"]'], "data.data_files[1] holds a NUL byte"),
    (['model.args={k = {j = "\\u0000"}}'], "model.args.k.j holds a NUL byte"),
    (['checkpoint.url="file:///c\\u0000"'], "checkpoint.url holds a NUL byte"),
    (['logging.experiment="e\\u0000"'], "logging.experiment holds a NUL byte"),
])
def test_out_of_bounds_values_are_refused_at_load_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert (field or overrides[0].split("=")[0]) in str(e.value), str(e.value)


def test_bounds_themselves_are_accepted():
    cfg = load_config(None, [f"model.dim={2**20}", f"model.n_layers={2**16}", f"model.ffn_hidden={2**22}",
                             f"model.vocab_size={2**24}", f"model.max_seq_len={2**24}", f"train.seed={-2**63}",
                             "parallel.offload_buffer_mb=0.001", "parallel.quantization_block=1048576",
                             'parallel.offload_dir="rel/x"'])
    assert cfg.model.dim == 2**20 and cfg.parallel.quantization_block == 2**20
    assert ElasticConfig(workers=1_000_000, standby=1_000_000).max_workers == 1_000_000
    with pytest.raises(ConfigError, match="elastic.standby=1000001"):
        ElasticConfig(standby=1_000_001)


def test_nul_bytes_and_overflowing_numbers_from_python_are_refused():
    with pytest.raises(ConfigError, match="run_id holds a NUL byte"):
        config_from_dict({"run_id": "a\x00"})
    with pytest.raises(ConfigError, match="train.lr=inf is not a finite number"):
        config_from_dict({"train": {"lr": 10**400}})
    with pytest.raises(ConfigError, match="model.preset=\\['tiny'\\] is unknown"):
        config_from_dict({"model": {"preset": ["tiny"]}})
    with pytest.raises(ConfigError, match="elastic.team holds a NUL byte"):
        elastic_from_raw({"elastic": {"team": "t\x00"}})
    from trainer.config import DataConfig, RunConfig

    with pytest.raises(ConfigError, match="data.tokenizer holds a NUL byte"):
        RunConfig(data=DataConfig(tokenizer="by\x00tes"))


# --- refusals that name the rule that refused --------------------------------------------------------------------

BATCH = ["train.global_batch=12", "train.micro_batch=1"]


@pytest.mark.parametrize("overrides, names", [
    (["parallel.hpz_partition_size=5"], "at size 1, parallel.hpz_partition_size=5 must divide the ZeRO-3 shard"),
    (["parallel.cp=2", "data.seq_len=63"], "at size 2, parallel.cp=2 splits every sample's data.seq_len=63"),
    (["parallel.cp=3", 'parallel.cp_style="ulysses"', "data.seq_len=60"],
     'at size 3, parallel.cp_style="ulysses" splits the attention heads across the cp ranks: model.n_heads=4'),
])
def test_no_valid_size_names_the_rule_not_the_batch(overrides, names):
    cfg = load_config(None, BATCH + overrides)
    with pytest.raises(ConfigError) as e:
        check_sizes(cfg, ElasticConfig(workers=2, max_workers=8))
    message = str(e.value)
    assert message.startswith("no group size in [1, 8] works for this run: ") and names in message, message
    assert "train.global_batch" not in message, message


def test_an_invalid_request_says_why_that_size_is_refused():
    cfg = load_config(None, BATCH + ["parallel.hpz_partition_size=3"])
    with pytest.raises(ConfigError, match=r"--workers 2 is not a valid size for this run; valid sizes in \[1, 8\]: "
                                          r"\[3, 6\] \(elastic.workers; at 2, parallel.hpz_partition_size=3 must"):
        check_sizes(cfg, ElasticConfig(workers=2, max_workers=8))
    cfg = load_config(None, ["train.global_batch=7", "train.micro_batch=1"])
    with pytest.raises(ConfigError, match=r"at 2, train.global_batch=7 is not divisible by data-parallel size 2"):
        check_sizes(cfg, ElasticConfig(workers=2, max_workers=8))


def test_the_batch_is_named_where_it_is_the_cause():
    cfg = load_config(None, BATCH + ["parallel.hpz_partition_size=5"])
    with pytest.raises(ConfigError, match=r"no group size in \[5, 5\] works for this run: sizes must be .*, whose "
                                          r"data-parallel size divides train.global_batch=12 in train.micro_batch=1"):
        check_sizes(cfg, ElasticConfig(workers=5, min_workers=5, max_workers=5))
    cfg = load_config(None, BATCH + ["parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"sizes must be multiples of dp_replicate x tp x pp \(here 1 x 2 x 1 = 2\), "
                                          r"the degrees parallel.dp_replicate, parallel.tp and parallel.pp, whose "):
        check_sizes(cfg, ElasticConfig(workers=1, max_workers=1))
    with pytest.raises(ConfigError, match=r"\(parallel.dp_shard=3 allows only 3\)"):
        check_sizes(load_config(None, ["parallel.dp_shard=3"]), ElasticConfig(workers=2))


def test_a_size_refuses_on_the_layout_rule_before_the_batch():
    cfg = load_config(None, ["train.global_batch=6", "train.micro_batch=1", "parallel.cp=2", "data.seq_len=62"])
    with pytest.raises(ConfigError, match="parallel.cp=2 splits every sample's data.seq_len=62"):
        ParallelDims.from_config(cfg, 8)  # dp 4 does not split the batch of 6 either
    cfg = load_config(None, ["parallel.hpz_partition_size=3"])
    with pytest.raises(ConfigError, match="hpz_partition_size=3 must divide .* 1 ranks at world size 1.*; turn hpZ "
                                          "off with hpz_partition_size=0, or run on more data-parallel ranks"):
        ParallelDims.from_config(cfg, 1)
