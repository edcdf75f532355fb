"""The whole run: :class:`RunConfig` over every section, its cross-section checks and its hash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from checkpointing.errors import ConfigError
from checkpointing.names import validate_run_id

from .checkpoint import CheckpointConfig
from .checks import check_text, divisors, fmt_list, or_join
from .data import DataConfig, EvalConfig
from .health import HealthConfig
from .model import ModelConfig
from .observe import LoggingConfig, MetricsConfig
from .parallel import ParallelConfig, check_ep
from .profile import ProfileConfig
from .train import TrainConfig


@dataclass(kw_only=True)
class RunConfig:
    """One training run. Cross-section checks live here."""

    run_id: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        for name in SECTIONS:  # what the loader refuses, refused of sections built in Python too
            check_text(getattr(self, name), name)
        m, p, d, t = self.model, self.parallel, self.data, self.train
        self._check_layout_fits_builtin()
        stages = p.pp * p.pp_stages_per_rank
        if m.source == "builtin" and stages > m.n_layers:
            raise ConfigError(
                f"parallel.pp={p.pp} x parallel.pp_stages_per_rank={p.pp_stages_per_rank} = {stages} "
                f"pipeline stages exceed model.n_layers={m.n_layers}; use at most {m.n_layers} stages"
            )
        if m.source == "builtin" and d.seq_len > m.max_seq_len:
            raise ConfigError(
                f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
                f"use data.seq_len <= {m.max_seq_len} or raise model.max_seq_len"
            )
        if self.checkpoint.export_every and m.n_experts:
            raise ConfigError(f"checkpoint.export_every writes transformers directories during the run, not yet for "
                              f"model.n_experts={m.n_experts} (Mixture of Experts); set it to 0 and use "
                              "`etrain ckpt export --format hf` (Mixtral) on a checkpoint")
        check_ep(p, m)  # expert parallelism's rules are config.parallel's
        if self.checkpoint.resume and not self.checkpoint.url:
            raise ConfigError("checkpoint.resume=true needs checkpoint.url")
        if self.checkpoint.export_every and m.source == "python":
            raise ConfigError('checkpoint.export_every writes transformers directories, which model.source="python" '
                              "cannot be; set it to 0 and use `etrain ckpt export --format safetensors`")
        if t.global_batch % t.micro_batch:
            raise ConfigError(
                f"train.micro_batch={t.micro_batch} does not divide train.global_batch={t.global_batch}; "
                f"use one of {fmt_list(divisors(t.global_batch))}"
            )
        for start, end in d.skip_ranges:
            if start % t.global_batch or end % t.global_batch:
                raise ConfigError(f"data.skip_ranges: [{start}, {end}) is not whole steps of train.global_batch="
                                  f"{t.global_batch}; use multiples of it, e.g. [{start - start % t.global_batch}, "
                                  f"{start - start % t.global_batch + t.global_batch}]")
        validate_run_id(self.run_id, "run_id")

    def _check_layout_fits_builtin(self) -> None:
        """The built-in decoder's sizes against tensor parallelism (other models are checked when built)."""
        m, p = self.model, self.parallel
        if m.source != "builtin":
            return
        if m.n_heads % p.tp:
            good = [v for v in divisors(m.n_heads) if m.n_kv_heads % v == 0]
            raise ConfigError(
                f"parallel.tp={p.tp} does not divide model.n_heads={m.n_heads}; use {or_join(good)}"
            )
        if m.n_kv_heads % p.tp:
            good = divisors(m.n_kv_heads)
            raise ConfigError(
                f"parallel.tp={p.tp} does not divide model.n_kv_heads={m.n_kv_heads}; use {or_join(good)}"
            )
        if m.ffn_hidden % p.tp:
            raise ConfigError(
                f"parallel.tp={p.tp} does not divide model.ffn_hidden={m.ffn_hidden}; "
                f"use one of {fmt_list(divisors(m.ffn_hidden))}"
            )
        if m.vocab_size % p.tp:
            raise ConfigError(
                f"parallel.tp={p.tp} does not divide model.vocab_size={m.vocab_size}; "
                f"use one of {fmt_list(divisors(m.vocab_size))}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """A short hash of what determines the training math (not the layout).

        The parallel layout and checkpoint settings are left out on purpose: a
        run resumed on another layout still trains the same model on the same
        data.
        """
        d = self.to_dict()
        d.pop("parallel")
        d.pop("checkpoint")
        d.pop("metrics")
        d.pop("logging")
        d.pop("eval")
        d.pop("profile")  # what is traced, not what is trained
        d.pop("health")  # what is checked, not what is trained (a skipped range is data.skip_ranges)
        d.pop("run_id")
        d["train"].pop("log_every")
        d["train"].pop("skip_nonfinite_steps")  # what a diverged step does, not the training math
        d["data"].pop("cache_dir")  # where the tokens are cached does not change them
        # Fields added after the first format count only when set, so older checkpoints keep their hash.
        for section, cls in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
            defaults = dataclasses.asdict(cls())
            for key in _HASHED_WHEN_SET[section]:
                if d[section].get(key) == defaults[key]:
                    d[section].pop(key, None)
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_HASHED_WHEN_SET = {
    "model": ("source", "hf_config", "factory", "loss", "block_class", "pp_split_points", "tp_plan", "args",
              "init_from"),
    "data": ("tokenizer", "text_field", "data_files", "factory", "skip_ranges"),
    "train": ("lr_schedule", "decay_ratio", "decay_steps", "decay_type"),
}

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "logging": LoggingConfig,
    "eval": EvalConfig,
    "profile": ProfileConfig,
    "health": HealthConfig,
}
TOP_LEVEL = {"run_id": str}
# Sections owned by other components of a run (the orchestrator's [elastic] and [recovery]);
# they live in the same TOML file and the trainer leaves them alone.
FOREIGN_SECTIONS = ("elastic", "recovery")
