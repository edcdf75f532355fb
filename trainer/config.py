"""Run configuration: the keyword-only dataclasses of one run, section by section.

    from trainer.config import RunConfig, TrainConfig
    cfg = RunConfig(train=TrainConfig(steps=10))          # validated as it is built
    # from a TOML file: trainer.config_load.load_config("examples/tiny.toml", ["parallel.tp=2"])

A whole run is one TOML file with the sections ``[model]``, ``[data]``,
``[train]``, ``[parallel]``, ``[checkpoint]``, ``[metrics]`` and ``[logging]``; ``--set section.field=value``
overrides any field (:mod:`trainer.config_load` reads the file and builds these).
Each section validates itself in ``__post_init__``; checks that span sections
run in :class:`RunConfig`; checks that need the world size run in
:class:`trainer.parallel_dims.ParallelDims`, still before any process group starts.
Every error is a :class:`ConfigError` that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from checkpointing.errors import ConfigError
from checkpointing.names import check_url, redact, validate_run_id

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
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt_list(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (", ..." if len(values) > limit else "")


def _or_join(values: list[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    return ", ".join(str(v) for v in values[:-1]) + f" or {values[-1]}"


def check_finite(obj: Any, section: str) -> None:
    """ConfigError unless every float field of the dataclass ``obj`` is finite (no nan, inf or -inf).

    Range checks (``lr > 0``) cannot catch nan: every comparison with it is false."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type in ("float", float) and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{f.name}={value} is not a finite number; give a number (not nan or inf)")


# The fsspec schemes named in messages; any scheme fsspec knows is accepted.
COMMON_SCHEMES = ("file", "s3", "gs", "memory")


def check_storage_url(url: str, field: str) -> str:
    """``url`` unless it carries credentials or has a scheme fsspec does not know (ConfigError naming ``field``)."""
    check_url(url, field)
    import fsspec

    known = set(fsspec.available_protocols())
    for part in url.split("::"):  # fsspec chains such as simplecache::s3://bucket/x
        scheme = part.split("://", 1)[0] if "://" in part else "file"
        if scheme not in known:
            raise ConfigError(f"{field}={redact(url)!r} has an unknown URL scheme {scheme!r}; use one of "
                              f"{', '.join(s + '://' for s in COMMON_SCHEMES)} (or another fsspec protocol)")
    return url


@dataclass(kw_only=True)
class ModelConfig:
    """The model: the built-in Llama-style decoder (``preset`` fills the sizes not given), a Hugging
    Face ``transformers`` causal LM built from a local config, or any ``nn.Module`` from a factory
    (docs/models-and-data.md)."""

    # "builtin": the decoder of trainer/model.py; "hf": AutoModelForCausalLM.from_config(hf_config);
    # "python": factory(model table) -> nn.Module mapping token ids [b, s] to logits [b, s, vocab].
    source: Literal["builtin", "hf", "python"] = "builtin"
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
    # Start from these weights (optimizer state fresh): a transformers directory (safetensors) or an etrain
    # checkpoint step URL; any layout. A resumed run keeps its checkpoint's weights.
    init_from: str = ""

    def __post_init__(self) -> None:
        if self.source == "hf" and not self.hf_config:
            raise ConfigError('model.source="hf" needs model.hf_config: a directory with config.json, or the file')
        if self.source == "python" and not self.factory:
            raise ConfigError('model.source="python" needs model.factory="package.module:function"')
        if self.source != "python" and self.factory:
            raise ConfigError(f'model.factory is set but model.source={self.source!r}; set model.source="python"')
        if self.source != "hf" and self.hf_config:
            raise ConfigError(f'model.hf_config is set but model.source={self.source!r}; set model.source="hf"')
        for name in ("factory", "loss", "tp_plan"):
            ref = getattr(self, name)
            if ref and (ref.count(":") != 1 or not all(ref.split(":"))):
                raise ConfigError(f"model.{name}={ref!r} must look like \"package.module:function\"")
        if self.preset not in MODEL_PRESETS:
            raise ConfigError(
                f"model.preset={self.preset!r} is unknown; use one of {', '.join(MODEL_PRESETS)}"
            )
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} does not divide model.dim={self.dim}; "
                f"use one of {_fmt_list(_divisors(self.dim))}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(
                f"model.dim / model.n_heads = {self.dim // self.n_heads} must be even for rotary embeddings"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}; "
                f"use one of {_fmt_list(_divisors(self.n_heads))}"
            )
        check_finite(self, "model")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        for name in ("norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(kw_only=True)
class DataConfig:
    """Where the training text or tokens come from, and how samples are cut."""

    # "stdlib": this machine's Python standard library sources (the default
    # corpus). Otherwise an fsspec URL or glob of text files, or of pre-tokenized
    # ``.bin`` token files (format "tokens").
    # "python": ``factory`` returns a map-style dataset (__len__, __getitem__(i) -> token ids).
    source: str = "stdlib"
    # auto: "tokens" for .bin files or a directory of them, "jsonl"/"parquet" by extension, else "text".
    # "hf": source is a datasets builder name ("json", "parquet", "text", "csv") read from data_files.
    format: Literal["auto", "text", "jsonl", "parquet", "hf", "tokens"] = "auto"
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    seq_len: int = 64
    # Read at most this many bytes of text (0 = all); keeps tests quick.
    max_bytes: int = 0
    # "bytes" (ids 0-255) or a local Hugging Face tokenizer: a tokenizer.json file or a directory.
    tokenizer: str = "bytes"
    # The text column of jsonl / parquet / hf records.
    text_field: str = "text"
    # format "hf": the local files datasets.load_dataset reads (a path, glob or list of them).
    data_files: list[str] = field(default_factory=list)
    # source "python": "package.module:function"(data table) -> map-style dataset of token ids.
    factory: str = ""
    # Where tokenized text is cached ("" = $ETRAIN_CACHE_DIR, else ~/.cache/etrain/tokens); a local
    # filesystem, since ranks memory-map it.
    cache_dir: str = ""

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len={self.seq_len} must be >= 2")
        if self.max_bytes < 0:
            raise ConfigError(f"data.max_bytes={self.max_bytes} must be >= 0 (0 reads everything)")
        if not self.source:
            raise ConfigError('data.source is empty; use "stdlib" or an fsspec URL such as "file:///data/*.txt"')
        if "://" in self.source:
            check_url(self.source, "data.source")
        if self.source == "python" and not self.factory:
            raise ConfigError('data.source="python" needs data.factory="package.module:function"')
        if self.format == "hf" and not self.data_files:
            raise ConfigError('data.format="hf" needs data.data_files (local files, e.g. ["/data/*.jsonl"])')
        if not self.tokenizer:
            raise ConfigError('data.tokenizer is empty; use "bytes" or a tokenizer.json file / directory')


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation: steps, batch, AdamW and the learning-rate schedule."""

    steps: int = 200
    # Samples per optimizer step, fixed for the whole run whatever the world
    # size: gradient accumulation absorbs the data-parallel degree.
    global_batch: int = 8
    # Samples per forward pass on one data-parallel rank.
    micro_batch: int = 4
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    log_every: int = 10

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.micro_batch > self.global_batch:
            raise ConfigError(
                f"train.micro_batch={self.micro_batch} is larger than train.global_batch={self.global_batch}; "
                f"use micro_batch <= {self.global_batch}"
            )
        check_finite(self, "train")
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay={self.weight_decay} must be >= 0 (0 disables it)")
        if self.eps <= 0:
            raise ConfigError(f"train.eps={self.eps} must be > 0 (AdamW's denominator term, e.g. 1e-8)")


@dataclass(kw_only=True)
class ParallelConfig:
    """The parallel layout: dp_replicate x dp_shard x tp x pp = world size."""

    dp_replicate: int = 1
    # -1: whatever the world size leaves after dp_replicate, tp and pp. This is
    # the elastic axis: resizing a run changes it and nothing else.
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    # 0 replicate (DDP), 1 + optimizer state sharded, 2 + gradients sharded,
    # 3 + parameters sharded (FSDP2 fully_shard).
    zero_stage: int = 3
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    # Pipeline stages held by each pp rank (> 1 with interleaved_1f1b).
    pp_stages_per_rank: int = 1
    # Pipeline micro-batches per step on one data-parallel rank; 0 = the local
    # batch divided by train.micro_batch.
    pp_microbatches: int = 0
    activation_checkpoint: Literal["none", "full", "every_k"] = "none"
    ac_every_k: int = 2
    mixed_precision: Literal["auto", "fp32", "bf16"] = "auto"
    offload: Literal["none", "cpu"] = "none"
    # Megatron-LM sequence parallelism between the tensor-parallel regions (needs tp > 1).
    sequence_parallel: bool = False
    # Cross-entropy on vocabulary-sharded logits under tensor parallelism (no logits all-gather).
    loss_parallel: bool = True
    # ZeRO-2: gradients are reduce-scattered in buckets of this many MiB during backward.
    bucket_mb: float = 25.0
    # Gradient accumulation: reduce (FSDP reduce-scatter) after every micro-batch instead of only the
    # last (less memory for ZeRO-3, more communication).
    reduce_every_microbatch: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "pp_stages_per_rank", "ac_every_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard} must be >= 1, or -1 to fill the world size")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.pp_microbatches < 0:
            raise ConfigError(f"parallel.pp_microbatches={self.pp_microbatches} must be >= 0 (0 = automatic)")
        if self.pp_stages_per_rank > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ConfigError(
                f"parallel.pp_stages_per_rank={self.pp_stages_per_rank} needs "
                f'parallel.pp_schedule="interleaved_1f1b" (got {self.pp_schedule!r})'
            )
        if self.pp_schedule == "interleaved_1f1b" and self.pp_stages_per_rank < 2:
            raise ConfigError(
                'parallel.pp_schedule="interleaved_1f1b" needs parallel.pp_stages_per_rank >= 2; '
                'use 2, or pp_schedule="1f1b"'
            )
        if self.pp_schedule == "interleaved_1f1b" and self.pp < 2:
            raise ConfigError(
                f'parallel.pp_schedule="interleaved_1f1b" needs parallel.pp > 1 (got pp={self.pp}): it interleaves '
                'stages across pipeline ranks; set parallel.pp=2 or more, or leave pp_schedule and '
                "pp_stages_per_rank at their defaults"
            )
        check_finite(self, "parallel")
        if self.bucket_mb <= 0:
            raise ConfigError(f"parallel.bucket_mb={self.bucket_mb} must be > 0 (MiB per ZeRO-2 reduce bucket)")
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError(f"parallel.sequence_parallel=true needs parallel.tp > 1 (got tp={self.tp}); "
                              "set parallel.tp=2 or more, or sequence_parallel=false")
        if self.offload == "cpu" and self.zero_stage != 3:
            raise ConfigError(
                f'parallel.offload="cpu" needs parallel.zero_stage=3 (got {self.zero_stage}); '
                "offload moves the FSDP-sharded parameters and optimizer state to host memory"
            )

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one model replica's fixed part: tp x pp."""
        return self.tp * self.pp


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out loss: every ``every_steps`` steps, ``batches`` global batches of a validation split."""

    # 0 = no evaluation.
    every_steps: int = 0
    batches: int = 4
    # The share of documents held out of training (0 with no ``source`` of its own = none).
    val_fraction: float = 0.0
    # A validation corpus of its own (read as [data] reads its source: same format and tokenizer).
    source: str = ""

    def __post_init__(self) -> None:
        check_finite(self, "eval")
        if self.every_steps < 0:
            raise ConfigError(f"eval.every_steps={self.every_steps} must be >= 0 (0 = no evaluation)")
        if self.batches < 1:
            raise ConfigError(f"eval.batches={self.batches} must be >= 1")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"eval.val_fraction={self.val_fraction} must be in [0, 1)")
        if self.val_fraction and self.source:
            raise ConfigError("eval.val_fraction and eval.source are both set; hold out a fraction of "
                              "[data] or give a validation source, not both")
        if self.every_steps and not (self.val_fraction or self.source):
            raise ConfigError(f"eval.every_steps={self.every_steps} needs a validation split: "
                              "set eval.val_fraction (e.g. 0.05) or eval.source")
        if "://" in self.source:
            check_url(self.source, "eval.source")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often checkpoints are written (see the checkpointing package)."""

    url: str = ""
    interval_steps: int = 0
    # Upload in the background after a short blocking copy to host memory.
    async_save: bool = True
    # A save requested while another is in flight: "wait" for it or "skip".
    when_busy: Literal["wait", "skip"] = "wait"
    keep_last: int = 3
    keep_every: int = 0
    # Resume from the newest committed checkpoint under url, if there is one.
    resume: bool = False
    # Bound on one save's upload and commit; past it the save fails (training goes on).
    timeout_s: float = 600.0
    # Files and multipart parts in flight per rank.
    concurrency: int = 8
    # Storage fault injection for chaos testing (see checkpointing.faults.StorageFaults).
    faults: dict = field(default_factory=dict)
    # This many saves failing in a row fail the run: its work is no longer being made durable.
    max_consecutive_failures: int = 3
    # A transformers export of every N-th committed step, in the background, at <url>/<run_id>/exports/step_N (0: none).
    export_every: int = 0

    def __post_init__(self) -> None:
        check_finite(self, "checkpoint")
        if self.url:
            check_storage_url(self.url, "checkpoint.url")
        if self.interval_steps < 0:
            raise ConfigError(f"checkpoint.interval_steps={self.interval_steps} must be >= 0 (0 disables)")
        if self.interval_steps > 0 and not self.url:
            raise ConfigError(
                f"checkpoint.interval_steps={self.interval_steps} needs checkpoint.url; "
                'set it to a directory such as "file:///tmp/ckpt" or "s3://bucket/prefix"'
            )
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 1")
        if self.keep_every < 0:
            raise ConfigError(f"checkpoint.keep_every={self.keep_every} must be >= 0 (0 keeps none extra)")
        if self.timeout_s <= 0:
            raise ConfigError(f"checkpoint.timeout_s={self.timeout_s} must be > 0")
        if self.concurrency < 1:
            raise ConfigError(f"checkpoint.concurrency={self.concurrency} must be >= 1")
        if self.max_consecutive_failures < 1:
            raise ConfigError(f"checkpoint.max_consecutive_failures={self.max_consecutive_failures} must be >= 1 "
                              "(saves that may fail in a row before the run fails)")
        e, i = self.export_every, self.interval_steps
        if e < 0 or (e and (not i or e % i)):  # an export is made from a committed checkpoint
            near = f"export_every={i * max(1, e // i)}, or " if i and e > 0 else ""
            raise ConfigError(f"checkpoint.export_every={e} must be a multiple of checkpoint.interval_steps={i}; use "
                              f"{near}interval_steps={max(e, 1)} or a divisor of it (export_every=0 exports nothing)")
        if self.faults:
            from checkpointing.faults import StorageFaults

            try:
                StorageFaults.from_dict(self.faults)
            except TypeError as e:
                raise ConfigError(f"checkpoint.faults: {e}; see checkpointing.faults.StorageFaults") from None


@dataclass(kw_only=True)
class MetricsConfig:
    """The run's Prometheus endpoint (docs/metrics.md). Served by the controller on Ray and by
    rank 0 under torchrun."""

    enabled: bool = True
    # Address and port of the endpoint; port 0 picks a free one. Printed at start.
    addr: str = "127.0.0.1"
    port: int = 0
    # Directory of Prometheus file_sd target files ("" = $ETRAIN_PROMETHEUS_DIR, else ~/.etrain/prometheus;
    # "-" = write none).
    file_sd_dir: str = ""
    # Time every collective (calls, bytes, seconds, bus bandwidth); off leaves torch.distributed untouched.
    comm: bool = True
    # How often ranks send their communication and memory figures.
    every_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"metrics.port={self.port} must be 0 (a free port) or a port number up to 65535")
        check_finite(self, "metrics")
        if self.every_s <= 0:
            raise ConfigError(f"metrics.every_s={self.every_s} must be > 0 (seconds between rank reports)")
        if not self.addr:
            raise ConfigError('metrics.addr is empty; use "127.0.0.1", or "0.0.0.0" to listen on every interface')


@dataclass(kw_only=True)
class LoggingConfig:
    """Experiment trackers (docs/metrics.md#trackers), each optional (``pip install etrain[trackers]``).
    Rank 0 logs to them under torchrun, the controller on Ray; a tracker that fails is disabled, never the run."""

    tensorboard_dir: str = ""  # TensorBoard event files under <dir>/<run_id>
    wandb_project: str = ""  # Weights & Biases project; wandb_mode "offline" needs no network
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_dir: str = ""  # where W&B keeps its run directories ("" = its default, ./wandb)
    mlflow_uri: str = ""  # MLflow tracking URI: file:///…/mlruns, sqlite:///…, http://host:5000
    experiment: str = ""  # the MLflow experiment ("" = "etrain")

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise ConfigError(f'logging.wandb_mode={self.wandb_mode!r} must be "offline", "online" or "disabled"')
        import importlib.util

        for fld, module in (("tensorboard_dir", "tensorboard"), ("wandb_project", "wandb"), ("mlflow_uri", "mlflow")):
            if getattr(self, fld) and importlib.util.find_spec(module) is None:
                raise ConfigError(f"logging.{fld} is set but {module} is not installed; install the extra "
                                  f"(pip install 'etrain[trackers]') or unset logging.{fld}")


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

    def __post_init__(self) -> None:
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
        if self.checkpoint.resume and not self.checkpoint.url:
            raise ConfigError("checkpoint.resume=true needs checkpoint.url")
        if self.checkpoint.export_every and m.source == "python":
            raise ConfigError('checkpoint.export_every writes transformers directories, which model.source="python" '
                              "cannot be; set it to 0 and use `etrain ckpt export --format safetensors`")
        if t.global_batch % t.micro_batch:
            raise ConfigError(
                f"train.micro_batch={t.micro_batch} does not divide train.global_batch={t.global_batch}; "
                f"use one of {_fmt_list(_divisors(t.global_batch))}"
            )
        validate_run_id(self.run_id, "run_id")

    def _check_layout_fits_builtin(self) -> None:
        """The built-in decoder's sizes against tensor parallelism (other models are checked when built)."""
        m, p = self.model, self.parallel
        if m.source != "builtin":
            return
        if m.n_heads % p.tp:
            good = [v for v in _divisors(m.n_heads) if m.n_kv_heads % v == 0]
            raise ConfigError(
                f"parallel.tp={p.tp} does not divide model.n_heads={m.n_heads}; use {_or_join(good)}"
            )
        if m.n_kv_heads % p.tp:
            good = _divisors(m.n_kv_heads)
            raise ConfigError(
                f"parallel.tp={p.tp} does not divide model.n_kv_heads={m.n_kv_heads}; use {_or_join(good)}"
            )
        if m.ffn_hidden % p.tp:
            raise ConfigError(
                f"parallel.tp={p.tp} does not divide model.ffn_hidden={m.ffn_hidden}; "
                f"use one of {_fmt_list(_divisors(m.ffn_hidden))}"
            )
        if m.vocab_size % p.tp:
            raise ConfigError(
                f"parallel.tp={p.tp} does not divide model.vocab_size={m.vocab_size}; "
                f"use one of {_fmt_list(_divisors(m.vocab_size))}"
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
        d.pop("run_id")
        d["train"].pop("log_every")
        d["data"].pop("cache_dir")  # where the tokens are cached does not change them
        # Fields added after the first format count only when set, so older checkpoints keep their hash.
        for section, cls in (("model", ModelConfig), ("data", DataConfig)):
            defaults = dataclasses.asdict(cls())
            for key in _HASHED_WHEN_SET[section]:
                if d[section].get(key) == defaults[key]:
                    d[section].pop(key, None)
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_HASHED_WHEN_SET = {
    "model": ("source", "hf_config", "factory", "loss", "block_class", "pp_split_points", "tp_plan", "args",
              "init_from"),
    "data": ("tokenizer", "text_field", "data_files", "factory"),
}

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "logging": LoggingConfig,
    "eval": EvalConfig,
}
_TOP_LEVEL = {"run_id": str}
# Sections owned by other components of a run (the orchestrator's [elastic] and [recovery]);
# they live in the same TOML file and the trainer leaves them alone.
FOREIGN_SECTIONS = ("elastic", "recovery")
