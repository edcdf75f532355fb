"""The orchestrator's sections of a run config: ``[elastic]`` (how it sizes and heals the group, and what it
claims of a shared cluster) and ``[recovery]`` (the memory tier a recovery or a resize restores from).

    raw = load_raw("examples/tiny.toml", ["elastic.workers=4"])
    ecfg = elastic_from_raw(raw, workers=3)   # command-line flags override the file
    rcfg = recovery_from_raw(raw)
    spec.sharing                              # Sharing: priority, team, ... (sharing_from_raw of the spec's config)

This module is the only reader of the raw ``[elastic]`` and ``[recovery]``
tables, and :class:`ElasticConfig` holds the one default of each key. The
run spec carries ``[elastic]``'s claims on a shared cluster as a typed
:class:`Sharing` (``RunSpec.sharing``); the allocator, the queue, the status
and the CLI read that value. The sizes are the spec's own (``workers``,
``min_workers``, ``max_workers``, ``target``): resizes change them.

It lives in the same TOML file as the trainer's sections; the trainer skips
it (``trainer.config.FOREIGN_SECTIONS``). Checks that need the trainer's
config (which sizes the global batch and tp x pp allow) run in
:func:`check_sizes`, before anything starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from checkpointing.errors import ConfigError
from checkpointing.recovery.budget import DEFAULT_FRACTION, NO_BOUND
from trainer.config import RunConfig, check_finite
from trainer.config.checks import MAX_RANKS
from trainer.config.load import build_section

# [elastic]'s claims on a shared cluster: what the run spec carries as a Sharing (the rest are sizes and timings).
# A team's name ([elastic] team, `etrain quota TEAM`, `etrain grant --teams`): 1-63 letters, digits, _ . -
TEAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
SHARING_KEYS = ("priority", "preemptible", "team", "queue_timeout_s", "grow_into_idle", "min_node_labels",
                "elastic_node_labels", "cpus_per_worker", "gpus_per_worker")


@dataclass(frozen=True, kw_only=True)
class Sharing:
    """What a run claims of a shared cluster (``[elastic]``, docs/service.md): who goes first (``priority``),
    whether it may give workers back (``preemptible``), whose quota counts it (``team``), how long it may wait
    in QUEUED (``queue_timeout_s``, 0: for ever), whether idle capacity may grow it above ``workers``
    (``grow_into_idle``), where its workers go (node labels) and what each takes. Made only from a validated
    :class:`ElasticConfig` (``ElasticConfig.sharing``, :func:`sharing_from_raw`), so its defaults are that
    class's."""

    priority: int
    preemptible: bool
    team: str
    queue_timeout_s: float
    grow_into_idle: bool
    min_node_labels: str
    elastic_node_labels: str
    cpus_per_worker: float
    gpus_per_worker: float

    @property
    def gang_labels(self) -> dict[str, str]:
        """The labels the minimum's gang is placed on (``min_node_labels`` as Ray's selector)."""
        return node_labels(self.min_node_labels, "elastic.min_node_labels")

    @property
    def elastic_labels(self) -> dict[str, str]:
        """The labels the workers beyond the minimum are placed on (``elastic_node_labels``)."""
        return node_labels(self.elastic_node_labels, "elastic.elastic_node_labels")


@dataclass(kw_only=True)
class ElasticConfig:
    workers: int = 2  # the size to run at (the requested size)
    min_workers: int = 1  # below this the run waits for capacity instead of training
    max_workers: int = 0  # 0: the same as workers
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = -1.0  # -1: one GPU each when the cluster has GPUs, else none
    hang_timeout_s: float = 0.0  # 0: derived, max(30 s, 20 x the median step time)
    replace_wait_s: float = 0.0  # after a failure, wait this long for replacements before going on smaller
    standby: int = 0  # warm spare workers kept started beyond the group: a failure or a grow uses one at once
    boot_timeout_s: float = 120.0  # wait this long for workers that got resources and are still starting
    max_failures: int = 20
    backoff_s: float = 0.0  # first delay between recovery attempts; doubles with each recent failure
    store: str = ""  # "": the embedded store beside the checkpoints
    # Sharing a cluster (docs/service.md): who goes first, who may give workers back, whose quota counts it,
    # and how long the run may wait in QUEUED for its minimum (0: for ever).
    priority: int = 0  # higher first
    preemptible: bool = True  # may be shrunk toward min_workers, or suspended and requeued, for a higher priority
    team: str = "default"  # the quota (`etrain quota TEAM --max-workers N`) its workers count against
    # The cluster's allocator may grow the run above `workers` into idle capacity, up to max_workers; false: only
    # its user's resizes take it above `workers` (max_workers then bounds what `etrain resize` may ask).
    grow_into_idle: bool = True
    queue_timeout_s: float = 0.0
    # Ray node labels ("key=value,key=value") the minimum's gang and the elastic part must be placed on,
    # e.g. the minimum on "ray.io/market-type=on-demand" and the rest on "ray.io/market-type=spot"; "": anywhere.
    min_node_labels: str = ""
    elastic_node_labels: str = ""

    def __post_init__(self) -> None:
        for name in ("workers", "min_workers", "max_workers", "standby"):  # before any size is computed from them
            if getattr(self, name) > MAX_RANKS:
                raise ConfigError(f"elastic.{name}={getattr(self, name)} is above {MAX_RANKS:_} workers, the most a "
                                  "run may name; give a size the cluster can hold")
        if self.max_workers == 0:
            self.max_workers = max(self.workers, self.min_workers)
        if self.min_workers < 1:
            raise ConfigError(f"elastic.min_workers={self.min_workers} must be >= 1")
        if self.max_workers < self.min_workers:
            raise ConfigError(f"elastic.max_workers={self.max_workers} is below elastic.min_workers="
                              f"{self.min_workers}; raise max_workers or lower min_workers")
        if not self.min_workers <= self.workers <= self.max_workers:
            raise ConfigError(f"elastic.workers={self.workers} (--workers) is outside [elastic.min_workers, elastic.max_workers] = "
                              f"[{self.min_workers}, {self.max_workers}]; pick a size in that range or widen it")
        if self.standby < 0:
            raise ConfigError(f"elastic.standby={self.standby} must be >= 0 (warm spare workers)")
        check_finite(self, "elastic")
        if self.cpus_per_worker < 0:
            raise ConfigError(f"elastic.cpus_per_worker={self.cpus_per_worker} must be >= 0")
        if self.gpus_per_worker < 0 and self.gpus_per_worker != -1:
            raise ConfigError(f"elastic.gpus_per_worker={self.gpus_per_worker} must be >= 0, or -1 for one GPU "
                              "each when the cluster has GPUs")
        for name in ("hang_timeout_s", "replace_wait_s", "boot_timeout_s", "backoff_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"elastic.{name}={getattr(self, name)} must be >= 0")
        if self.max_failures < 0:
            raise ConfigError(f"elastic.max_failures={self.max_failures} must be >= 0")
        if self.queue_timeout_s < 0:
            raise ConfigError(f"elastic.queue_timeout_s={self.queue_timeout_s} must be >= 0 (0: wait for ever)")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool) or abs(self.priority) > 10**6:
            raise ConfigError(f"elastic.priority={self.priority!r} must be an integer in [-1000000, 1000000] "
                              "(higher first; 0 by default)")
        for name in ("preemptible", "grow_into_idle"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"elastic.{name}={getattr(self, name)!r} must be true or false")
        for name in ("min_node_labels", "elastic_node_labels"):
            node_labels(getattr(self, name), f"elastic.{name}")
        if not isinstance(self.team, str) or not TEAM_NAME.fullmatch(self.team):
            raise ConfigError(f"elastic.team={self.team!r} must be a name of letters, digits, '_', '.' or '-' "
                              "(at most 63, starting with a letter or digit)")

    @property
    def sharing(self) -> Sharing:
        return Sharing(**{k: getattr(self, k) for k in SHARING_KEYS})


LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_./-]{0,251}[A-Za-z0-9])?")


def node_labels(text: str, field: str = "elastic.min_node_labels") -> dict[str, str]:
    """``"key=value,key=value"`` as Ray's label selector ({} for ""); ConfigError naming ``field`` otherwise."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not LABEL.fullmatch(key) or not LABEL.fullmatch(value):
            raise ConfigError(f"{field}={text!r}: {part!r} is not key=value with Ray label characters; give e.g. "
                              "\"ray.io/market-type=on-demand\" (several joined by commas)")
        out[key] = value
    return out


@dataclass(kw_only=True)
class RecoveryConfig:
    """The memory tier (docs/operations.md#recovery-tiers): every rank's training state in host memory,
    its own and copies in peers', restored from by a recovery or a resize before the durable checkpoint."""

    memory_every_steps: int = 1  # snapshot after every N-th step (0: no memory tier; recoveries use storage)
    replicas: int = 1  # peers holding a copy of each rank's snapshot, on other nodes where there are any
    # Host bytes per rank the tier may hold; over it, it turns off for the group. 0: derived from the host's
    # available memory when the group forms (memory_budget_fraction of it, shared by the ranks on the host);
    # -1: no bound (checkpointing.recovery.budget).
    memory_budget_bytes: int = 0
    memory_budget_fraction: float = DEFAULT_FRACTION
    resize_through_storage: bool = False  # a resize saves and loads the durable checkpoint instead of memory

    def __post_init__(self) -> None:
        for name in ("memory_every_steps", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"recovery.{name}={value!r} must be an integer >= 0"
                                  + (" (0: no memory tier)" if name == "memory_every_steps" else ""))
        value = self.memory_budget_bytes
        if not isinstance(value, int) or isinstance(value, bool) or value < NO_BOUND:
            raise ConfigError(f"recovery.memory_budget_bytes={value!r} must be an integer: bytes per rank, 0 to "
                              "derive it from the host's available memory (memory_budget_fraction), -1 for no bound")
        value = self.memory_budget_fraction
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                or not 0 < value <= 1):
            raise ConfigError(f"recovery.memory_budget_fraction={value!r} must be a number in (0, 1]: the share of "
                              "the host's available memory the tier may hold")

    @property
    def enabled(self) -> bool:
        return self.memory_every_steps > 0


@dataclass(frozen=True)
class GroupTier:
    """What the members of a group need to start their memory tier: ``[recovery]`` as the controller parsed
    it, and each rank's node (the failure domains the copies spread over, the ranks sharing a host's memory).
    Sent to every member with ``TrainWorker.form``."""

    settings: RecoveryConfig
    nodes: tuple[str, ...] = ()

    def ranks_on_host(self, rank: int, world_size: int) -> int:
        """The ranks of the group on ``rank``'s node (every rank when the nodes are not known)."""
        if rank >= len(self.nodes):
            return world_size
        return sum(1 for n in self.nodes if n == self.nodes[rank])


def recovery_from_raw(raw: dict) -> RecoveryConfig:
    """``[recovery]`` of a raw run document."""
    return build_section("recovery", RecoveryConfig, raw.get("recovery", {}))


def _elastic_table(raw: dict) -> dict:
    table = raw.get("elastic", {})
    if not isinstance(table, dict):
        raise ConfigError("[elastic] must be a table")
    return table


def sharing_from_raw(raw: dict) -> Sharing:
    """``[elastic]``'s claims on a shared cluster of a raw run document, validated (ConfigError naming the key);
    its sizes are left out: a run's sizes are its spec's."""
    table = {k: v for k, v in _elastic_table(raw).items() if k in SHARING_KEYS}
    return build_section("elastic", ElasticConfig, table).sharing


def elastic_from_raw(raw: dict, *, workers: int | None = None, min_workers: int | None = None,
                     max_workers: int | None = None) -> ElasticConfig:
    """``[elastic]`` of a raw run document, with command-line flags taking precedence."""
    table = dict(_elastic_table(raw))
    for key, value, flag in (("workers", workers, "--workers"), ("min_workers", min_workers, "--min-workers"),
                             ("max_workers", max_workers, "--max-workers")):
        if value is not None:
            if not 1 <= value <= MAX_RANKS:
                raise ConfigError(f"{flag} {value} (elastic.{key}) must be in [1, {MAX_RANKS:_}]")
            table[key] = value
    if workers is not None and max_workers is None and "max_workers" in table and table["max_workers"] < workers:
        table["max_workers"] = workers  # --workers beyond the file's max raises the max, as asked
    return build_section("elastic", ElasticConfig, table)


def allowed_sizes(cfg: RunConfig, min_workers: int, max_workers: int) -> list[int]:
    """Group sizes in [min_workers, max_workers] that the layout and the global batch allow."""
    # The layout's rules import torch: not at this module's import, which the CLI's listings make.
    from trainer.parallel.dims import valid_world_sizes

    return [n for n in valid_world_sizes(cfg, max_workers) if n >= min_workers]


def check_sizes(cfg: RunConfig, ecfg: ElasticConfig) -> list[int]:
    """The sizes this run may take; ConfigError naming the valid ones, and the rule that refused, if the request is
    not among them."""
    from trainer.parallel.dims import size_refusal, valid_world_sizes, why_no_size

    allowed = allowed_sizes(cfg, ecfg.min_workers, ecfg.max_workers)
    if not allowed:
        raise ConfigError(f"no group size in [{ecfg.min_workers}, {ecfg.max_workers}] works for this run: "
                          f"{why_no_size(cfg, ecfg.min_workers, ecfg.max_workers)}; valid sizes up to "
                          f"{ecfg.max_workers}: {valid_world_sizes(cfg, ecfg.max_workers) or 'none'}")
    if ecfg.workers not in allowed:
        raise ConfigError(f"--workers {ecfg.workers} is not a valid size for this run; valid sizes in "
                          f"[{ecfg.min_workers}, {ecfg.max_workers}]: {allowed} (elastic.workers; at "
                          f"{ecfg.workers}, {size_refusal(cfg, ecfg.workers)})")
    return allowed
