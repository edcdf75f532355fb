"""Callables named in the config as ``package.module:function`` (a model factory, a loss, a TP plan, a dataset).

    fn = resolve_ref("my_pkg.models:build", "model.factory")   # ConfigError naming the field if it does not import

Imports nothing heavy itself: a Python data source resolves its factory without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from checkpointing.errors import ConfigError


def resolve_ref(ref: str, field: str) -> Callable:
    """The callable named ``package.module:function``; ConfigError naming ``field`` when it does not import."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's config to fix
        raise ConfigError(f"{field}={ref!r}: module {module_name!r} does not import ({type(e).__name__}: {e}); "
                          "is it on PYTHONPATH (or in the job's working_dir)?") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{field}={ref!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ConfigError(f"{field}={ref!r} is not callable")
    return obj
