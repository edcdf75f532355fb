"""Checks the run config's sections share: finite numbers, storage URLs, and the lists their messages name."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from checkpointing.errors import ConfigError
from checkpointing.names import check_url, redact


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
