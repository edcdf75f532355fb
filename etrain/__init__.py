"""etrain's Python API: the same powers as the command line (docs/python-api.md).

    import etrain

    result = etrain.train("examples/tiny.toml", overrides=["train.steps=20"])   # this process (or torchrun rank)
    run = etrain.submit({"train": {"steps": 200}}, workers=2)                    # an elastic run on Ray
    run.resize(3); run.suspend(); run.resume(workers=2); final = run.wait()

A config is a TOML path, a dict shaped like the TOML document, or a ``trainer.config.RunConfig``.
Invalid input raises :class:`ConfigError` (the CLI's exit 2) before anything starts.
"""

from checkpointing.errors import CheckpointError, ConfigError, EtrainError
from trainer.config import RunConfig

from .api import Run, TrainingFailed, TrainResult, submit, train

__all__ = ["train", "submit", "Run", "TrainResult", "TrainingFailed", "RunConfig", "ConfigError",
           "CheckpointError", "EtrainError"]
