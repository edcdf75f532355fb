"""Loading a run config: TOML file, ``--set`` overrides, typed sections, the validated :class:`RunConfig`.

    from trainer.config.load import load_config
    cfg = load_config("examples/tiny.toml", overrides=["parallel.tp=2"])

    raw = load_raw("examples/tiny.toml", ["train.steps=10"])   # the document, not yet validated
    cfg = config_from_dict(raw)                                # every [section] built and checked
    ecfg = build_section("elastic", ElasticConfig, raw.get("elastic", {}))   # another component's section

An override is ``section.field=value``; the value is parsed as TOML, falling
back to a string (:func:`parse_value`). :func:`build_section` checks every
key against the section's dataclass (suggesting the closest name for a typo)
and every value against the field's type before the dataclass validates
itself. The dataclasses themselves live in :mod:`trainer.config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from typing import Any, Literal

from checkpointing.errors import ConfigError
from checkpointing.names import redact_text

from . import FOREIGN_SECTIONS, MODEL_PRESETS, SECTIONS, TOP_LEVEL, RunConfig
from .checks import nul_field


def shown(value: object, limit: int = 80) -> str:
    """A value for an error message: its repr, any URL in it redacted, cut to ``limit`` characters."""
    text = redact_text(repr(value))
    return text if len(text) <= limit else text[:limit] + "..."

def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(options))}"


def _check_type(where: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to ``tp`` or raise a ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            raise ConfigError(f"{where}={shown(value)} is not allowed; use one of {allowed}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _check_type(where, value, arm)
            except ConfigError:
                continue
        raise ConfigError(f"{where}={shown(value)} has the wrong type; expected {tp}")
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) and item is str:
            value = [value]  # a single path where a list of them is allowed
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {shown(value)}")
        return [_check_type(f"{where}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is type(None):  # the None arm of ``X | None``: TOML has no null, so only X can be given
        if value is not None:
            raise ConfigError(f"{where}={shown(value)} has the wrong type")
        return value
    if tp in _PLAIN:
        accepts, what = _PLAIN[tp]
        if not accepts(value):
            raise ConfigError(f"{where} must be {what}, got {shown(value)}")
        if tp is float:
            try:
                value = float(value)
            except OverflowError:  # an integer beyond any float (Python's, not TOML's): no finite number either
                value = math.inf
            if not math.isfinite(value):
                raise ConfigError(f"{where}={shown(value)} is not a finite number; give a number (not nan or inf)")
            return value
        if tp in (str, dict):
            found = nul_field(value, where)
            if found:
                raise ConfigError(f"{found} holds a NUL byte (\\x00); remove it")
    return value


# Plain field types: what a value must be, and how the message names it (bool is not an int here).
_PLAIN = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
    dict: (lambda v: isinstance(v, dict), "a table"),
}


def build_section(name: str, cls: type, raw: dict[str, Any]) -> Any:
    """Build the dataclass ``cls`` of section ``[name]`` from its raw table, checking keys and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{name}] must be a table, got {shown(raw)}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    if name == "model":
        preset = raw.get("preset", "tiny")
        if not isinstance(preset, str) or preset not in MODEL_PRESETS:
            raise ConfigError(f"model.preset={shown(preset)} is unknown; use one of {', '.join(MODEL_PRESETS)}")
        values.update(MODEL_PRESETS[preset])
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"unknown key {name}.{key}{_suggest(str(key), known)}")
        values[key] = _check_type(f"{name}.{key}", value, hints[key])
    return cls(**values)


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a parsed TOML document."""
    sections: dict[str, Any] = {}
    top: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS:
            sections[key] = build_section(key, SECTIONS[key], value)
        elif key in TOP_LEVEL:
            top[key] = _check_type(key, value, TOP_LEVEL[key])
        elif key not in FOREIGN_SECTIONS:
            known = list(SECTIONS) + list(TOP_LEVEL) + list(FOREIGN_SECTIONS)
            raise ConfigError(f"unknown section or key {key!r}{_suggest(key, known)}")
    return RunConfig(**top, **sections)


def parse_value(text: str) -> Any:
    """A ``--set`` value: TOML (``2``, ``true``, ``"x"``, ``[1, 2]``), else the text itself as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` strings to a raw TOML dict (a copy)."""
    out = json.loads(json.dumps(raw))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like section.field=value, e.g. parallel.tp=2")
        path, _, text = item.partition("=")
        keys = path.strip().split(".")
        if not all(keys):
            raise ConfigError(f"--set {item!r}: the field path {path!r} is malformed")
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {k!r} is not a section")
        node[keys[-1]] = parse_value(text.strip())
    return out


def load_raw(path: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The run's TOML document (or an empty one) with ``--set`` overrides applied, not yet validated."""
    raw: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path!r} is a directory; give the TOML file") from None
        except OSError as e:
            raise ConfigError(f"config file {path!r} cannot be read: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    return apply_overrides(raw, overrides or [])


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a run config from a TOML file (or the defaults) plus overrides."""
    return config_from_dict(load_raw(path, overrides))
