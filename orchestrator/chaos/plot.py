"""The chaos plot (``etrain chaos --plot F.png``): loss and world size over time, faults and run events marked.

    plot("run.png", store.get_history(run_id), report["faults"], store.get_history(ref_id), store.events(run_id))

Two panels sharing the time axis (seconds since the run's first step): the loss of every step row (a
step redone after a restore shows twice) with the reference's loss at the same steps dashed, and the
world size (integer ticks). Each injected fault is a thick orange line labelled with its kind; the run's
events are marked as ``etrain plot`` marks them (:func:`orchestrator.plot.event_marks`, ``draw_marks``):
failures red, recoveries dotted green, resizes dashed purple, suspends and resumes dash-dotted.
matplotlib is imported only here and only when plotting, with the Agg backend: no display needed.
"""

from __future__ import annotations

from ..plot import draw_marks, event_marks, integer_ticks
from ..store.run_store import HistoryRow
from .oracle import final_trajectory

FAULT_COLOUR = "darkorange"


def plot(path: str, history: list, rows: list[dict], ref_history: list | None = None,
         events: list[dict] | None = None, title: str = "") -> list[dict]:
    """Loss and world size over time, each injected fault (report rows) and each failure, recovery, resize,
    suspend and resume of ``events`` marked; returns the marks drawn (``kind``, ``step``, ``time``), faults
    as ``kind`` "fault" with the fault's kind as ``fault``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("the run has no step history to plot")
    history = [HistoryRow.of(h) for h in history]
    t0 = min(h.unix for h in history)
    marks = event_marks(history, events or [], t0)
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    ax1.plot([h.unix - t0 for h in history], [h.loss for h in history], ".-", ms=3, label="loss")
    if ref_history:
        traj = final_trajectory(history)
        rt = final_trajectory(ref_history)
        xs = [traj[s].unix - t0 for s in sorted(traj) if s in rt]
        ax1.plot(xs, [rt[s].loss for s in sorted(traj) if s in rt], "--", lw=1, label="reference (by step)")
    ax2.step([h.unix - t0 for h in history], [h.world_size for h in history], where="post", label="world size")
    faults = [{"kind": "fault", "fault": r["kind"], "step": r.get("step"), "time": r["injected_unix"] - t0}
              for r in rows]
    for i, f in enumerate(faults):
        for ax in (ax1, ax2):
            ax.axvline(f["time"], color=FAULT_COLOUR, lw=2, alpha=0.7,
                       label="injected fault" if ax is ax1 and i == 0 else None)
        ax1.annotate(f["fault"], (f["time"], ax1.get_ylim()[1]), fontsize=7, rotation=90, va="top",
                     color=FAULT_COLOUR)
    draw_marks((ax1, ax2), marks)
    ax1.set_ylabel("loss")
    ax2.set_ylabel("world size")
    integer_ticks(ax2)
    ax2.set_xlabel("seconds since the first step")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(title or "chaos run: injected faults (orange), failures (red), recoveries (green)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return sorted(faults + marks, key=lambda m: m["time"])
