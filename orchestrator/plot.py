"""``etrain plot RUN [-o run.png]``: a run as a picture, live or finished.

    series = run_series(store.get_history(run_id), store.events(run_id), seq_len=64)   # what is drawn
    series = log_series([json.loads(line) for line in open("steps.jsonl")])           # a torchrun step log
    draw("run.png", series, title="run tiny")

Loss (and eval loss), throughput and world size, each over steps (left) and
over time (right, seconds since the first step), with every failure,
recovery, resize, suspend and resume marked by a vertical line of its own
colour. The world-size axis has integer ticks. :func:`run_series` and
:func:`log_series` return the plotted data, so that a test can check it
without reading pixels. Under Ray the data is the run store's step history
(written by the controller every 30 s while the run goes on, so a live run
shows up to that write; each row holds its step's tokens/s and, on the steps
that evaluated, the eval loss) and its events (for an older run's history,
whose rows hold neither, throughput is derived from the samples each row
consumed and the eval loss read from its ``eval`` events); under torchrun
it is the step log (``--log-file``), where a step going back is a restart
from a checkpoint and a new world size a resize.
matplotlib is imported only when drawing, with the Agg backend: no display needed.
"""

from __future__ import annotations

from checkpointing.errors import EtrainError

from .store.run_store import HistoryRow

# What each mark is drawn as: colour and line style.
MARKS = {"failure": ("red", "-"), "recovery": ("green", ":"), "resize": ("purple", "--"),
         "suspend": ("gray", "-."), "resume": ("tab:blue", "-.")}
# Run events (orchestrator.controller.controller, orchestrator.controller.states) as marks; a second "started" is a resume.
_EVENT_MARKS = {"failure": "failure", "failed": "failure", "recovered": "recovery", "resized": "resize",
                "suspended": "suspend"}


def _throughput(rows: list[HistoryRow], seq_len: int | None) -> tuple[list[float | None], str]:
    """Each row's throughput and its unit: the tokens/s the row holds (rows written since they hold it),
    else derived: the samples the row consumed over its time, times ``seq_len`` (tokens/s) when known."""
    derived: list[float | None] = []
    prev = None
    for h in rows:
        if prev is not None and h.step == prev.step + 1 and h.samples_consumed >= prev.samples_consumed:
            samples = h.samples_consumed - prev.samples_consumed
        else:  # the first row, or one after a restore: the run's mean batch
            samples = h.samples_consumed / h.step if h.step else 0
        derived.append(samples * (seq_len or 1) / h.step_s if h.step_s > 0 and samples else None)
        prev = h
    if all(h.tokens_per_s is None for h in rows):  # an older run's history
        return derived, "tokens/s" if seq_len else "samples/s"
    return [h.tokens_per_s if h.tokens_per_s is not None else d if seq_len else None
            for h, d in zip(rows, derived)], "tokens/s"


def _step_at(rows: list[HistoryRow], unix: float) -> int:
    """The step the run had completed at ``unix`` (the last row that ended by then)."""
    done = [h.step for h in rows if h.unix <= unix]
    return done[-1] if done else (rows[0].step if rows else 0)


def event_marks(history: list, events: list[dict], t0: float | None = None) -> list[dict]:
    """The run's events as marks (``kind`` of :data:`MARKS`, ``step``, ``time`` in seconds since ``t0``, by default
    the first step's end): failures, recoveries, resizes, suspends, and a second ``started`` as a resume.
    ``etrain plot`` and ``etrain chaos --plot`` both draw these."""
    rows = [HistoryRow.of(h) for h in history]
    t0 = min(h.unix for h in rows) if t0 is None else t0
    marks = []
    for e in sorted(events, key=lambda e: e.get("time", 0)):
        kind, when = e.get("kind"), float(e.get("time", t0))
        if kind == "started":
            if when <= t0:  # the run's own start, before its first step
                continue
            kind = "resume"
        else:
            kind = _EVENT_MARKS.get(kind)
        if kind is None:
            continue
        step = e.get("step") if isinstance(e.get("step"), int) else _step_at(rows, when)
        marks.append({"kind": kind, "step": step, "time": when - t0})
    return marks


def _evals(rows: list[HistoryRow], events: list[dict], t0: float) -> list[tuple[int, float, float]]:
    """(step, time, loss) of every evaluation: the eval loss the history rows hold, and the ``eval`` events
    of steps without one (an older run's history holds none)."""
    out = [(h.step, h.unix - t0, float(h.eval_loss)) for h in rows if h.eval_loss is not None]
    held = {step for step, _, _ in out}
    for e in events:
        if e.get("kind") == "eval" and isinstance(e.get("loss"), (int, float)):
            when = float(e.get("time", t0))
            step = int(e.get("step") or _step_at(rows, when))
            if step not in held:
                at = next((h.unix for h in rows if h.step == step), when)
                out.append((step, at - t0, float(e["loss"])))
    return sorted(out, key=lambda e: e[1])


def run_series(history: list, events: list[dict], *, seq_len: int | None = None) -> dict:
    """What ``etrain plot`` draws of a run in the run store: per history row ``step``, ``time`` (seconds since
    the first step), ``loss``, ``world_size``, ``throughput`` (the rows' tokens/s; for an older run's rows,
    derived: tokens/s given ``seq_len``, else samples/s); ``eval`` as (step, time, loss); ``marks`` as dicts of
    ``kind``, ``step``, ``time`` (:func:`event_marks`)."""
    rows = [HistoryRow.of(h) for h in history]
    if not rows:
        raise ValueError("the run has no step history to plot yet (the controller writes it every 30 s)")
    t0 = min(h.unix for h in rows)
    throughput, unit = _throughput(rows, seq_len)
    return {"step": [h.step for h in rows], "time": [h.unix - t0 for h in rows], "loss": [h.loss for h in rows],
            "world_size": [h.world_size for h in rows], "throughput": throughput, "throughput_unit": unit,
            "eval": _evals(rows, events, t0), "marks": event_marks(rows, events, t0)}


def log_series(records: list[dict]) -> dict:
    """The same, from a torchrun step log (``python -m trainer --log-file``; ``StepStats`` and ``time``):
    a step at or below the one before is a restart from a checkpoint (a recovery), a new world size a resize."""
    if not records:
        raise ValueError("the step log is empty")
    t0 = min(r["time"] for r in records)
    marks, prev = [], None
    for r in records:
        if prev is not None and r["step"] <= prev["step"]:
            marks.append({"kind": "recovery", "step": r["step"], "time": r["time"] - t0})
        if prev is not None and r["world_size"] != prev["world_size"]:
            marks.append({"kind": "resize", "step": r["step"], "time": r["time"] - t0})
        prev = r
    return {"step": [r["step"] for r in records], "time": [r["time"] - t0 for r in records],
            "loss": [r["loss"] for r in records], "world_size": [r["world_size"] for r in records],
            "throughput": [r.get("tokens_per_s") for r in records], "throughput_unit": "tokens/s",
            "eval": [(r["step"], r["time"] - t0, r["eval_loss"]) for r in records if r.get("eval_loss") is not None],
            "marks": marks}


def integer_ticks(ax) -> None:
    """Integer ticks only (a world size of 2.5 does not exist)."""
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def draw_marks(axes, marks: list[dict], x: str = "time") -> None:
    """Each mark as a vertical line at its ``x`` (``step`` or ``time``) on every one of ``axes``, in its
    :data:`MARKS` colour and style; the first of each kind labelled on the first axes (for its legend)."""
    seen = set()
    for m in marks:
        colour, style = MARKS[m["kind"]]
        for i, ax in enumerate(axes):
            ax.axvline(m[x], color=colour, ls=style, lw=1, alpha=0.8,
                       label=m["kind"] if i == 0 and m["kind"] not in seen else None)
        seen.add(m["kind"])


def check_output(path: str) -> str:
    """``path`` if a picture can be written there: a format matplotlib writes (by its extension) in an
    existing, writable directory; an EtrainError naming ``-o`` and the fix otherwise."""
    import os

    from matplotlib.backend_bases import FigureCanvasBase

    if os.path.isdir(path):
        raise EtrainError(f"-o {path!r} is a directory; give a file name such as {path.rstrip('/')}/run.png")
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in formats:
        raise EtrainError(f"-o {path!r}: unknown picture format {ext or '(no extension)'!r}; end the name with one "
                          f"of {', '.join('.' + f for f in sorted(formats))}, e.g. run.png")
    where = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(where) or not os.access(where, os.W_OK):
        raise EtrainError(f"-o {path!r} cannot be written: {where} is not a writable directory; create it or "
                          "give another path")
    return path


def draw(path: str, series: dict, title: str = "") -> None:
    """Loss and eval loss, throughput and world size, over steps (left) and time (right), events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, sharex="col", figsize=(13, 8))
    for col, x in enumerate(("step", "time")):
        xs = series[x]
        loss_ax, tput_ax, world_ax = axes[:, col]
        loss_ax.plot(xs, series["loss"], ".-", ms=2, lw=1, label="loss")
        if series["eval"]:
            loss_ax.plot([e[col] for e in series["eval"]], [e[2] for e in series["eval"]], "o-", ms=4,
                         label="eval loss")
        points = [(a, b) for a, b in zip(xs, series["throughput"]) if b is not None]
        tput_ax.plot([a for a, _ in points], [b for _, b in points], ".", ms=2)
        world_ax.step(xs, series["world_size"], where="post")
        integer_ticks(world_ax)
        draw_marks(axes[:, col], series["marks"], x)
        loss_ax.legend(loc="upper right", fontsize=7)
        world_ax.set_xlabel("step" if col == 0 else "seconds since the first step")
    axes[0, 0].set_ylabel("loss")
    axes[1, 0].set_ylabel(series["throughput_unit"])
    axes[2, 0].set_ylabel("world size")
    fig.suptitle(title or "run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
