"""Checks the run config's sections share: finite numbers, bounded sizes, text without NUL bytes, storage URLs,
and the lists their messages name.

The bounds (docs/operations.md#bounds) sit far above any real run: they exist so that a mistyped value is
refused at load, naming its field, instead of a size computation crawling through it later.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from checkpointing.errors import ConfigError
from checkpointing.names import check_url, redact

# The most ranks (workers, and the degree of any one mesh axis) a run may name.
MAX_RANKS = 1_000_000
# Samples in a global batch (train.global_batch, micro_batch) and tokens in a sequence (data.seq_len,
# model.max_seq_len): 2**24 each.
MAX_SAMPLES = MAX_TOKENS = 16_777_216
# MiB of one host buffer pool or bucket (1 TiB).
MAX_MIB = 1_048_576.0


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1 in increasing order, in O(sqrt n) steps."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def check_range(section: str, name: str, value: float, lo: float, hi: float, what: str = "") -> None:
    """ConfigError naming ``section.name`` unless ``lo <= value <= hi``."""
    if not lo <= value <= hi:
        raise ConfigError(f"{section}.{name}={value} must be in [{lo:_}, {hi:_}]" + (f" ({what})" if what else ""))


def fmt_list(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (", ..." if len(values) > limit else "")


def or_join(values: list[int]) -> str:
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


def nul_field(value: Any, where: str) -> str | None:
    """The dotted name (``where``, or an item or key of it) of a string holding a NUL byte in ``value``, else None."""
    if isinstance(value, str):
        return where if "\x00" in value else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and "\x00" in key:
            return where
        found = nul_field(item, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
        if found:
            return found
    return None


def check_text(obj: Any, section: str) -> None:
    """ConfigError unless every string of the dataclass ``obj`` (in lists and tables too) is free of NUL bytes,
    which no path, URL or name may hold."""
    for f in dataclasses.fields(obj):
        found = nul_field(getattr(obj, f.name), f"{section}.{f.name}" if section else f.name)
        if found:
            raise ConfigError(f"{found} holds a NUL byte (\\x00); remove it")


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
