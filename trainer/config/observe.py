"""``[metrics]`` and ``[logging]``: the Prometheus endpoint and the experiment trackers."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Literal

from checkpointing.errors import ConfigError
from checkpointing.names import check_url

from .checks import check_finite

MLFLOW_CREDENTIALS = ("give MLflow its credentials in the environment instead: MLFLOW_TRACKING_USERNAME and "
                      "MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN")


_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def is_host(addr: str) -> bool:
    """Whether ``addr`` is an IPv4/IPv6 address or a well-formed host name (RFC 1123; not resolved)."""
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        pass
    labels = addr.removesuffix(".").split(".")
    return (len(addr) <= 253 and all(_LABEL.fullmatch(x) for x in labels)
            and not labels[-1].isdigit())  # 999.1.1.1 is a bad address, not a name


@dataclass(kw_only=True)
class MetricsConfig:
    """The run's Prometheus endpoint (docs/metrics.md). Served by the controller on Ray and by
    rank 0 under torchrun."""

    enabled: bool = True
    # Address and port of the endpoint; port 0 picks a free one. Printed at start.
    addr: str = "127.0.0.1"
    port: int = 0
    # Directory of Prometheus file_sd target files ("" = $ETRAIN_PROMETHEUS_DIR, else ~/.etrain/prometheus;
    # "-" = write none).
    file_sd_dir: str = ""
    # Time every collective (calls, bytes, seconds, bus bandwidth); off leaves torch.distributed untouched.
    comm: bool = True
    # How often ranks send their communication and memory figures.
    every_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"metrics.port={self.port} must be 0 (a free port) or a port number up to 65535")
        check_finite(self, "metrics")
        if self.every_s <= 0:
            raise ConfigError(f"metrics.every_s={self.every_s} must be > 0 (seconds between rank reports)")
        if not self.addr:
            raise ConfigError('metrics.addr is empty; use "127.0.0.1", or "0.0.0.0" to listen on every interface')
        if not is_host(self.addr):
            raise ConfigError(f"metrics.addr={self.addr!r} is neither an IP address nor a host name; use "
                              '"127.0.0.1" (this machine only), the node\'s address or host name, or "0.0.0.0" '
                              "to listen on every interface")


@dataclass(kw_only=True)
class LoggingConfig:
    """Experiment trackers (docs/metrics.md#trackers), each optional (``pip install etrain[trackers]``).
    Rank 0 logs to them under torchrun, the controller on Ray; a tracker that fails is disabled, never the run."""

    tensorboard_dir: str = ""  # TensorBoard event files under <dir>/<run_id>
    wandb_project: str = ""  # Weights & Biases project; wandb_mode "offline" needs no network
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_dir: str = ""  # where W&B keeps its run directories ("" = its default, ./wandb)
    mlflow_uri: str = ""  # MLflow tracking URI: file:///…/mlruns, sqlite:///…, http://host:5000
    experiment: str = ""  # the MLflow experiment ("" = "etrain")
    # The final flush of the trackers' queued records waits at most this long (seconds); a tracker that
    # has not finished by then is left behind, and the run says how many records it did not send.
    flush_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check_finite(self, "logging")
        if self.flush_timeout_s < 0:
            raise ConfigError(f"logging.flush_timeout_s={self.flush_timeout_s} must be >= 0 (seconds the final "
                              "flush of the trackers may take)")
        check_url(self.mlflow_uri, "logging.mlflow_uri", fix=MLFLOW_CREDENTIALS)
        for fld in ("tensorboard_dir", "wandb_dir"):  # TensorBoard writes to fsspec URLs too (s3://...)
            check_url(getattr(self, fld), f"logging.{fld}")
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise ConfigError(f'logging.wandb_mode={self.wandb_mode!r} must be "offline", "online" or "disabled"')
        import importlib.util

        for fld, module in (("tensorboard_dir", "tensorboard"), ("wandb_project", "wandb"), ("mlflow_uri", "mlflow")):
            if getattr(self, fld) and importlib.util.find_spec(module) is None:
                raise ConfigError(f"logging.{fld} is set but {module} is not installed; install the extra "
                                  f"(pip install 'etrain[trackers]') or unset logging.{fld}")
