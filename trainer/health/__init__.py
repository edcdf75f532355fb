"""Silent faults: corrupted numbers and loss spikes caught within steps, rolled back in place, attributed.

``[health]`` (:class:`trainer.config.health.HealthConfig`) sets it up; :class:`HealthGuard` is the run's
guard inside the trainer (both launchers); :mod:`.detect` holds the detectors (pure), :mod:`.digest` the
digests and who must agree on them, :mod:`.response` what a run does about a fault, :mod:`.ring` the
verified snapshots, :mod:`.faults` the chaos faults.
docs/operations.md#silent-faults says what is checked and what each kind of fault does.
"""

from .detect import Finding, SpikeWindow, first_divergence, replica_findings
from .guard import HealthGuard
from .response import HealthStop, PersistentFault

__all__ = ["Finding", "HealthGuard", "HealthStop", "PersistentFault", "SpikeWindow", "first_divergence",
           "replica_findings"]
