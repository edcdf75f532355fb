"""``[profile]``: which steps and ranks torch.profiler traces, and where the traces go.

    [profile]
    enabled = true
    steps = [5, 7]        # the step log's steps 5, 6 and 7 (first and last, inclusive)
    ranks = [0]           # global ranks that trace
    dir = "profile"       # traces in <dir>/<run_id>/, a local directory

or ``--set profile.enabled=true --set profile.steps=[5,7]``. :mod:`trainer.observe.profile` does the
tracing; disabled (the default), nothing of it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from checkpointing.errors import ConfigError

from .checks import MAX_RANKS, check_range

# The largest step number profile.steps may name (a typo's 10**12 is refused at load, not waited for).
MAX_STEP = 2**62


@dataclass(kw_only=True)
class ProfileConfig:
    """torch.profiler over a range of steps on some ranks (docs/operations.md#profiling)."""

    enabled: bool = False
    # [first, last]: the steps traced, numbered as the step log numbers them (1 = the first step), inclusive.
    steps: list[int] = field(default_factory=lambda: [5, 7])
    # The global ranks that trace; the others never start a profiler.
    ranks: list[int] = field(default_factory=lambda: [0])
    # A local directory (relative to the process's working directory); traces go to <dir>/<run_id>/.
    dir: str = "profile"

    def __post_init__(self) -> None:
        if len(self.steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.steps):
            raise ConfigError(f"profile.steps={self.steps!r:.80} must be [first, last], two step numbers, "
                              "e.g. [5, 7] for steps 5, 6 and 7")
        first, last = self.steps
        check_range("profile", "steps", first, 1, MAX_STEP, "step numbers start at 1")
        check_range("profile", "steps", last, 1, MAX_STEP, "step numbers start at 1")
        if first > last:
            raise ConfigError(f"profile.steps=[{first}, {last}] must be [first, last] with first <= last, "
                              f"e.g. [{last}, {first}]")
        if not self.ranks:
            raise ConfigError("profile.ranks is empty; name the ranks that trace, e.g. [0] or [0, 1]")
        for r in self.ranks:
            if isinstance(r, bool) or not isinstance(r, int):
                raise ConfigError(f"profile.ranks={self.ranks!r:.80} must be a list of rank numbers, e.g. [0]")
            check_range("profile", "ranks", r, 0, MAX_RANKS - 1, "global rank numbers")
        if len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"profile.ranks={self.ranks!r:.80} names a rank twice; name each once")
        if not self.dir:
            raise ConfigError('profile.dir is empty; give a local directory, e.g. "profile"')
        if "://" in self.dir:
            raise ConfigError(f"profile.dir={self.dir!r:.80} is a URL; the profiler writes local files: give a "
                              "local directory (on a cluster, one each node can write, e.g. a shared mount)")

    @property
    def first(self) -> int:
        return self.steps[0]

    @property
    def last(self) -> int:
        return self.steps[1]
