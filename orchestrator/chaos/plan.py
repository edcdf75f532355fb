"""A chaos plan: which faults ``etrain chaos`` injects, and when.

    plan = load_plan("chaos.toml")                                   # a file ...
    plan = load_plan(None, ["kind=kill_worker,at_step=10,rank=1"])   # ... and/or --fault flags
    for spec in plan.faults: spec.kind, spec.at_step, spec.duration_s

A plan is a list of faults, each with a schedule::

    [chaos]
    seed = 1
    loss_rtol = 1e-3          # the loss curve must stay this close to the reference's, step by step

    [[fault]]
    kind = "kill_worker"      # SIGKILL one worker process
    at_step = 10              # once, when the run reaches step 10
    rank = 1                  # which rank (default: a random one)

    [[fault]]
    kind = "kill_node"        # the raylet of the node a rank runs on, and every process it started
    after_fault = 0           # 0.5 s after fault 0 was injected: a second fault during its recovery
    delay_s = 0.5

    [[fault]]
    kind = "hang_rank"        # SIGSTOP one worker: it stops answering and its peers block
    every_s = 60              # repeatedly (max_count bounds it)
    max_count = 2

    [[fault]]
    kind = "storage"          # checkpoint storage slow / failing / truncating for duration_s
    random = true             # at random times, gaps drawn from [min_gap_s, max_gap_s] (seeded)
    min_gap_s = 15
    max_gap_s = 30
    duration_s = 10
    error_rate = 0.5
    delay_s = 0.2

    [[fault]]
    kind = "etcd_outage"      # the run store's etcd stops serving for duration_s (this machine's etcd)
    at_step = 30
    duration_s = 8
    mode = "stop"             # "stop": SIGSTOP/SIGCONT; "restart": end it and start it again

    [[fault]]
    kind = "partition_node"   # cut the node a rank runs on off the network for duration_s (default 20)
    at_step = 50              # (a node in a network namespace of its own: orchestrator/chaos/netns.py)
    rank = 0

    [[fault]]
    kind = "drain_node"       # Ray drains the node a rank runs on (a spot notice): the run shrinks off it
    at_step = 60
    rank = 1
    deadline_s = 60           # the drain's deadline (the node's raylet exits once idle)

    [[fault]]
    kind = "add_node"         # a node joins the cluster: the run grows back to its requested size
    after_fault = 5
    delay_s = 10
    cpus = 1

    [[fault]]
    kind = "bitflip"          # a silent fault inside the trainer ([health]): one bit of one element flipped
    at_step = 20              # (the fault fires a few steps later: the injector's lead)
    target = "param"          # "param" (default), "grad", "optimizer" or "activation"
    rank = 1                  # default: a random one
    bit = 30                  # default: the sign or a top exponent bit, drawn from the plan's seed
    persistent = false        # true: every step from then on, replays included (a bad device)

    [[fault]]
    kind = "poison_batch"     # a step's targets shifted by half the vocabulary on every rank: the loss spikes
    at_step = 35

Invariants: a plan that loads is valid (each fault has exactly one schedule, a known kind, a positive
window; ``after_fault`` names an earlier fault; a fault inside the trainer, ``bitflip`` or
``poison_batch``, is scheduled by ``at_step`` or ``after_fault``); every problem is a ConfigError that
names the fault and the field. Tables are built and type-checked by the run config's own section builder
(``trainer.config.load.build_section``), and ``--fault`` values parse as ``--set`` values do.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields

from checkpointing.errors import ConfigError
from trainer.config.load import build_section, parse_value

KINDS = ("kill_worker", "kill_node", "hang_rank", "storage", "etcd_outage", "partition_node", "drain_node",
         "add_node", "bitflip", "poison_batch")
# The cluster changing under the run (orchestrator/controller/drain.py): a resize, never a failure.
CLUSTER_KINDS = ("drain_node", "add_node")
# Faults that take a member out of the group: the controller must see a failure and re-form without it.
PROCESS_KINDS = ("kill_worker", "kill_node", "hang_rank", "partition_node")
# Silent faults inside the trainer ([health], trainer/health/faults.py): they fire at a step, so only the
# schedules that name one (at_step, after_fault: a step or two after the fault it follows).
IN_PROCESS_KINDS = ("bitflip", "poison_batch")
WINDOW_S = {"partition_node": 20.0}  # duration_s when the plan leaves it out; 10 s for the other kinds


@dataclass(kw_only=True)
class FaultSpec:
    kind: str
    # schedule: exactly one of at_step, every_s, random, after_fault
    at_step: int | None = None
    every_s: float | None = None
    random: bool = False
    min_gap_s: float = 15.0
    max_gap_s: float = 30.0
    after_fault: int | None = None
    delay_s: float = 0.0  # after_fault: seconds after that fault; storage: added latency per request
    max_count: int = 1_000_000
    # targets and windows
    rank: int | None = None
    duration_s: float | None = None  # storage, etcd_outage, partition_node: how long the fault lasts
    error_rate: float = 0.0
    truncate_rate: float = 0.0
    mode: str = "stop"
    deadline_s: float = 60.0  # drain_node: the drain's deadline
    cpus: int = 1  # add_node: the new node's CPUs
    # bitflip: what is flipped ("param" when left out), which bit (None: drawn from the plan's seed), and
    # whether it comes back at every later step on that rank
    target: str | None = None
    bit: int | None = None
    persistent: bool = False

    def __post_init__(self) -> None:
        where = f"fault kind={self.kind!r}"
        if self.kind in ("net_partition", "partition", "network_partition"):
            raise ConfigError(f"{where} is unknown; a network partition is kind=\"partition_node\" (cuts the link of "
                              "a node in a network namespace of its own; docs/chaos.md)")
        if self.kind not in KINDS:
            raise ConfigError(f"{where} is unknown; use one of {', '.join(KINDS)}")
        schedules = [self.at_step is not None, self.every_s is not None, self.random, self.after_fault is not None]
        if sum(schedules) != 1:
            raise ConfigError(f"{where} needs exactly one schedule: at_step = N, every_s = T, random = true "
                              "(with min_gap_s, max_gap_s) or after_fault = I (with delay_s)")
        if self.every_s is not None and self.every_s <= 0:
            raise ConfigError(f"{where}: every_s={self.every_s:g} must be > 0")
        if self.random and not 0 < self.min_gap_s <= self.max_gap_s:
            raise ConfigError(f"{where}: need 0 < min_gap_s <= max_gap_s (got {self.min_gap_s:g}, {self.max_gap_s:g})")
        if self.duration_s is None:
            self.duration_s = WINDOW_S.get(self.kind, 10.0)
        if self.duration_s <= 0:
            raise ConfigError(f"{where}: duration_s={self.duration_s:g} must be > 0")
        if self.mode not in ("stop", "restart"):
            raise ConfigError(f"{where}: mode={self.mode!r}; use \"stop\" (SIGSTOP/SIGCONT) or \"restart\"")
        if self.deadline_s <= 0:
            raise ConfigError(f"{where}: deadline_s={self.deadline_s:g} must be > 0 (the drain's deadline)")
        if self.cpus < 1:
            raise ConfigError(f"{where}: cpus={self.cpus} must be >= 1 (the added node's CPUs)")
        if self.kind == "storage" and not (self.error_rate or self.truncate_rate or self.delay_s):
            raise ConfigError(f"{where}: set at least one of error_rate, truncate_rate, delay_s")
        self._check_in_process(where)

    def _check_in_process(self, where: str) -> None:
        """bitflip and poison_batch: a schedule that names a step, and bitflip's own fields."""
        if self.kind != "bitflip" and (self.target is not None or self.bit is not None or self.persistent):
            raise ConfigError(f"{where}: target, bit and persistent are bitflip's fields")
        if self.kind not in IN_PROCESS_KINDS:
            return
        for name, on in (("every_s", self.every_s is not None), ("random", self.random)):
            if on:
                raise ConfigError(f"{where}: {name} is no schedule for a fault inside the trainer (it fires at a "
                                  "step); use at_step = N or after_fault = I")
        if self.kind == "poison_batch" and self.rank is not None:
            raise ConfigError(f"{where}: rank={self.rank}: a poisoned batch is the data's, every rank trains on it; "
                              "leave rank out")
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"{where}: rank={self.rank} must be >= 0")
        if self.kind == "bitflip":
            from trainer.config.health import BITFLIP_TARGETS

            self.target = "param" if self.target is None else self.target
            if self.target not in BITFLIP_TARGETS:
                raise ConfigError(f"{where}: target={self.target!r}; use one of {', '.join(BITFLIP_TARGETS)}")
            if self.bit is not None and not 0 <= self.bit <= 63:
                raise ConfigError(f"{where}: bit={self.bit} must be a bit of the element: 0-31 for fp32, 0-15 for "
                                  "bf16 (a higher one is the element's top bit)")

    def health_fault(self, step: int, seed: int) -> dict:
        """The ``[health] faults`` entry the trainer gets (trainer/health/faults.py), firing at ``step``."""
        if self.kind == "poison_batch":
            return {"kind": "poison_batch", "step": step}
        return {"kind": "bitflip", "step": step, "target": self.target, "persistent": self.persistent, "seed": seed,
                **({"bit": self.bit} if self.bit is not None else {})}

    def storage_faults(self, seed: int) -> dict:
        return {"error_rate": self.error_rate, "truncate_rate": self.truncate_rate, "delay_s": self.delay_s,
                "seed": seed}


@dataclass(kw_only=True)
class ChaosPlan:
    faults: list[FaultSpec]
    seed: int = 0
    loss_rtol: float = 1e-3
    loss_atol: float = 1e-6

    def __post_init__(self) -> None:
        if not self.faults:
            raise ConfigError("the chaos plan has no [[fault]]; add one, or pass --fault kind=...,at_step=N")
        for i, f in enumerate(self.faults):
            if f.after_fault is not None and not 0 <= f.after_fault < i:
                raise ConfigError(f"fault {i}: after_fault={f.after_fault} must name an earlier fault (0..{i - 1})")


FAULT_KEYS = frozenset(f.name for f in fields(FaultSpec))
SETTINGS = ("seed", "loss_rtol", "loss_atol")  # the [chaos] table: ChaosPlan's fields but the faults


def _parse_flag(text: str) -> dict:
    """``--fault kind=kill_worker,at_step=10`` as a [[fault]] table; values parse as ``--set`` values do."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ConfigError(f"--fault {text!r}: {part!r} must look like key=value")
        k, v = part.split("=", 1)
        out[k.strip()] = parse_value(v.strip())
    return out


def _fault(i: int, table: dict) -> FaultSpec:
    bad = set(table) - FAULT_KEYS
    if bad:
        raise ConfigError(f"fault {i}: unknown key(s) {', '.join(sorted(bad))}; known: {', '.join(sorted(FAULT_KEYS))}")
    if "kind" not in table:
        raise ConfigError(f"fault {i}: kind is missing; use one of {', '.join(KINDS)}")
    return build_section(f"fault[{i}]", FaultSpec, table)


def load_plan(path: str | None, flags: list[str] | None = None) -> ChaosPlan:
    """A plan from a TOML file and/or ``--fault key=value,...`` flags; ConfigError names the field."""
    raw: dict = {}
    if path:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    unknown = set(raw) - {"chaos", "fault"}
    if unknown:
        raise ConfigError(f"chaos plan: unknown section(s) {', '.join(sorted(unknown))}; use [chaos] and [[fault]]")
    tables = list(raw.get("fault", [])) + [_parse_flag(t) for t in flags or []]
    faults = [_fault(i, table) for i, table in enumerate(tables)]
    top = raw.get("chaos", {})
    bad = set(top) - set(SETTINGS)
    if bad:
        raise ConfigError(f"[chaos]: unknown key(s) {', '.join(sorted(bad))}; known: {', '.join(SETTINGS)}")
    return build_section("chaos", ChaosPlan, {**top, "faults": faults})
