"""Jobs of bench/health.py, run inside real gloo groups (tests.harness.run_ranks): many short runs in one
process group, a fresh Trainer for each (``forget_meshes`` between), compared with the reference runs of
the same layout trained in the same processes.

    injections(payload)   # seeded faults: each case trained with [health] on, then with the checks off
    clean_runs(payload)   # long fault-free runs: every sdc / spike / rollback event is a false positive
    overhead(payload)     # step time with checks every N steps against none, alternating rounds
    checkpoints(payload)  # the committed checkpoints of fault runs against the reference run's

Each case's result is appended by rank 0 to ``payload["out"]`` as one JSON line as soon as it is known
(a job that hangs or dies still leaves the cases before it, and a ``start`` line for the one it was on).
"""

from __future__ import annotations

import json
import math
import statistics
import time

import torch
import torch.distributed as dist

from tests.ckpt_jobs import full_state
from trainer.config.load import load_config
from trainer.data.corpus import load_corpus
from trainer.health import HealthStop, PersistentFault
from trainer.loop import Trainer
from trainer.world import World, forget_meshes, init_distributed, shutdown_distributed

CPU = torch.device("cpu")
UNGUARDED = "health.check_every_steps=0"


def fault_override(fault: dict) -> str:
    """``health.faults=[{...}]`` as the config's overrides take it (TOML inline table)."""
    return "health.faults=[{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in fault.items()) + "}]"


def poison_skip(fault: dict, global_batch: int) -> str:
    """The reference of a poisoned batch: the same run with that step's samples skipped."""
    start = (fault["step"] - 1) * global_batch
    return f"data.skip_ranges=[[{start},{start + global_batch}]]"


def _emit(out: str | None, row: dict) -> None:
    if out and dist.get_rank() == 0:
        with open(out, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


class _Marks:
    """Instance-level wrappers on one guard and its trainer (no trainer code changed): when a finding was
    made (``after_reduce`` held a step, or a check found something), when each restore started and ended,
    and when each step ended (and whether it was a replayed one)."""

    def __init__(self, tr: Trainer):
        g = tr.health
        self.rows: list[tuple] = []
        rows = self.rows
        after_reduce, check, restore, step = g.after_reduce, g.check, g._restore, tr.train_step

        def after_reduce_(*a, **k):
            held = after_reduce(*a, **k)
            if held:
                rows.append(("detect", time.monotonic()))
            return held

        def check_(*a, **k):
            findings = check(*a, **k)
            if findings and not g.replaying:
                rows.append(("detect", time.monotonic()))
            return findings

        def restore_(*a, **k):
            rows.append(("restore_start", time.monotonic()))
            out = restore(*a, **k)
            rows.append(("restore_end", time.monotonic()))
            return out

        def step_(*a, **k):
            out = step(*a, **k)
            rows.append(("step_end", time.monotonic(), g.replaying))
            return out

        g.after_reduce, g.check, g._restore, tr.train_step = after_reduce_, check_, restore_, step_

    def rollbacks(self) -> list[dict]:
        """Per restore: ``restore_s``, ``detect_to_restored_s`` and ``detect_to_first_replayed_step_s`` (from the
        finding that led to it to the end of the first replayed step; None when nothing was replayed)."""
        out = []
        for i, row in enumerate(self.rows):
            if row[0] != "restore_start":
                continue
            detect = next((r[1] for r in reversed(self.rows[:i]) if r[0] == "detect"), None)
            end = next(r[1] for r in self.rows[i:] if r[0] == "restore_end")
            first = next((r[1] for r in self.rows[i:] if r[0] == "step_end" and r[2]), None)
            later = next((j for j, r in enumerate(self.rows[i + 1:]) if r[0] == "restore_start"), None)
            if later is not None and first is not None:
                nxt = self.rows[i + 1 + later][1]
                first = first if first < nxt else None
            out.append({"restore_s": end - row[1],
                        "detect_to_restored_s": None if detect is None else end - detect,
                        "detect_to_first_replayed_step_s": None if detect is None or first is None else first - detect})
        return out


def _train(overrides: list[str], world: World, corpus, *, instrument: bool = False, ckpt=None) -> dict:
    cfg = load_config(None, overrides)
    forget_meshes()
    tr = Trainer(cfg, world, corpus=corpus, device=CPU)
    marks = _Marks(tr) if instrument else None
    mgr = None
    if ckpt:
        from trainer.checkpoints import checkpoint_manager

        mgr = checkpoint_manager(cfg, world)
    events: list[dict] = []
    error, persistent_rank, stop = None, None, None
    t0 = time.monotonic()
    try:
        for s in tr.run_steps(cfg.train.steps, mgr):
            events += s.health_events or []
    except PersistentFault as e:
        error, persistent_rank = f"PersistentFault: {e}", e.rank
        events += tr.health.take_events()
    except HealthStop as e:
        error, stop = f"HealthStop: {e}", True
        events += tr.health.take_events()
    except Exception as e:  # noqa: BLE001 - recorded: the unguarded runs end in NonFiniteStep, among others
        error = f"{type(e).__name__}: {e}"
        events += tr.health.take_events()
    seconds = time.monotonic() - t0
    if mgr is not None:
        mgr.wait()
        mgr.close()
    return {"trainer": tr, "events": events, "error": error, "persistent_rank": persistent_rank,
            "health_stop": bool(stop), "seconds": seconds, "step": tr.step,
            "fired": tr.health.faults.log if tr.health.faults else [],
            "totals": {k: v for k, v in tr.health.totals.items() if k in ("checks", "check_seconds", "rollbacks")},
            "rollback_marks": marks.rollbacks() if marks else []}


def state_diff(ref: dict, got: dict | None) -> dict:
    """``bitwise``: every tensor equal bit for bit; ``max_rel``: the largest relative L2 distance over the
    tensors, ||got - ref|| / max(||ref||, 1e-12) in float64 (inf where ``got`` is not finite)."""
    if got is None:
        return {"bitwise": False, "max_rel": math.inf, "worst": None}
    worst, max_rel, bitwise = None, 0.0, True
    for k, a in ref.items():
        b = got[k]
        if torch.equal(a, b):
            continue
        bitwise = False
        a64, b64 = a.double(), b.double()
        if not torch.isfinite(b64).all():
            rel = math.inf
        else:
            rel = float((b64 - a64).norm() / max(float(a64.norm()), 1e-12))
        if rel > max_rel or worst is None:
            max_rel, worst = rel, k
    return {"bitwise": bitwise, "max_rel": max_rel, "worst": worst}


def _summary(run: dict) -> dict:
    ev = run["events"]
    return {"sdc": [{k: e.get(k) for k in ("verdict", "rank", "step", "target", "localized_by", "samples")}
                    for e in ev if e["kind"] == "sdc"],
            "spikes": [{k: e.get(k) for k in ("step", "signal", "zscore")} for e in ev if e["kind"] == "spike"],
            "rollbacks": [{k: e.get(k) for k in ("step", "from_step", "to_step", "seconds", "steps_reworked",
                                                 "cause")} for e in ev if e["kind"] == "rollback"],
            "other_events": [e for e in ev if e["kind"] not in ("sdc", "spike", "rollback")][:4],
            "error": run["error"] and run["error"][:400], "persistent_rank": run["persistent_rank"],
            "health_stop": run["health_stop"], "final_step": run["step"], "seconds": round(run["seconds"], 3),
            "rollback_marks": run["rollback_marks"], "totals": run["totals"]}


def _gathered_fired(fired: list[dict]) -> list[dict]:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, fired)
    return [e for rank_log in every for e in rank_log]


def injections(payload: dict) -> list:
    """Each case: ``{"id", "layout", "steps", "fault"}``. Per (layout, steps): the clean reference runs, checks on
    and off (and per poisoned batch the run that skips its samples). Per case: the run with the fault and
    [health] on (its events, where it ended, its state against the reference), then for a flip the same with
    the checks off (what the fault does to the trained state unguarded)."""
    world = World.from_env()
    init_distributed(world, CPU)
    out = payload.get("out")
    try:
        base, layouts = payload["base"], payload["layouts"]
        corpus = load_corpus(load_config(None, base).data)
        gb = load_config(None, base).train.global_batch
        refs: dict[tuple, dict] = {}

        def reference(layout: str, steps: int, skip: str | None, guarded: bool) -> dict:
            key = (layout, steps, skip, guarded)
            if key not in refs:
                over = base + layouts[layout] + [f"train.steps={steps}"] + ([skip] if skip else []) + \
                    ([] if guarded else [UNGUARDED])
                r = _train(over, world, corpus)
                refs[key] = {"state": full_state(r["trainer"]), "events": len(r["events"]), "error": r["error"],
                             "seconds": r["seconds"]}
                twin = refs.get((layout, steps, None, True)) if not guarded else None
                if twin is not None:  # the checks change nothing in the training math: the two end equal
                    refs[key]["same_as_guarded"] = state_diff(twin["state"], refs[key]["state"])["bitwise"]
                _emit(out, {"reference": list(map(str, key)), "events": refs[key]["events"],
                            "error": refs[key]["error"], "seconds": round(r["seconds"], 3),
                            "same_as_guarded": refs[key].get("same_as_guarded")})
                del r
            return refs[key]

        for case in payload["cases"]:
            _emit(out, {"start": case["id"]})
            layout, steps, fault = case["layout"], case["steps"], case["fault"]
            skip = poison_skip(fault, gb) if fault["kind"] == "poison_batch" else None
            ref_guarded = reference(layout, steps, skip, True)
            over = base + layouts[layout] + [f"train.steps={steps}", fault_override(fault)]
            g = _train(over, world, corpus, instrument=True)
            g_state = full_state(g["trainer"]) if g["error"] is None else None
            row = {"id": case["id"], "layout": layout, "steps": steps, "fault": fault, **_summary(g),
                   "fired": _gathered_fired(g["fired"]),
                   "guarded_vs_ref": state_diff(ref_guarded["state"], g_state)}
            del g, g_state
            if skip is None:  # a flip: what it does to the trained state with the checks off (a poisoned batch
                # moves every weight: not trained again)
                ref_off = reference(layout, steps, None, False)
                u = _train(over + [UNGUARDED], world, corpus)
                u_state = full_state(u["trainer"]) if u["error"] is None else None
                row["unguarded_error"] = u["error"] and u["error"][:200]
                row["unguarded_vs_ref"] = state_diff(ref_off["state"], u_state)
                row["unguarded_seconds"] = round(u["seconds"], 3)
                del u, u_state
            _emit(out, row)
        return [{"done": len(payload["cases"])}]
    finally:
        shutdown_distributed()


def clean_runs(payload: dict) -> list:
    """Each run: ``{"name", "overrides", "steps"}``, fault-free: its sdc / spike / rollback events (each a false
    positive), checks made, where it ended, seconds."""
    world = World.from_env()
    init_distributed(world, CPU)
    out = payload.get("out")
    try:
        base = payload["base"]
        corpus = load_corpus(load_config(None, base).data)
        rows = []
        for run in payload["runs"]:
            _emit(out, {"start": run["name"]})
            r = _train(base + run["overrides"] + [f"train.steps={run['steps']}"], world, corpus)
            row = {"name": run["name"], "steps": run["steps"], "final_step": r["step"], "error": r["error"],
                   "events": [e for e in r["events"] if e["kind"] in ("sdc", "spike", "rollback")][:20],
                   "n_events": sum(e["kind"] in ("sdc", "spike", "rollback") for e in r["events"]),
                   "checks": r["totals"]["checks"], "check_seconds": round(r["totals"]["check_seconds"], 3),
                   "seconds": round(r["seconds"], 2)}
            rows.append(row)
            _emit(out, row)
            del r
        return rows
    finally:
        shutdown_distributed()


def overhead(payload: dict) -> list:
    """Trainers of one layout with ``health.check_every_steps`` 0 (the baseline), and each of ``every``, driven
    through ``run_steps`` (where the checks run), one round of ``steps_per_round`` steps each in turn, the
    order reversed every other round. A step's time is from a barrier to the end of its ``next()``, the
    slowest rank's. Per setting: the median step, and the median over rounds of a round's mean step (a check
    every 16 steps lands in one step of a round of 16: a median of steps would not see it); and rank 0's
    seconds per step inside the guard's own calls (what the checks cost, whatever the machine's load)."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        base = payload["base"]
        corpus = load_corpus(load_config(None, base).data)
        names = ["0"] + [str(e) for e in payload["every"]]
        gens, trainers, spent = {}, {}, {}
        for name in names:
            cfg = load_config(None, base + [f"health.check_every_steps={name}", f"train.steps={10**6}"])
            forget_meshes()
            trainers[name] = Trainer(cfg, world, corpus=corpus, device=CPU)
            spent[name] = _time_guard(trainers[name].health)
            gens[name] = trainers[name].run_steps(10**6)
            for _ in range(payload.get("warmup", 4)):
                next(gens[name])
            spent[name].update(dict.fromkeys(GUARD_CALLS, 0.0))
        per_round = payload["steps_per_round"]
        times = {n: [] for n in names}
        round_means = {n: [] for n in names}
        for r in range(payload["rounds"]):
            for name in (names if r % 2 == 0 else list(reversed(names))):
                ts = []
                for _ in range(per_round):
                    dist.barrier()
                    t0 = time.perf_counter()
                    next(gens[name])
                    ts.append(time.perf_counter() - t0)
                t = torch.tensor(ts, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[name] += t.tolist()
                round_means[name].append(float(t.mean()))
        res = {}
        for name in names:
            tot = trainers[name].health.totals
            res[name] = {"median_step_s": statistics.median(times[name]),
                         "median_round_mean_s": statistics.median(round_means[name]),
                         "steps": len(times[name]), "checks": tot["checks"],
                         "check_seconds": tot["check_seconds"], "events": len(trainers[name].health.events),
                         "guard_s_per_step": sum(spent[name].values()) / len(times[name]),
                         "guard_ms_per_step_by_call": {k: round(v * 1e3 / len(times[name]), 3)
                                                       for k, v in spent[name].items()}}
        for g in gens.values():
            g.close()
        return [res]
    finally:
        shutdown_distributed()


GUARD_CALLS = ("before_reduce", "after_reduce", "after_update", "between_steps")


def _time_guard(g) -> dict[str, float]:
    """The seconds the guard's own calls inside and between steps take on this rank, by call: the seal's
    digests (``before_reduce``, ``after_update``), the windows (``after_reduce``), the checks and their ring
    copies (``between_steps``)."""
    spent = dict.fromkeys(GUARD_CALLS, 0.0)
    for name in GUARD_CALLS:
        def timed(*a, _f=getattr(g, name), _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0
        setattr(g, name, timed)
    return spent


def checkpoints(payload: dict) -> list:
    """Each case ``{"id", "layout", "steps", "fault"}`` runs with ``checkpoint.url`` (every
    ``interval`` steps): the reference run of its layout (and, for a poisoned batch, of the run that
    skips it), then the run with the fault. Every step the fault run committed is loaded (the repo's reader,
    through ``CheckpointManager.load``) beside the reference's of the same step, into a fresh Trainer of the
    layout, and compared bit for bit."""
    from trainer.checkpoints import checkpoint_manager

    world = World.from_env()
    init_distributed(world, CPU)
    out = payload.get("out")
    try:
        base, layouts, url = payload["base"], payload["layouts"], payload["url"]
        corpus = load_corpus(load_config(None, base).data)
        gb = load_config(None, base).train.global_batch
        ck = [f'checkpoint.url="{url}"', f"checkpoint.interval_steps={payload['interval']}",
              "checkpoint.keep_last=1000"]
        done_refs: set[str] = set()
        rows = []
        for case in payload["cases"]:
            layout, steps, fault = case["layout"], case["steps"], case["fault"]
            skip = poison_skip(fault, gb) if fault["kind"] == "poison_batch" else None
            common = base + layouts[layout] + [f"train.steps={steps}"] + ck
            ref_id = f"ref-{layout}-{steps}" + ("-skip" + str(fault["step"]) if skip else "")
            if ref_id not in done_refs:
                _train(common + [f'run_id="{ref_id}"'] + ([skip] if skip else []), world, corpus, ckpt=True)
                done_refs.add(ref_id)
            run_id = f"fault-{case['id']}"
            r = _train(common + [f'run_id="{run_id}"', fault_override(fault)], world, corpus, ckpt=True)
            summary = _summary(r)
            del r
            cfg = load_config(None, common + [f'run_id="{run_id}"'])
            forget_meshes()
            scratch = Trainer(cfg, world, corpus=corpus, device=CPU)
            got, ref = checkpoint_manager(cfg, world), checkpoint_manager(load_config(
                None, common + [f'run_id="{ref_id}"']), world)
            committed = got.committed_steps() if world.rank == 0 else None
            box = [committed]
            dist.broadcast_object_list(box)
            committed = box[0]
            ref_steps = ref.committed_steps() if world.rank == 0 else None
            box = [ref_steps]
            dist.broadcast_object_list(box)
            ref_steps = set(box[0])
            per_step = {}
            for s in committed:
                if s not in ref_steps:
                    per_step[s] = "no reference step"
                    continue
                states = []
                for mgr in (got, ref):
                    m = mgr.load(scratch.optimizer.checkpoint_state(), step=s)
                    scratch.optimizer.after_load()
                    states.append(full_state(scratch) if m is not None and m.step == s else None)
                if states[0] is None or states[1] is None:
                    per_step[s] = "not loaded"
                else:
                    d = state_diff(states[1], states[0])
                    per_step[s] = "equal" if d["bitwise"] else f"differs (max_rel {d['max_rel']:.3g}, {d['worst']})"
            got.close()
            ref.close()
            del scratch
            row = {"id": case["id"], "layout": layout, "fault": fault, "committed": committed,
                   "per_step": {str(k): v for k, v in per_step.items()},
                   "faulty": sum(v != "equal" for v in per_step.values()),
                   "sdc": summary["sdc"], "error": summary["error"], "final_step": summary["final_step"]}
            rows.append(row)
            _emit(out, row)
        return rows
    finally:
        shutdown_distributed()
