"""The project's exceptions.

Every error etrain raises on purpose derives from :class:`EtrainError`, so a
caller can tell "etrain refused this, and said why" from a crash. The classes
live here, in the lowest package, because dependencies point one way
(``orchestrator -> trainer -> checkpointing``) and all three raise them.

Exceptions cross process and Ray actor boundaries, so each keeps the plain
``Exception(message)`` signature that pickles without help.
"""

from __future__ import annotations


class EtrainError(Exception):
    """Base class of every error etrain raises on purpose."""


class ConfigError(EtrainError, ValueError):
    """A run configuration or command-line value is invalid.

    The message names the field (``parallel.tp``) and says how to fix it.
    """


class CheckpointError(EtrainError):
    """A checkpoint could not be written, found, verified or loaded."""


class StorageError(CheckpointError):
    """Object storage kept failing after the bounded retries."""


class FencedError(EtrainError):
    """A writer from an older epoch tried to commit; it was refused."""


class UnsafePathError(CheckpointError):
    """A storage key would leave the storage root (``..``, an absolute path, a control character)."""
