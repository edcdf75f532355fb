"""The chaos plot (``etrain chaos --plot F.png``): loss and world size over time, faults marked.

    plot("run.png", store.get_history(run_id), report["faults"], store.get_history(ref_id))

Two panels sharing the time axis (seconds since the run's first step): the loss of every step row (a
step redone after a restore shows twice) with the reference's loss at the same steps dashed, and the
world size (integer ticks). Each fault is a red line labelled with its kind, each recovery a dotted green one.
``etrain plot RUN`` (``orchestrator.plot``) draws any run, with resizes, suspends and resumes marked too.
matplotlib is imported only here and only when plotting, with the Agg backend: no display needed.
"""

from __future__ import annotations

from ..plot import integer_ticks
from ..store import HistoryRow
from .oracle import final_trajectory


def plot(path: str, history: list, rows: list[dict], ref_history: list | None = None, title: str = "") -> None:
    """Loss and world size over time, each fault (red) and recovery (green) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("the run has no step history to plot")
    history = [HistoryRow.of(h) for h in history]
    t0 = min(h.unix for h in history)
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    ax1.plot([h.unix - t0 for h in history], [h.loss for h in history], ".-", ms=3, label="loss")
    if ref_history:
        traj = final_trajectory(history)
        rt = final_trajectory(ref_history)
        xs = [traj[s].unix - t0 for s in sorted(traj) if s in rt]
        ax1.plot(xs, [rt[s].loss for s in sorted(traj) if s in rt], "--", lw=1, label="reference (by step)")
    ax2.step([h.unix - t0 for h in history], [h.world_size for h in history], where="post", label="world size")
    for r in rows:
        for ax in (ax1, ax2):
            ax.axvline(r["injected_unix"] - t0, color="red", lw=1, alpha=0.7)
            if r["time_to_recover_s"] is not None:
                ax.axvline(r["injected_unix"] + r["time_to_recover_s"] - t0, color="green", lw=1, ls=":")
        ax1.annotate(r["kind"], (r["injected_unix"] - t0, ax1.get_ylim()[1]), fontsize=7, rotation=90,
                     va="top", color="red")
    ax1.set_ylabel("loss")
    ax2.set_ylabel("world size")
    integer_ticks(ax2)
    ax2.set_xlabel("seconds since the first step")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(title or "chaos run: faults (red), recoveries (green)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
