"""Where a run's store is when a command does not name one, for every command alike.

    store_url_for(None)                                    # $ETRAIN_STORE, else ./runs as a file:// URL
    store_url_for("etcd://10.0.0.5:2379/etrain")           # --store wins; ConfigError if it carries credentials
    store_url_for(None, ecfg, "s3://bucket/runs")          # [elastic] store, then the checkpoint root

The order: ``--store``, ``$ETRAIN_STORE``, ``[elastic] store``, the run's ``checkpoint.url``, then
:func:`default_root` (``./runs`` of the directory the command runs in). Light: the control commands
(``etrain status``, ``resize``, ...) import it without the driver, the controller, torch or Ray.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from checkpointing.names import check_url

if TYPE_CHECKING:
    from ..config import ElasticConfig


def default_root() -> str:
    """Where runs keep checkpoints and control documents when nothing else is said."""
    return f"file://{os.path.abspath('runs')}"


def store_url_for(explicit: str | None, ecfg: ElasticConfig | None = None, checkpoint_url: str = "") -> str:
    """--store, then $ETRAIN_STORE, then [elastic].store, then the checkpoint root, then ./runs.
    ConfigError, naming where it came from, if that URL carries credentials."""
    for url, source in ((explicit, "--store"), (os.environ.get("ETRAIN_STORE"), "$ETRAIN_STORE"),
                        (ecfg.store if ecfg else "", "elastic.store"), (checkpoint_url, "checkpoint.url")):
        if url:
            return check_url(url, source)
    return default_root()
