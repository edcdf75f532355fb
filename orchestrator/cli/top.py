"""``etrain top RUN``: a live terminal view of a run's metrics, read from its Prometheus endpoint.

    etrain top RUN [--store URL] [--interval 2] [--once] [--url http://host:port/metrics]

The endpoint's address comes from the run's status in the run store
(``metrics_url``) unless ``--url`` names it; either must be an ``http://`` or
``https://`` URL (anything else, ``file://`` among them, is refused naming
where it came from, and a redirect elsewhere is not followed). A scrape waits
at most 5 s and reads at most :data:`MAX_SCRAPE_BYTES` (8 MiB); a bigger answer,
or one that is not Prometheus text, counts as no answer. Labels and names
from the endpoint are shown as text (never rich markup, no control character).
Rates (bytes/s, calls/s, mean latency) are the change between two scrapes
``--interval`` seconds apart.
``--once`` prints one frame and exits: 0 when the endpoint answered, 1 when
it did not (a run that ended no longer serves one; ``etrain status`` has its
final figures).
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from collections import defaultdict
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from checkpointing.errors import ConfigError
from checkpointing.names import redact

from ..driver.progress import cell, printable

Samples = dict[tuple[str, tuple], float]
MAX_SCRAPE_BYTES = 8 * 2**20  # a run's endpoint serves a few hundred KiB at most
# What a scrape that failed raises: no answer, an HTTP error, an answer too big or not Prometheus text.
SCRAPE_ERRORS = (OSError, ValueError, http.client.HTTPException)


def metrics_endpoint(url: str, where: str) -> str:
    """``url`` if it is an http(s) URL with a host; ConfigError naming ``where`` (the status field or the flag)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}={printable(redact(url))[:200]!r} is not an http:// or https:// URL; etrain top "
                          "reads a run's Prometheus endpoint over HTTP only")
    return url


class _SameScheme(urllib.request.HTTPRedirectHandler):
    """Redirects followed only to another http(s) URL."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlsplit(newurl).scheme not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, f"redirect to a URL that is not http(s): {msg}", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_SameScheme)


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """The samples of the endpoint at ``url``: one GET of at most :data:`MAX_SCRAPE_BYTES`, within ``timeout``
    seconds a read; one of :data:`SCRAPE_ERRORS` when it does not answer so."""
    with _OPENER.open(url, timeout=timeout) as r:
        body = r.read(MAX_SCRAPE_BYTES + 1)
    if len(body) > MAX_SCRAPE_BYTES:
        raise ValueError(f"its answer is over {MAX_SCRAPE_BYTES // 2**20} MiB, more than a metrics endpoint serves")
    out: Samples = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _number_first(value: str) -> tuple:
    """A sort key of a label that is a number (a rank, a layer) in the endpoint's own samples, or not."""
    return (0, int(value), "") if value.isdigit() else (1, 0, value)


def _get(s: Samples, name: str, **labels) -> float | None:
    want = {k: str(v) for k, v in labels.items()}
    for (n, ls), v in s.items():
        if n == name and want.items() <= dict(ls).items():
            return v
    return None


def _by(s: Samples, name: str, *keys: str) -> dict[tuple, float]:
    """Values of ``name`` summed by the labels ``keys``."""
    out: dict[tuple, float] = defaultdict(float)
    for (n, ls), v in s.items():
        if n == name:
            d = dict(ls)
            out[tuple(d.get(k, "") for k in keys)] += v
    return out


def _si(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= factor:
            return f"{v / factor:.2f} {prefix}{unit}"
    return f"{v:.3g} {unit}".rstrip()


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.1f}"


def _fmt(v: float | None, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def render(cur: Samples, prev: Samples | None, dt: float, status: dict | None = None) -> Group:
    """One frame: the run, communication, memory, checkpoints, recovery."""
    st = status or {}
    phase = next((dict(ls).get("phase", "?") for (n, ls), v in cur.items() if n == "etrain_phase" and v == 1), "?")
    run_id = next((dict(ls).get("run_id") for (n, ls) in cur if n == "etrain_step"), st.get("run_id", "?"))
    head = Table(title=cell(f"etrain top: {run_id}"), show_header=True, expand=False)
    for col in ("phase", "step", "verified", "world", "epoch", "loss", "tokens/s", "lr", "grad norm",
                "step s (mean)", "goodput", "MFU"):
        head.add_column(col, justify="right")
    steps_rate = None
    if prev is not None:
        a, b = _get(cur, "etrain_step_seconds_sum"), _get(prev, "etrain_step_seconds_sum")
        ca, cb = _get(cur, "etrain_step_seconds_count"), _get(prev, "etrain_step_seconds_count")
        if None not in (a, b, ca, cb) and ca > cb:
            steps_rate = (a - b) / (ca - cb)
    total = st.get("total_steps")
    step = _get(cur, "etrain_step")
    head.add_row(cell(phase), f"{_fmt(step, '.0f')}" + (f"/{total}" if total else ""),
                 _fmt(_get(cur, "etrain_verified_step"), ".0f"),  # [health]: the newest verified step
                 _fmt(_get(cur, "etrain_world_size"), ".0f"),
                 _fmt(_get(cur, "etrain_epoch"), ".0f"), _fmt(_get(cur, "etrain_loss")),
                 _si(_get(cur, "etrain_tokens_per_second")), _fmt(_get(cur, "etrain_learning_rate"), ".2e"),
                 _fmt(_get(cur, "etrain_grad_norm")), _fmt(steps_rate, ".3f"),
                 _fmt(_get(cur, "etrain_goodput_ratio"), ".3f"), _fmt(_get(cur, "etrain_mfu_ratio"), ".3f"))

    comm = Table(title=f"communication (all ranks, last {dt:.1f} s)", expand=False)
    for col in ("kind", "axis", "calls/s", "bytes/s", "busbw/rank", "mean latency", "bytes total"):
        comm.add_column(col, justify="right")
    calls = _by(cur, "etrain_comm_calls_total", "kind", "axis")
    nbytes = _by(cur, "etrain_comm_bytes_total", "kind", "axis")
    secs = _by(cur, "etrain_comm_seconds_sum", "kind", "axis")
    cnt = _by(cur, "etrain_comm_seconds_count", "kind", "axis")
    bw_sum = _by(cur, "etrain_comm_bus_bandwidth_bytes_per_second", "kind", "axis")
    bw_n = defaultdict(int)
    for (n, ls) in cur:
        if n == "etrain_comm_bus_bandwidth_bytes_per_second":
            d = dict(ls)
            bw_n[(d["kind"], d["axis"])] += 1
    p_calls = _by(prev, "etrain_comm_calls_total", "kind", "axis") if prev else {}
    p_bytes = _by(prev, "etrain_comm_bytes_total", "kind", "axis") if prev else {}
    p_secs = _by(prev, "etrain_comm_seconds_sum", "kind", "axis") if prev else {}
    p_cnt = _by(prev, "etrain_comm_seconds_count", "kind", "axis") if prev else {}
    for key in sorted(calls):
        def rate(d, p, key=key):
            return (d[key] - p.get(key, 0.0)) / dt if prev and dt > 0 else None

        dn = cnt[key] - p_cnt.get(key, 0.0) if prev else 0
        lat = (secs[key] - p_secs.get(key, 0.0)) / dn if dn > 0 else (secs[key] / cnt[key] if cnt[key] else None)
        bw = bw_sum[key] / bw_n[key] if bw_n.get(key) else None
        comm.add_row(cell(key[0]), cell(key[1]), _fmt(rate(calls, p_calls), ".1f"), _si(rate(nbytes, p_bytes), "B/s"),
                     _si(bw, "B/s"), _si(lat, "s"), _si(nbytes[key], "B"))

    mem_rows = _by(cur, "etrain_memory_bytes", "rank", "kind")
    kinds = sorted({k for _, k in mem_rows})
    mem = Table(title="memory per rank (MiB)", expand=False)
    mem.add_column("rank", justify="right")
    for k in kinds:
        mem.add_column(cell(k), justify="right")
    for rank in sorted({r for r, _ in mem_rows}, key=_number_first):
        mem.add_row(cell(rank), *[_mib(mem_rows.get((rank, k))) for k in kinds])

    ck = Table(title="checkpoints and recovery", expand=False)
    for col in ("last commit", "age s", "throughput", "saves", "save failures", "blocking s (mean)", "failures",
                "recoveries", "recover s (mean)", "detect s (mean)", "steps lost"):
        ck.add_column(col, justify="right")

    def mean(name):
        n, s = _get(cur, f"{name}_count"), _get(cur, f"{name}_sum")
        return s / n if n else None

    failures = _by(cur, "etrain_failures_total", "kind")
    ck.add_row(_fmt(_get(cur, "etrain_checkpoint_last_committed_step"), ".0f"),
               _fmt(_get(cur, "etrain_checkpoint_age_seconds"), ".1f"),
               _si(_get(cur, "etrain_checkpoint_throughput_bytes_per_second"), "B/s"),
               _fmt(_get(cur, "etrain_checkpoint_saves_total"), ".0f"),
               _fmt(_get(cur, "etrain_checkpoint_failures_total"), ".0f"),
               _fmt(mean("etrain_checkpoint_blocking_seconds"), ".3f"),
               cell(", ".join(f"{k[0]} {v:.0f}" for k, v in sorted(failures.items())) or "0"),
               _fmt(_get(cur, "etrain_recoveries_total"), ".0f"), _fmt(mean("etrain_time_to_recover_seconds"), ".2f"),
               _fmt(mean("etrain_time_to_detect_seconds"), ".2f"), _fmt(_get(cur, "etrain_steps_lost_total"), ".0f"))
    experts = _experts(cur)
    return Group(head, comm, mem, ck, *([experts] if experts is not None else []))


def _experts(cur: Samples) -> Table | None:
    """A Mixture of Experts' routing in the newest step (None for a dense model): per MoE layer its busiest and
    idlest expert by routed slots, with the run's imbalance, aux loss and dropped slots."""
    per = _by(cur, "etrain_moe_tokens_per_expert", "layer", "expert")
    if not per and _get(cur, "etrain_moe_imbalance_ratio") is None:
        return None
    imbalance = _fmt(_get(cur, "etrain_moe_imbalance_ratio"), ".2f")
    dropped = _fmt(_get(cur, "etrain_moe_dropped_tokens"), ".0f")
    t = Table(title=f"experts (imbalance {imbalance}, aux loss {_fmt(_get(cur, 'etrain_moe_aux_loss'))}, "
                    f"dropped {dropped})", expand=False)
    for col in ("layer", "busiest expert", "slots", "idlest expert", "slots", "max / mean"):
        t.add_column(col, justify="right")
    for layer in sorted({lay for lay, _ in per}, key=_number_first):
        mine = {e: v for (lay, e), v in per.items() if lay == layer}
        hi, lo = max(mine, key=mine.get), min(mine, key=mine.get)
        mean = sum(mine.values()) / len(mine)
        t.add_row(cell(layer), cell(hi), f"{mine[hi]:.0f}", cell(lo), f"{mine[lo]:.0f}",
                  _fmt(mine[hi] / mean if mean else None, ".2f"))
    return t


def endpoint_of(run: str, store) -> tuple[str | None, dict | None]:
    """The run's metrics endpoint (its status' ``metrics_url``, checked: :func:`metrics_endpoint`) and status."""
    store.get_spec(run)  # UnknownRun names the fix
    st = store.get_status(run)
    url = (st or {}).get("metrics_url")
    return (metrics_endpoint(url, f"the status of run {run!r}: metrics_url") if url else None), st


def main(args, store) -> int:
    url, status = (metrics_endpoint(args.url, "--url"), None) if args.url else endpoint_of(args.run, store)
    console = Console()
    if not console.is_terminal:  # a pipe or a log: keep every column whole
        console = Console(width=200)

    def say(text: str) -> None:
        console.print(printable(text), markup=False, highlight=False)

    if not url:
        say(f"etrain: run {args.run!r} has no metrics endpoint (phase {(status or {}).get('phase', '?')}; "
            "metrics.enabled may be off, or it has not started yet)")
        return 1
    try:
        prev, t_prev = scrape(url), time.monotonic()
        if args.once:
            time.sleep(args.interval)
            cur = scrape(url)
            console.print(render(cur, prev, time.monotonic() - t_prev, status))
            return 0
    except SCRAPE_ERRORS as e:
        say(f"etrain: the endpoint {redact(url)} does not answer ({e}); a run that ended serves none: "
            f"`etrain status {args.run or ''}` has its final figures")
        return 1
    with Live(render(prev, None, 0.0, status), console=console, refresh_per_second=2, screen=False) as live:
        while True:
            time.sleep(args.interval)
            try:
                cur, now = scrape(url), time.monotonic()
            except SCRAPE_ERRORS:
                say(f"the endpoint {redact(url)} stopped answering: the run ended or its controller moved")
                return 0
            live.update(render(cur, prev, now - t_prev, status))
            prev, t_prev = cur, now
