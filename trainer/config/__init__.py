"""Run configuration: the keyword-only dataclasses of one run, section by section.

    from trainer.config import RunConfig, TrainConfig
    cfg = RunConfig(train=TrainConfig(steps=10))          # validated as it is built
    # from a TOML file: trainer.config.load.load_config("examples/tiny.toml", ["parallel.tp=2"])

A whole run is one TOML file with the sections ``[model]``, ``[data]``,
``[train]``, ``[parallel]``, ``[checkpoint]``, ``[metrics]``, ``[logging]``, ``[profile]`` and ``[health]``;
``--set section.field=value``
overrides any field (:mod:`trainer.config.load` reads the file and builds these).
Each section validates itself in ``__post_init__``; checks that span sections
run in :class:`RunConfig`; checks that need the world size run in
:class:`trainer.parallel.dims.ParallelDims`, still before any process group starts.
Every error is a :class:`ConfigError` that names the field and the fix.

One module per section: ``model`` (``[model]``), ``data`` (``[data]``, ``[eval]``), ``train``,
``parallel``, ``checkpoint``, ``observe`` (``[metrics]``, ``[logging]``), ``profile``, ``health``, and ``run``
(the whole run);
``checks`` holds the checks they share. Import them from here.
"""

from .checkpoint import CheckpointConfig
from .checks import COMMON_SCHEMES, check_finite, check_storage_url, divisors, fmt_list, or_join
from .data import DataConfig, EvalConfig
from .health import HealthConfig
from .model import MODEL_PRESETS, ModelConfig
from .observe import LoggingConfig, MetricsConfig
from .parallel import ParallelConfig
from .profile import ProfileConfig
from .run import FOREIGN_SECTIONS, SECTIONS, TOP_LEVEL, RunConfig
from .train import TrainConfig

__all__ = ["COMMON_SCHEMES", "FOREIGN_SECTIONS", "MODEL_PRESETS", "SECTIONS", "TOP_LEVEL", "CheckpointConfig",
           "DataConfig", "EvalConfig", "HealthConfig", "LoggingConfig", "MetricsConfig", "ModelConfig",
           "ParallelConfig", "ProfileConfig", "RunConfig", "TrainConfig", "check_finite", "check_storage_url",
           "divisors", "fmt_list", "or_join"]
