"""What ``etrain run`` shows while a run goes on: a live bar, events as lines, a summary at the end.

    with Follower(run_id, total_steps=cfg.train.steps, live=True) as f:
        f.update(snapshot, new_events)     # as often as you like

On a terminal the bar shows step, loss, eval loss, tokens/s, world size, phase, time elapsed and
``ETA`` (none once the run is ending); in a pipe or a log (``ray job logs``, CI) it prints one plain
line every few seconds instead, with steps/s (over the steps since the line before) and the ETA. Events the user wants to see (failures,
recoveries, resizes, evaluations: ``[eval] step 40 eval loss 4.1230``, the memory tier turning off or
falling back to the checkpoint) are lines of their own in both.

Text read back from a run store (reasons, events, team names, owners) is shown through :func:`printable`
(or, in a table, :func:`cell`): control characters and escape sequences are written out as ``\\x1b``,
never sent to the terminal, and rich markup in it is shown as it is, never interpreted.

    print(printable(status["reason"], multiline=True))     # table.add_row(cell(row["team"]), ...)
"""

from __future__ import annotations

import re
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from checkpointing.recovery.budget import human_bytes
from trainer.cli import clock, human
from trainer.observe.trackers import TrackerNotice

from ..phase import TERMINAL, Phase
from ..store.documents import finite

# A run in these phases has no time left to show: it is ending (stopping, suspending) or has ended.
ENDING = TERMINAL | {Phase.FINISHING, Phase.SUSPENDING}


# What a terminal would act on rather than show: C0 and C1 controls (ESC among them), DEL, Unicode's line and
# paragraph separators and bidirectional overrides, and lone surrogates (which no terminal encoding takes).
_OTHER = "\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_CONTROL = re.compile(f"[\x00-\x1f{_OTHER}]")
_CONTROL_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f{_OTHER}]")


def printable(value, multiline: bool = False) -> str:
    """``value`` as text to show: its control characters written out (``\\x1b``, ``\\u202e``); newlines
    kept with ``multiline``."""
    text = value if isinstance(value, str) else str(value)
    pattern = _CONTROL_BUT_NEWLINE if multiline else _CONTROL
    return pattern.sub(_written_out, text)


def _written_out(m: re.Match) -> str:
    code = ord(m[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def cell(value, limit: int = 120) -> Text:
    """A table cell holding stored text: :func:`printable`, at most ``limit`` characters, never rich markup."""
    text = printable(value)
    return Text(text if len(text) <= limit else text[:limit - 1] + "…")


def fixed(value, spec: str) -> str:
    """A finite number formatted by ``spec``; anything else as it is (``-`` for None)."""
    return "-" if value is None else format(value, spec) if finite(value) else printable(value)


class _Eta(TimeRemainingColumn):
    """``ETA 0:05:35`` while the run goes on, nothing once it is ending or has ended (stopped or suspended early,
    no time is left); the bar sets its task's ``ended`` field."""

    def __call__(self, task):
        return Text("") if task.fields.get("ended") else super().__call__(task)

    def render(self, task):
        return Text.assemble("ETA ", super().render(task))


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (``| head -1``): raised on, to end as every etrain listing does
        (``checkpointing.cli.quiet_when_pipe_closes``), not rich's own exit 1."""
        self.quiet = True
        raise BrokenPipeError


def listing_console() -> Console:
    """The console of a listing (``etrain status``): the terminal's width on a terminal; in a pipe or a
    log, 200 columns, so that no column is cut to fit a width that is not there."""
    console = _Console()
    return console if console.is_terminal else _Console(width=200)


def from_tier(e: dict) -> str:
    """Where a recovery or resize restored from; with why, when a restore from memory was not possible."""
    tier = e.get("tier")
    if tier == "memory":
        return " from memory"
    if tier == "durable":
        return " from the checkpoint" + (f" ({e['tier_reason']})" if e.get("tier_reason") else "")
    return ""


def tier_event_line(e: dict) -> str:
    """A ``memory_tier`` event (docs/operations.md#recovery-tiers) as a line."""
    action, step = e.get("action"), e.get("step")
    sizes = all(isinstance(e.get(k), int) and finite(e[k]) for k in ("bytes", "budget_bytes"))
    if action in ("off", "refused") and sizes:
        over = (f"rank {e.get('rank')} would hold {human_bytes(e['bytes'])}, over its budget of "
                f"{human_bytes(e['budget_bytes'])} ([recovery] memory_budget_bytes)")
        if action == "off":
            return f"[memory tier] off at step {step}: {over}; recoveries restore from the checkpoint"
        return f"[memory tier] snapshot of step {step} refused: {over}; the resize commits a checkpoint"
    if action == "fallback":
        return f"[memory tier] step {step} from the checkpoint, not memory: {e.get('reason')}"
    return f"[memory tier] {action}: {e.get('reason')}"


def tier_status_line(status: dict) -> str | None:
    """``etrain status RUN``'s line on the memory tier (the status' ``memory_tier``), :func:`printable`; None
    when it has none."""
    t = status.get("memory_tier")
    if not isinstance(t, dict):
        return None
    if t.get("state") == "disabled":
        return "memory tier: off ([recovery] memory_every_steps = 0)"
    line = (f"memory tier: off since step {t.get('since_step')} ({t.get('reason')})" if t.get("state") == "off"
            else f"memory tier: on, budget {t.get('describe')}")
    if t.get("fallbacks"):
        line += f"; {t['fallbacks']} restore(s) from the checkpoint instead (last: {t.get('last_fallback')})"
    return printable(line)


def health_status_line(status: dict) -> str | None:
    """``etrain status RUN``'s line on [health]: the newest verified step and the samples skipped; None without."""
    v, skipped = status.get("verified_step"), status.get("skipped_ranges")
    if v is None and not skipped:
        return None
    line = f"health: last verified step {v}" if v is not None else "health: no verified step yet"
    if isinstance(skipped, list) and skipped:
        shown = ", ".join(f"[{r[0]}, {r[1]})" for r in skipped[:4] if isinstance(r, list) and len(r) == 2)
        line += f"; samples skipped as the data's fault: {shown}{' ...' if len(skipped) > 4 else ''}"
    return printable(line)


def describe_event(e: dict) -> str | None:
    """One line for the events a user wants to see as they happen; None for the rest."""
    k = e.get("kind")
    if k == "memory_tier":
        return tier_event_line(e)
    if k == "failure":
        return f"[failure] step {e.get('step')}: {e.get('failure_kind')}: {e.get('message')} -> {e.get('decision')}"
    if k == "recovered":
        return (f"[recovered] epoch {e.get('epoch')}: {e.get('world_before')} -> {e.get('world_after')} workers, "
                f"restored step {e.get('restored_step')}{from_tier(e)}, {e.get('steps_lost')} steps lost, "
                f"{e.get('time_to_recover_s')} s to recover")
    if k == "resized":
        return (f"[resized] {e.get('from_workers')} -> {e.get('to_workers')} workers at step {e.get('step')} "
                f"in {e.get('resize_s')} s{from_tier(e)} ({e.get('reason')})")
    if k == "eval" and finite(e.get("loss")):
        return f"[eval] step {e.get('step')} eval loss {e['loss']:.4f}"
    if k == "checkpoint_failed":
        return f"[checkpoint] step {e.get('step')} failed: {e.get('error')}"
    if k == "suspended":
        return f"[suspended] at step {e.get('step')} (checkpoint committed: {e.get('checkpoint_committed')})"
    if k == "failed":
        return f"[failed] {e.get('reason')}"
    if k == "tracker" and isinstance(e.get("tracker"), str) and isinstance(e.get("state"), str):
        fields = {f: e[f] for f in TrackerNotice.__dataclass_fields__ if f in e}
        try:
            return f"[tracker] {TrackerNotice(**fields).text()}"
        except (TypeError, ValueError, OverflowError):  # a field of the wrong type: the plain event line
            return None
    if k == "sdc":  # [health] (docs/operations.md#silent-faults)
        where = f" on rank {e.get('rank')} ({e.get('node')})" if e.get("rank") is not None else ""
        skipped = f": samples [{e['samples'][0]}, {e['samples'][1]}) skipped" if isinstance(e.get("samples"), list) \
            and len(e["samples"]) == 2 else ""
        return f"[sdc] {e.get('verdict')} fault at step {e.get('step')}{where}{skipped}"
    if k == "rollback":
        return (f"[rollback] from step {e.get('from_step')} to verified step {e.get('to_step')} in "
                f"{e.get('seconds')} s ({e.get('steps_reworked')} steps replayed)")
    if k == "quarantine":
        refused = f"; refused: {e['refused']}" if e.get("refused") else ""
        return f"[quarantine] node {short_ids(e.get('node'))} ({e.get('reason')}){refused}"
    if k == "metrics":
        where = f" (Prometheus target file {e['file_sd']})" if e.get("file_sd") else ""
        return f"[metrics] {e.get('url')}{where}"
    return None


def short_ids(v):
    """Ray's 56-hex-digit node ids (and lists of them) cut to their first 8 digits, as ``ray status`` shows them."""
    if isinstance(v, list):
        return [short_ids(x) for x in v]
    if isinstance(v, str) and len(v) == 56 and all(c in "0123456789abcdef" for c in v):
        return v[:8]
    return v


def event_line(e: dict) -> str:
    """Any event as one line: :func:`describe_event`'s, else its fields (node ids shortened); :func:`printable`."""
    return printable(describe_event(e) or f"[{e.get('kind')}] " + ", ".join(
        f"{k}={short_ids(v)}" for k, v in sorted(e.items()) if k not in ("kind", "time")))


class Follower:
    def __init__(self, run_id: str, total_steps: int | None, live: bool = True, console: Console | None = None,
                 every_s: float = 5.0):
        self.console = console or Console(stderr=False)
        self.total = total_steps or None
        self.run_id = run_id
        self.live = live and self.console.is_terminal
        self.every_s = every_s
        self._last_line = 0.0
        self._last_phase = None
        self.progress = Progress(TextColumn("[bold]{task.fields[run]}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), _Eta(),
                                 console=self.console, transient=False) if self.live else None
        self.task = None
        self._rate_from: tuple[float, int] | None = None  # (time, step) of the first step seen, for the ETA
        self._window: tuple[float, int] = (0.0, 0)  # (time, step) of the line before, for the steps/s shown

    def __enter__(self) -> Follower:
        if self.progress is not None:
            self.progress.start()
            self.task = self.progress.add_task("run", total=self.total, run=self.run_id, info="starting", ended=False)
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, snap: dict | None, events: list[dict]) -> None:
        for e in events:
            line = describe_event(e)
            if line:
                self.console.print(printable(line), markup=False, highlight=False, soft_wrap=True)
        if not snap:
            return
        info = info_line(snap)
        if self.progress is not None:
            self.progress.update(self.task, completed=snap.get("step") or 0, info=info,
                                 ended=Phase.of(snap) in ENDING)
            return
        now = time.monotonic()
        step = snap.get("step") or 0
        if self._rate_from is None and step:
            self._rate_from = (now, step)
        if snap.get("phase") != self._last_phase or now - self._last_line >= self.every_s:
            self._last_phase, self._last_line = snap.get("phase"), now
            self.console.print(printable(f"{self.run_id} step {step}/{snap.get('total_steps')}  {info}"
                                         f"{self._eta(now, snap)}"),
                               markup=False, highlight=False, soft_wrap=True)  # a log line is never wrapped
            self._window = (now, step)

    def _eta(self, now: float, snap: dict) -> str:
        """``  2.10 steps/s  ETA 1:05``: steps/s over the steps since the line before (as tokens/s is recent,
        the last step's), the ETA from the steps seen so far (restarts included); "" once every step is done or
        the run is ending or has ended (stopped or suspended early)."""
        if self._rate_from is None or not snap.get("total_steps") or (snap.get("step") or 0) >= snap["total_steps"] \
                or Phase.of(snap) in ENDING:
            return ""
        step = snap.get("step") or 0
        t, s = self._rate_from
        rate = (step - s) / (now - t) if now > t else 0.0
        if rate <= 0:
            return ""
        wt, ws = max(self._window, self._rate_from)  # the later of the line before and the first step seen
        recent = (step - ws) / (now - wt) if now > wt and step > ws else rate
        return f"  {recent:.2f} steps/s  ETA {clock((snap['total_steps'] - step) / rate)}"


def info_line(snap: dict) -> str:
    loss = snap.get("loss")
    tps = snap.get("tokens_per_s")
    ev = snap.get("eval_loss")
    return (f"loss {loss:.4f}  " if loss is not None else "") + \
           (f"eval {ev:.4f}  " if ev is not None else "") + \
           (f"{human(tps, 'tok/s')}  " if tps else "") + f"world {snap.get('world_size')}  {snap.get('phase')}"


def status_table(rows: list[dict]) -> Table:
    """``etrain status``: a row per run; a ``store`` column when the rows name their store (the list of runs).
    Every stored text is a :func:`cell`."""
    stores = any("store" in s for s in rows)
    t = Table("run", "phase", "step", "world", "loss", "eval loss", "checkpoint", "recoveries", "steps lost", "goodput",
              "updated", *(["store"] if stores else []))
    for s in rows:
        updated = s.get("updated_unix")
        age = time.time() - updated if finite(updated) and updated else None
        t.add_row(cell(s.get("run_id", "?")), cell(s.get("phase", "?")),
                  cell(f"{s.get('step', '-')}/{s.get('total_steps', '-')}"), cell(s.get("world_size", "-")),
                  fixed(s.get("loss"), ".4f"), fixed(s.get("eval_loss"), ".4f"),
                  cell(s.get("latest_checkpoint") if s.get("latest_checkpoint") is not None else "-"),
                  cell(s.get("recoveries", 0)), cell(s.get("steps_lost", 0)), fixed(s.get("goodput"), ".2f"),
                  f"{age:.0f} s ago" if age is not None else "-", *([cell(s.get("store", "-"))] if stores else []))
    return t
