"""A run's size as its owner asks for it: the one resize of ``etrain resize`` and of the Python API's ``Run.resize``.

    spec = resize_run(store, "tiny", 4, token)                 # the spec written; ConfigError for a size it cannot take
    resize_run(store, "tiny", 4, token, field="--workers")     # the CLI: its errors name the flag
    resize_run(store, "tiny", None, token, allow_growth=True)  # the allocator may grow it into idle capacity again

The size must be one the run's layout and global batch allow within its
``[min_workers, max_workers]`` (:func:`orchestrator.config.allowed_sizes`, decided
on the spec read). It is written, authorized like every control action
(:func:`orchestrator.service.auth.change_run`), as one compare-and-swap of
``workers``, ``target`` = 0 and ``requeue`` = false: the owner's size overrides the
allocator's target, and a run the allocator had requeued is released and joins
the queue again as a fresh request for that size (docs/service.md). The run's
controller carries it out at its next step boundary.

The size sticks: the spec is ``pinned``, and the cluster's allocator never grows
a pinned run above it into idle capacity (it may still shrink it, for a higher
priority, a quota or lost capacity, and gives the size back when it can).
``allow_growth=True`` (``etrain resize RUN --allow-growth``) lets it grow up to
``max_workers`` again. A size beyond ``max_workers`` raises ``max_workers`` to it.
"""

from __future__ import annotations

from checkpointing.errors import ConfigError

from ..store.documents import RunSpec, writing


def resize_run(store, run_id: str, workers: int | None, token: str | None = None, *, field: str = "workers",
               allow_growth: bool = False) -> RunSpec:
    """Ask for ``workers`` workers for ``run_id`` (see the module); the spec written. ``field`` names the
    argument in errors (``workers=3``, or ``--workers 3`` for a flag); StoreNotWritable on a read-only store.
    The size is pinned unless ``allow_growth``; ``workers=None`` with ``allow_growth`` only unpins it."""
    from trainer.config.load import config_from_dict

    from ..config import allowed_sizes
    from .auth import change_run

    asked = f"{field} {workers}" if field.startswith("-") else f"{field}={workers}"
    if workers is None:
        if not allow_growth:
            raise ConfigError(f"give a size ({field} N), or allow the run to grow into idle capacity again "
                              f"({'--allow-growth' if field.startswith('-') else 'allow_growth=True'})")
    elif isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"{asked} is not a size: give a whole number of workers >= 1")

    def resize(spec: RunSpec) -> dict:  # decided on the spec read; read and decided again if it changed meanwhile
        if workers is None:
            return {"pinned": False}
        top = max(spec.max_workers, workers)  # asking beyond max_workers raises it, as `etrain run --workers` does
        allowed = allowed_sizes(config_from_dict(spec.config), spec.min_workers, top)
        if workers not in allowed:
            raise ConfigError(f"{asked} is not a valid size for run {run_id!r}; valid sizes in "
                              f"[min {spec.min_workers}, max {top}]: {allowed}")
        return {"workers": workers, "max_workers": top, "target": 0, "target_cause": "", "requeue": False,
                "pinned": not allow_growth}

    with writing(store):
        return change_run(store, run_id, resize, token)
