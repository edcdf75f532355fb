"""``[data]`` and ``[eval]``: where the training and held-out text or tokens come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from checkpointing.errors import ConfigError
from checkpointing.names import check_url

from .checks import MAX_TOKENS, check_finite, check_range


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
    # Sample ranges [start, end) of the global order never trained on: each a whole step's global batch,
    # as a run records the batches it skipped ([health]; `etrain status` lists them). A step whose batch
    # lies in a range makes no update; the data cursor moves past it.
    skip_ranges: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_skip_ranges(self.skip_ranges, "data.skip_ranges")
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len={self.seq_len} must be >= 2")
        check_range("data", "seq_len", self.seq_len, 2, MAX_TOKENS, "tokens")
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


def check_skip_ranges(ranges, where: str) -> None:
    """[start, end) pairs of sample positions, start < end, sorted and apart; ConfigError naming ``where``."""
    if not isinstance(ranges, list):
        raise ConfigError(f"{where} must be a list of [start, end) sample ranges, e.g. [[640, 672]]")
    prev = -1
    for r in ranges:
        if (not isinstance(r, (list, tuple)) or len(r) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in r)):
            raise ConfigError(f"{where} holds {r!r:.40}: each range is [start, end), two sample positions >= 0")
        if r[0] >= r[1] or r[0] < prev:
            raise ConfigError(f"{where}: {list(r)} must have start < end and follow the range before it; sort "
                              "the ranges and merge the ones that overlap")
        prev = r[1]


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
