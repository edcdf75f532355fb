"""Chaos engineering for etrain runs: inject faults into a live run, then judge it (``etrain chaos``).

    from orchestrator.chaos.plan import load_plan
    from orchestrator.chaos.injector import Chaos
    from orchestrator.chaos.cli import judge

    plan = load_plan("chaos.toml")
    chaos = Chaos(run_id, store, plan)
    final = chaos.run(timeout_s=3600)                       # until the run ends
    result = judge(run_id, store, plan, chaos, final, "ref")  # result["passed"], result["reasons"]

One job a module (docs/chaos.md is the user's guide):

    plan       the plan: FaultSpec, ChaosPlan, load_plan (TOML and --fault flags)
    injector   Chaos, the injection loop, and the signals it sends to processes and nodes
    etcd       EtcdControl: the etcd_outage fault
    netns      Ray nodes in network namespaces, the links partition_node cuts
               (``python -m orchestrator.chaos.netns bridge|node|down``)
    procfs     the /proc process table: children, parent, environment, kill a process tree
    oracle     the verdict: the run trained what a failure-free reference trains
    report     detection and recovery of each fault, and the report
    plot       the loss and world size over time, faults marked
    cli        ``etrain chaos``: reference_run, judge, main

The names below are re-exported for the callers that import them from the package. The package
does not import ``netns``: ``python -m orchestrator.chaos.netns`` imports this package first, and runs
``netns`` only if it is not in sys.modules yet.
"""

from .cli import judge, main, reference_run
from .injector import Chaos, Injection
from .oracle import final_trajectory, loss_rel_diff, oracle, stale_commits, verify_committed
from .plan import ChaosPlan, FaultSpec, load_plan
from .plot import plot
from .report import assess, format_report, report

__all__ = ["Chaos", "ChaosPlan", "FaultSpec", "Injection", "assess", "final_trajectory", "format_report", "judge",
           "load_plan", "loss_rel_diff", "main", "oracle", "plot", "reference_run", "report", "stale_commits",
           "verify_committed"]
