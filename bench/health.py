"""Silent faults: seeded bit flips and poisoned batches, caught, rolled back, attributed, and what the checks cost.

    python bench/health.py [--quick] [--seed 0] [--parts injections,clean,overhead,checkpoints] [--rows FILE]
    python bench/health.py --parts injections --from-rows FILE     # the summary of a run's saved rows again

Every run is the tiny model of tests/trainer/test_health.py (``BASE``: seq_len 16, global batch 8, fp32,
``health.check_every_steps=8``) in real gloo groups of 4 processes (tests.harness.run_ranks), many runs in
one process group, a fresh Trainer each (``bench/health_jobs.py``):

* **injections**, per layout (ZeRO 0, 1, 2, 3, HSDP = ZeRO-3 x 2 replicas, TP 2; and DDP at world 2): bit
  flips drawn from ``--seed`` (rank, step 1-24, target param / grad / optimizer / activation, bit 0-31 uniform,
  the leaf and element from the fault's own seed), one-shot or ``persistent``, in 24-step runs; and poisoned
  batches (``poison_batch``) at a step drawn from 40-46 of 48. Each flip is trained twice: with [health]
  on (its verdicts, rollbacks, where it ended and its state against the clean run's), and with the checks off
  (``check_every_steps=0``), the counterfactual: the flip **changes the trained state** when that run ends
  with a state whose largest relative L2 distance to the clean run's over the model and optimizer tensors,
  ``||x - ref|| / ||ref||``, exceeds ``TOLERANCE`` (1e-6), or not finite, or stopped by a non-finite loss;
  else it is **harmless** (bit for bit equal, or within the tolerance). A poisoned batch counts as
  state-changing (assumed, not trained again with the checks off); its reference is the run that skips its
  samples.
* **localization**: over state-changing flips, the fraction whose transient verdicts all name the injected
  rank (or whose PersistentFault does); ``missed``: state-changing flips with no verdict at all. Apart:
  single owner (ZeRO-3; ZeRO-1/2 optimizer state), two peers (HSDP, DDP at world 2), other (the rest: ZeRO-0
  and ZeRO-1/2 param / grad / activation at world 4, TP).
* **attribution**: state-changing one-shot flips with a ``transient`` verdict (and none other), persistent
  flips that raise PersistentFault (naming a rank or not), poisoned batches with a ``data`` verdict listing
  their samples.
* **false positives**: clean runs (fp32 ZeRO-2, bf16 HSDP, fp32 TP), any sdc / spike / rollback event.
* ``by_tolerance``: the counts and accuracies again with tolerances 1e-4 and 1e-2 (how small the changes of
  the missed flips are).
* **detect_to_training_s**: from the finding (the held step, or the check that found it) to the end of the
  first replayed step, instrumented on rank 0 (wrappers on the guard's instance); beside it the restore alone
  and the rollback event's ``seconds`` (restore and replay back to the step that showed the fault).
* **overhead**: ZeRO-3 at world 4, Trainers with ``check_every_steps`` 0, 16 and 1 driven through
  ``run_steps`` in alternating rounds of 16 steps: ``overhead_ratio`` = the median over rounds of a round's
  mean step (slowest rank) with checks every 16 over without; ``overhead_accounted`` = 1 + the seconds per
  step spent inside the guard's own calls (rank 0) over the step without checks, which the load of a shared
  machine moves far less.
* **checkpoints**: fault runs with ``checkpoint.url=file://`` every 4 steps; every committed step is loaded
  (``CheckpointManager.load``, the repo's reader) beside the clean run's same step and compared bit for bit.

``--quick``: 36 injections at world 4 (per layout 4 one-shot flips, 1 persistent, 1 poisoned batch) and 4 at
world 2, clean runs of 200 steps, 6 overhead rounds, 4 checkpoint cases (about 15 minutes here); else 300 at
world 4 (40, 6, 4 per layout) and 24 at world 2, clean runs of 2,000 steps, 12 rounds, 8 checkpoint cases
(about 90 minutes here).
Human lines, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.harness import RankFailure, run_ranks  # noqa: E402

GLOBAL_BATCH = 8
BASE = ["data.max_bytes=20000", "data.seq_len=16", f"train.global_batch={GLOBAL_BATCH}", "train.micro_batch=2",
        "train.warmup_steps=2", "metrics.enabled=false", "health.check_every_steps=8"]
CHECK_EVERY = 8
TOLERANCE = 1e-6  # max over tensors of ||x - ref|| / ||ref||: above it, a flip changed the trained state
LAYOUTS = {"zero0": ["parallel.zero_stage=0"], "zero1": ["parallel.zero_stage=1"],
           "zero2": ["parallel.zero_stage=2"], "zero3": ["parallel.zero_stage=3"],
           "hsdp": ["parallel.zero_stage=3", "parallel.dp_replicate=2"], "tp": ["parallel.tp=2"],
           "ddp2": ["parallel.zero_stage=0"]}
WORLD = {"ddp2": 2}
TARGETS = ("param", "grad", "optimizer", "activation")
FLIP_STEPS, POISON_STEPS = 24, 48


def group_of(layout: str, target: str) -> str:
    if layout == "zero3" or (layout in ("zero1", "zero2") and target == "optimizer"):
        return "single_owner"
    if layout in ("hsdp", "ddp2"):
        return "two_peers"
    return "other"


def draw_cases(seed: int, layout: str, transient: int, persistent: int, poison: int) -> list[dict]:
    world = WORLD.get(layout, 4)
    cases = []
    for i, kind in enumerate(["transient"] * transient + ["persistent"] * persistent + ["poison"] * poison):
        rng = random.Random(f"{seed}:{layout}:{i}")
        if kind == "poison":
            fault, steps = {"kind": "poison_batch", "step": rng.randint(40, POISON_STEPS - 2)}, POISON_STEPS
        else:
            fault = {"kind": "bitflip", "step": rng.randint(1, FLIP_STEPS), "rank": rng.randrange(world),
                     "target": rng.choice(TARGETS), "bit": rng.randrange(32), "seed": rng.randrange(1 << 31)}
            if kind == "persistent":
                fault["persistent"] = True
            steps = FLIP_STEPS
        cases.append({"id": f"{layout}-{i}", "layout": layout, "steps": steps, "fault": fault})
    return cases


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_job(target: str, world: int, payload: dict, timeout: float, failures: list) -> list[dict]:
    """The job's rows (as it wrote them, also when it failed); a failure is noted with the case it was on."""
    fd, out = tempfile.mkstemp(prefix="etrain-bench-health-", suffix=".jsonl")
    os.close(fd)
    try:
        run_ranks(target, world, {**payload, "out": out}, timeout=timeout)
    except RankFailure as e:
        rows = _read(out)
        started = [r["start"] for r in rows if "start" in r]
        finished = {r.get("id", r.get("name")) for r in rows}
        on = next((s for s in reversed(started) if s not in finished), None)
        failures.append({"job": target, "on": on, "error": str(e)[:300]})
        print(f"  ! {target} failed on {on}: {str(e).splitlines()[0][:200]}", flush=True)
    rows = _read(out)
    os.remove(out)
    return rows


# --- the verdicts of one injection -------------------------------------------------------------------


def judge(row: dict, tol: float = TOLERANCE) -> dict:
    f = row["fault"]
    poison = f["kind"] == "poison_batch"
    fired = bool(row["fired"])
    verdicts = [s["verdict"] for s in row["sdc"]]
    raised = (row["error"] or "").startswith("PersistentFault")
    detected = bool(verdicts) or raised
    u = row.get("unguarded_vs_ref")
    if poison:
        changing, harmless_kind = True, None
    else:
        changing = bool(row.get("unguarded_error")) or u["max_rel"] > tol
        harmless_kind = None if changing else ("bitwise" if u["bitwise"] else "within_tolerance")
    if poison:
        expected = "data"
        want = [(f["step"] - 1) * GLOBAL_BATCH, f["step"] * GLOBAL_BATCH]  # the samples of the poisoned step
        attributed = "data" in verdicts and "persistent" not in verdicts and not row["error"] and \
            any(s["verdict"] == "data" and s["samples"] == want for s in row["sdc"])
        localized = None
    elif f.get("persistent"):
        expected = "persistent"
        attributed = raised  # PersistentFault, naming a rank or not ("on no one rank": two peers that differ)
        localized = raised and row["persistent_rank"] == f["rank"]
    else:
        expected = "transient"
        attributed = bool(verdicts) and set(verdicts) == {"transient"} and not row["error"]
        ranks = [s["rank"] for s in row["sdc"] if s["verdict"] == "transient"]
        localized = bool(ranks) and all(r == f["rank"] for r in ranks) and not raised
    got = "persistent" if raised else ("/".join(dict.fromkeys(verdicts)) or "none")
    return {"fired": fired, "changing": changing, "harmless": harmless_kind, "detected": detected,
            "expected": expected, "got": got, "attributed": attributed, "localized": localized,
            "group": None if poison else group_of(row["layout"], f.get("target", "param")),
            "ended_equal": row["guarded_vs_ref"]["bitwise"], "error": row["error"]}


def _frac(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def _unguarded(r: dict) -> str:
    """What the flip did with the checks off."""
    u = r["unguarded_vs_ref"]
    return (r["unguarded_error"] or "")[:60] or f"max_rel {u['max_rel']:.2g} ({u['worst']})"


def summarize(rows: list[dict], tol: float = TOLERANCE) -> dict:
    js = [(r, judge(r, tol)) for r in rows]
    flips = [(r, j) for r, j in js if r["fault"]["kind"] == "bitflip" and j["fired"]]
    changing = [(r, j) for r, j in flips if j["changing"]]
    poison = [(r, j) for r, j in js if r["fault"]["kind"] == "poison_batch"]
    out = {"injections": len(rows), "bitflips": len([1 for r, _ in js if r["fault"]["kind"] == "bitflip"]),
           "not_fired": [r["id"] for r, j in js if r["fault"]["kind"] == "bitflip" and not j["fired"]],
           "poisoned_batches": len(poison), "state_changing": len(changing),
           "harmless": sum(1 for _, j in flips if not j["changing"]),
           "harmless_bitwise_equal": sum(1 for _, j in flips if j["harmless"] == "bitwise"),
           "harmless_within_tolerance": sum(1 for _, j in flips if j["harmless"] == "within_tolerance"),
           "missed": [r["id"] for r, j in changing if not j["detected"]],
           "detected_harmless": sum(1 for _, j in flips if not j["changing"] and j["detected"])}
    loc = [j["localized"] for _, j in changing]
    out["localization_accuracy"] = _frac(sum(loc), len(loc))
    det = [j["localized"] for _, j in changing if j["detected"]]
    out["localization_accuracy_detected"] = _frac(sum(det), len(det))
    for g in ("single_owner", "two_peers", "other"):
        xs = [j["localized"] for _, j in changing if j["group"] == g]
        out[f"localization_{g}"] = _frac(sum(xs), len(xs))
        out[f"localization_{g}_n"] = len(xs)
    att = [(j["expected"], j["attributed"]) for _, j in changing + poison]
    out["attribution_accuracy"] = _frac(sum(a for _, a in att), len(att))
    for kind in ("transient", "persistent", "data"):
        xs = [a for e, a in att if e == kind]
        out[f"attribution_{kind}"] = _frac(sum(xs), len(xs))
        out[f"attribution_{kind}_n"] = len(xs)
    wrong = [f"{r['id']} ({r['fault'].get('target', 'poison')}{', persistent' if r['fault'].get('persistent') else ''}"
             f", rank {r['fault'].get('rank')}, step {r['fault']['step']}, bit {r['fault'].get('bit')}: expected "
             f"{j['expected']}, got {j['got']}{', ranks ' + str([s['rank'] for s in r['sdc']]) if r['sdc'] else ''}"
             f"{', PersistentFault rank ' + str(r['persistent_rank']) if j['got'] == 'persistent' else ''}"
             f"{'; unguarded: ' + _unguarded(r) if 'unguarded_vs_ref' in r else ''})"
             for r, j in changing + poison if not j["attributed"] or j["localized"] is False]
    out["misattributed_or_mislocalized"] = wrong
    transient_ok = [(r, j) for r, j in js if j["got"] == "transient" and j["expected"] == "transient"]
    out["rolled_back_bitwise_equal"] = _frac(sum(j["ended_equal"] for _, j in transient_ok), len(transient_ok))
    data_ok = [(r, j) for r, j in poison if j["attributed"]]
    out["data_skip_bitwise_equal"] = _frac(sum(j["ended_equal"] for _, j in data_ok), len(data_ok))
    out["silently_different"] = [r["id"] for r, j in js if not j["detected"] and not r["error"]
                                 and r["guarded_vs_ref"]["max_rel"] > tol]
    rb = [b for r in rows for b in r["rollbacks"]]
    marks = [m for r in rows for m in r["rollback_marks"]]
    d2t = [m["detect_to_first_replayed_step_s"] for m in marks]
    out["rollbacks"] = len(rb)
    d2t = [x for x in d2t if x is not None]  # a restore after a persistent verdict replays nothing
    out["detect_to_training_s"] = {"median": _med(d2t), "max": round(max(d2t, default=0), 4), "n": len(d2t)}
    out["restore_s"] = {"median": _med([m["restore_s"] for m in marks]),
                        "max": round(max([m["restore_s"] for m in marks], default=0), 4)}
    out["rollback_event_s"] = {"median": _med([b["seconds"] for b in rb]),
                               "max": max([b["seconds"] for b in rb], default=None)}
    reworked = [b["steps_reworked"] for b in rb]
    out["steps_reworked"] = {"median": _med(reworked), "max": max(reworked, default=None),
                             "over_check_every": sum(x > CHECK_EVERY for x in reworked)}
    by_layout = {}
    for r, j in js:
        b = by_layout.setdefault(r["layout"], {"n": 0, "changing": 0, "localized": 0, "attributed": 0, "missed": 0})
        b["n"] += 1
        b["changing"] += int(j["changing"] and j["fired"])
        b["localized"] += int(bool(j["localized"]) and j["changing"])
        b["attributed"] += int(bool(j["attributed"]) and j["changing"])
        b["missed"] += int(j["changing"] and j["fired"] and not j["detected"])
    out["by_layout"] = by_layout
    by_target = {}
    for r, j in changing:
        t = r["fault"]["target"] + ("/persistent" if r["fault"].get("persistent") else "")
        b = by_target.setdefault(t, {"changing": 0, "detected": 0, "localized": 0})
        b["changing"] += 1
        b["detected"] += int(j["detected"])
        b["localized"] += int(bool(j["localized"]))
    out["by_target"] = by_target
    return out


# --- the parts ---------------------------------------------------------------------------------------


def part_injections(args, failures: list) -> tuple[list[dict], list[dict]]:
    t, p, d = (4, 1, 1) if args.quick else (40, 6, 4)
    rows, refs = [], []
    chunk = 6 if args.quick else 25
    plan = [(lay, draw_cases(args.seed, lay, t, p, d)) for lay in ("zero0", "zero1", "zero2", "zero3", "hsdp", "tp")]
    plan.append(("ddp2", draw_cases(args.seed, "ddp2", *((3, 1, 0) if args.quick else (20, 4, 0)))))
    for layout, cases in plan:
        for lo in range(0, len(cases), chunk):
            part = cases[lo:lo + chunk]
            t0 = time.monotonic()
            got = run_job("bench.health_jobs:injections", WORLD.get(layout, 4),
                          {"base": BASE, "layouts": {layout: LAYOUTS[layout]}, "cases": part},
                          timeout=180 + 90 * len(part), failures=failures)
            refs += [r for r in got if "reference" in r]
            done = [r for r in got if "id" in r]
            rows += done
            line = ", ".join(f"{r['id']} {judge(r)['got']}" for r in done)
            print(f"  {layout} (world {WORLD.get(layout, 4)}): {len(done)}/{len(part)} injections in "
                  f"{time.monotonic() - t0:.0f} s: {line}", flush=True)
    return rows, refs


def part_clean(args, failures: list) -> list[dict]:
    steps = args.fp_steps or (200 if args.quick else 2000)
    runs = [{"name": "fp32 zero2", "overrides": ["parallel.zero_stage=2"], "steps": steps},
            {"name": "bf16 hsdp", "overrides": LAYOUTS["hsdp"] + ["parallel.mixed_precision=bf16"], "steps": steps},
            {"name": "fp32 tp2", "overrides": LAYOUTS["tp"], "steps": steps}]
    rows = []
    for run in runs:  # one job each: a long run that hangs loses only itself
        t0 = time.monotonic()
        got = [r for r in run_job("bench.health_jobs:clean_runs", 4, {"base": BASE, "runs": [run]},
                                  timeout=300 + steps * 1.5, failures=failures) if "name" in r]
        rows += got
        for r in got:
            print(f"  clean {r['name']}: {r['final_step']} steps, {r['checks']} checks, {r['n_events']} events "
                  f"(error {r['error']}) in {time.monotonic() - t0:.0f} s", flush=True)
    return rows


def part_overhead(args, failures: list) -> dict | None:
    payload = {"base": BASE + ["parallel.zero_stage=3"], "every": [16, 1], "rounds": 6 if args.quick else 12,
               "steps_per_round": 16, "warmup": 4}
    try:
        res = run_ranks("bench.health_jobs:overhead", 4, payload, timeout=1800)[0][0]  # rank 0's only row
    except RankFailure as e:
        failures.append({"job": "overhead", "error": str(e)[:300]})
        return None
    base = res["0"]
    out = {k: {kk: round(vv, 5) if isinstance(vv, float) else vv for kk, vv in v.items()} for k, v in res.items()}
    out["overhead_ratio"] = round(res["16"]["median_round_mean_s"] / base["median_round_mean_s"], 4)
    out["overhead_ratio_median_step"] = round(res["16"]["median_step_s"] / base["median_step_s"], 4)
    out["overhead_ratio_every1"] = round(res["1"]["median_round_mean_s"] / base["median_round_mean_s"], 4)
    out["overhead_ratio_every1_median_step"] = round(res["1"]["median_step_s"] / base["median_step_s"], 4)
    # the guard's own seconds per step over the step without it: the ratio the load cannot move
    out["overhead_accounted"] = round(1 + res["16"]["guard_s_per_step"] / base["median_round_mean_s"], 4)
    out["overhead_accounted_every1"] = round(1 + res["1"]["guard_s_per_step"] / base["median_round_mean_s"], 4)
    return out


def checkpoint_cases(args) -> list[dict]:
    rng = random.Random(f"{args.seed}:checkpoints")
    cases = [
        # a gradient's sign on one DDP replica: the replicas differ from then on; step 12's save checks first
        {"layout": "zero0", "fault": {"kind": "bitflip", "step": rng.randint(9, 11), "rank": rng.randrange(4),
                                      "target": "grad", "bit": 31}},
        {"layout": "zero3", "fault": {"kind": "bitflip", "step": rng.randint(2, 23), "rank": rng.randrange(4),
                                      "target": "param", "seed": rng.randrange(1 << 31)}},
        # persistent: after a few committed steps (its run stops at the verified step before it)
        {"layout": "zero1", "fault": {"kind": "bitflip", "step": rng.randint(10, 22), "rank": rng.randrange(4),
                                      "target": "optimizer", "persistent": True}},
        {"layout": "zero2", "fault": {"kind": "poison_batch", "step": rng.randint(40, 46)}, "steps": POISON_STEPS},
    ]
    if not args.quick:
        cases += [
            {"layout": "hsdp", "fault": {"kind": "bitflip", "step": rng.randint(2, 23), "rank": rng.randrange(4),
                                         "target": "grad", "bit": 30}},
            {"layout": "tp", "fault": {"kind": "bitflip", "step": rng.randint(2, 23), "rank": rng.randrange(4),
                                       "target": "optimizer", "seed": rng.randrange(1 << 31)}},
            {"layout": "zero0", "fault": {"kind": "bitflip", "step": rng.randint(2, 23), "rank": rng.randrange(4),
                                          "target": "activation", "bit": 30}},
            {"layout": "zero2", "fault": {"kind": "bitflip", "step": rng.randint(10, 22), "rank": rng.randrange(4),
                                          "target": "param", "persistent": True}},
        ]
    return [{"id": f"ckpt-{i}", "steps": c.pop("steps", FLIP_STEPS), **c} for i, c in enumerate(cases)]


def part_checkpoints(args, failures: list) -> list[dict]:
    root = tempfile.mkdtemp(prefix="etrain-bench-health-ckpt-")
    try:
        cases = checkpoint_cases(args)
        layouts = {c["layout"]: LAYOUTS[c["layout"]] for c in cases}
        rows = run_job("bench.health_jobs:checkpoints", 4,
                       {"base": BASE, "layouts": layouts, "cases": cases, "url": f"file://{root}", "interval": 4},
                       timeout=300 + 120 * len(cases), failures=failures)
        for r in rows:
            if "id" in r:
                print(f"  {r['id']} {r['layout']} {r['fault']['kind']} {r['fault'].get('target', '')}: committed "
                      f"{r['committed']}, {r['faulty']} differ; verdicts "
                      f"{[(s['verdict'], s['rank'], s['step']) for s in r['sdc']]}", flush=True)
        return [r for r in rows if "id" in r]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def print_injections(s: dict) -> None:
    print(f"injections: {s['injections']} ({s['bitflips']} flips, {s['poisoned_batches']} poisoned batches); "
          f"state-changing flips {s['state_changing']}, harmless {s['harmless']} ({s['harmless_bitwise_equal']} "
          f"bit for bit, {s['harmless_within_tolerance']} within {TOLERANCE:g}), not fired {len(s['not_fired'])}, "
          f"missed {len(s['missed'])} {s['missed']}")

    def n(key: str) -> str:
        return f"{s[key]} (n={s[key + '_n']})"

    print(f"localization_accuracy {s['localization_accuracy']} (of detected: "
          f"{s['localization_accuracy_detected']}); single owner {n('localization_single_owner')}, two peers "
          f"{n('localization_two_peers')}, other {n('localization_other')}")
    print(f"attribution_accuracy {s['attribution_accuracy']} (target >= 0.95): transient "
          f"{n('attribution_transient')}, persistent {n('attribution_persistent')}, data {n('attribution_data')}")
    for w in s["misattributed_or_mislocalized"]:
        print(f"  wrong: {w}")
    print(f"rolled back and ended bit for bit equal to the clean run: {s['rolled_back_bitwise_equal']}; "
          f"poisoned batch skipped and equal to the run that skips it: {s['data_skip_bitwise_equal']}; "
          f"guarded runs that ended different with no verdict: {s['silently_different']}")
    d2t, rb, sr = s["detect_to_training_s"], s["rollback_event_s"], s["steps_reworked"]
    print(f"detect_to_training_s median {d2t['median']} max {d2t['max']} (target <= 2); restore alone median "
          f"{s['restore_s']['median']}; rollback event seconds median {rb['median']} max {rb['max']}; "
          f"steps_reworked median {sr['median']} max {sr['max']} (<= {CHECK_EVERY})")


SENSITIVITY = (1e-4, 1e-2)  # the headline figures again with a looser tolerance: how small the missed changes are


def do_injections(args, result: dict, failures: list) -> None:
    if args.from_rows:  # the summary of a run's saved rows (--rows), without training again
        with open(args.from_rows) as f:
            rows, refs = [json.loads(line) for line in f if line.strip()], []
    else:
        rows, refs = part_injections(args, failures)
    if args.rows:
        with open(args.rows, "w") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
    s = summarize(rows)
    result.update(s)
    result["references_equal_with_checks_off"] = all(r.get("same_as_guarded") is not False for r in refs)
    result["reference_events"] = sum(r["events"] for r in refs)
    result["by_tolerance"] = {}
    for tol in SENSITIVITY:
        t = summarize(rows, tol)
        result["by_tolerance"][f"{tol:g}"] = {k: t[k] for k in (
            "state_changing", "harmless", "missed", "localization_accuracy", "attribution_accuracy",
            "attribution_transient", "attribution_persistent")}
    print_injections(s)
    for tol, t in result["by_tolerance"].items():
        print(f"  with a tolerance of {tol}: state-changing {t['state_changing']}, missed {len(t['missed'])}, "
              f"localization_accuracy {t['localization_accuracy']}, attribution_accuracy {t['attribution_accuracy']}")


def do_clean(args, result: dict, failures: list) -> None:
    clean = part_clean(args, failures)
    result["false_positives"] = sum(r["n_events"] for r in clean)
    result["clean_runs"] = [{k: r[k] for k in ("name", "steps", "final_step", "checks", "n_events", "error",
                                               "seconds", "events")} for r in clean]
    result["clean_steps"] = sum(r["final_step"] for r in clean)
    print(f"false_positives {result['false_positives']} over {len(clean)} clean runs, {result['clean_steps']} steps")


def do_overhead(args, result: dict, failures: list) -> None:
    ov = part_overhead(args, failures)
    if ov is None:
        return
    result.update({k: ov[k] for k in ("overhead_ratio", "overhead_ratio_median_step", "overhead_ratio_every1",
                                      "overhead_ratio_every1_median_step", "overhead_accounted",
                                      "overhead_accounted_every1")},
                  overhead={k: v for k, v in ov.items() if k in ("0", "16", "1")})
    print(f"overhead_ratio {ov['overhead_ratio']} (every 16 / none, round means; median steps "
          f"{ov['overhead_ratio_median_step']}; target <= 1.01); every step: {ov['overhead_ratio_every1']} "
          f"(median steps {ov['overhead_ratio_every1_median_step']}); step "
          f"{ov['0']['median_step_s'] * 1e3:.1f} ms without checks")
    print(f"the guard's own time per step: {ov['16']['guard_s_per_step'] * 1e3:.2f} ms every 16 (1 + it / the step: "
          f"{ov['overhead_accounted']}), {ov['1']['guard_s_per_step'] * 1e3:.2f} ms every step "
          f"({ov['overhead_accounted_every1']}); by call, every 16: {ov['16']['guard_ms_per_step_by_call']} ms")


def do_checkpoints(args, result: dict, failures: list) -> None:
    ck = part_checkpoints(args, failures)
    result["committed_faulty_checkpoints"] = sum(r["faulty"] for r in ck)
    result["committed_checked"] = sum(len(r["committed"]) for r in ck)
    result["checkpoint_cases"] = [{k: r[k] for k in ("id", "layout", "fault", "committed", "faulty", "sdc",
                                                     "final_step")} for r in ck]
    print(f"committed_faulty_checkpoints {result['committed_faulty_checkpoints']} of "
          f"{result['committed_checked']} committed steps in {len(ck)} fault runs (target 0)")


PARTS = {"injections": do_injections, "clean": do_clean, "overhead": do_overhead, "checkpoints": do_checkpoints}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="36 + 4 injections, clean runs of 200 steps (~15 min)")
    ap.add_argument("--full", action="store_true", help="the default: 300 + 24 injections, clean runs of 2,000 steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp-steps", type=int, default=0, help="steps of each clean run (default 200 quick, 2000)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--rows", default="", help="also write every injection's row here (JSON lines)")
    ap.add_argument("--from-rows", default="", help="summarize the rows a run wrote (--rows) instead of injecting")
    args = ap.parse_args()
    t0 = time.monotonic()
    failures: list[dict] = []
    result: dict = {"bench": "health", "quick": args.quick, "seed": args.seed, "world": 4, "preset": "tiny",
                    "check_every_steps": CHECK_EVERY, "tolerance": TOLERANCE}
    print(f"silent faults, tiny preset, world 4 (and 2), gloo on {os.cpu_count()} CPU cores, "
          f"{'--quick' if args.quick else 'full'}, seed {args.seed}", flush=True)
    for name in args.parts.split(","):
        try:
            PARTS[name](args, result, failures)
        except Exception:  # noqa: BLE001 - one part's failure is reported; the others' figures still come
            failures.append({"part": name, "error": traceback.format_exc()[-800:]})
            print(f"  ! part {name} failed:\n{traceback.format_exc()}", flush=True)
    result["failures"] = failures
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(f"{len(failures)} failures; {result['elapsed_s']:.0f} s; load average now {result['load_average']}")
    print(json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
