"""``etrain plot``: a finished run with a failure, a recovery, a resize, a suspend and a resume, drawn from its
run store (written here through orchestrator.store.run_store, no Ray), and a torchrun step log. The data drawn is checked,
not the pixels."""

import json

import pytest

from orchestrator.cli.main import main
from orchestrator.plot import log_series, run_series
from orchestrator.store.run_store import CorruptRunStore, HistoryRow, RunSpec, open_store

T0 = 1_800_000_000.0


def finished_run(url: str, stored: bool = False) -> None:
    """Steps 1-6 on 2 workers; a failure at step 6, restored from step 4 on 1 worker (steps 5-8 again);
    a resize to 2 at step 8; suspended at step 10, resumed for steps 11-12. Eval at steps 4 and 12.
    The history rows are an older run's (6 numbers, eval loss only in the events), or with ``stored``
    today's: each row's tokens/s (1000 x step) and, at steps 4 and 12, the eval loss."""
    store = open_store(url)
    store.create_run(RunSpec(run_id="r1", config={"run_id": "r1", "data": {"seq_len": 64}}, workers=2,
                             min_workers=1, max_workers=2))
    rows, t = [], T0
    for step, world in [*((s, 2) for s in range(1, 7)), *((s, 1) for s in range(5, 9)),
                        *((s, 2) for s in range(9, 13))]:
        t += 1.0
        if step == 5 and world == 1:
            t += 5.0  # the recovery
        if step == 11:
            t += 100.0  # suspended
        rows.append(HistoryRow(step, 5.0 / step, world, step * 12, t, 0.5, *(
            (1000.0 * step, {4: 1.5, 12: 0.9}.get(step)) if stored else ())))
    store.put_history("r1", rows if stored else [list(r[:6]) for r in rows])
    at = {r.step: r.unix for r in rows}  # the last row of each step
    for e in [{"kind": "started", "time": T0 - 10},
              {"kind": "eval", "time": T0 + 4.1, "step": 4, "loss": 1.5},
              {"kind": "failure", "time": T0 + 6.5, "step": 6, "failure_kind": "worker_lost"},
              {"kind": "recovered", "time": at[5] + 0.1, "time_to_recover_s": 5.0, "steps_lost": 2},
              {"kind": "resized", "time": at[9] + 0.1, "step": 9, "from_workers": 1, "to_workers": 2},
              {"kind": "suspended", "time": at[10] + 0.1, "step": 10},
              {"kind": "started", "time": at[11] - 1},
              {"kind": "eval", "time": at[12] + 0.1, "step": 12, "loss": 0.9},
              {"kind": "finished", "time": at[12] + 0.2, "step": 12}]:
        store.add_event("r1", e)


def test_plot_a_finished_run_from_its_store(tmp_path, capsys):
    url = f"file://{tmp_path}/runs"
    finished_run(url)
    png = tmp_path / "r1.png"
    assert main(["plot", "r1", "--store", url, "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1 failure, 1 recovery, 1 resize, 1 suspend, 1 resume" in capsys.readouterr().out

    store = open_store(url)
    s = run_series(store.get_history("r1"), store.events("r1"), seq_len=64)
    assert s["step"] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11, 12]  # steps 5-6 redone after the restore
    assert s["world_size"] == [2] * 6 + [1] * 4 + [2] * 4
    assert s["loss"][0] == 5.0 and s["time"][0] == 0.0
    assert s["time"] == sorted(s["time"])
    assert s["throughput_unit"] == "tokens/s" and s["throughput"][1] == 12 * 64 / 0.5
    assert [(step, loss) for step, _, loss in s["eval"]] == [(4, 1.5), (12, 0.9)]
    assert [(m["kind"], m["step"]) for m in s["marks"]] == [("failure", 6), ("recovery", 5), ("resize", 9),
                                                            ("suspend", 10), ("resume", 10)]
    assert s["marks"][3]["time"] < s["marks"][4]["time"]


def test_plot_draws_the_throughput_and_eval_loss_the_history_holds(tmp_path, capsys):
    url = f"file://{tmp_path}/runs"
    finished_run(url, stored=True)
    store = open_store(url)
    assert store.get_history("r1")[3] == HistoryRow(4, 1.25, 2, 48, T0 + 4.0, 0.5, 4000.0, 1.5)
    # Throughput as stored (not the 12 x 64 / 0.5 tokens/s derived from the samples), without a seq_len too.
    s = run_series(store.get_history("r1"), store.events("r1"))
    assert s["throughput_unit"] == "tokens/s"
    assert s["throughput"] == [1000.0 * step for step in s["step"]]
    assert [(step, loss) for step, _, loss in s["eval"]] == [(4, 1.5), (12, 0.9)]  # not twice: rows and events
    assert main(["plot", "r1", "--store", url, "-o", str(tmp_path / "r1.png")]) == 0
    # A row whose new fields are not numbers is refused, naming the document.
    store.put_history("r2", [[1, 2.0, 1, 12, T0, 0.5, "fast", None]])
    with pytest.raises(CorruptRunStore, match="history.json is not a JSON list of rows"):
        store.get_history("r2")


def test_plot_a_torchrun_step_log(tmp_path):
    """A torchrun job restarted from step 2 on a smaller world: a recovery and a resize."""
    log = tmp_path / "steps.jsonl"
    recs = [{"step": st, "loss": 3.0 / st, "world_size": w, "tokens_per_s": 1000.0, "time": T0 + i,
             "eval_loss": 2.0 if st == 2 else None} for i, (st, w) in enumerate([(1, 2), (2, 2), (3, 2), (3, 1)])]
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["plot", "--log-file", str(log)]) == 0
    assert (tmp_path / "steps.png").exists()
    s = log_series(recs)
    assert [(m["kind"], m["step"]) for m in s["marks"]] == [("recovery", 3), ("resize", 3)]
    assert s["eval"] == [(2, 1.0, 2.0)] and s["world_size"] == [2, 2, 2, 1]


def test_plot_needs_a_run_with_steps(tmp_path, capsys):
    url = f"file://{tmp_path}/runs"
    open_store(url).create_run(RunSpec(run_id="empty", config={}, workers=1, min_workers=1, max_workers=1))
    assert main(["plot", "empty", "--store", url, "-o", str(tmp_path / "x.png")]) == 2
    assert "no step history to plot yet" in capsys.readouterr().err
    assert main(["plot"]) == 2


def test_world_size_ticks_are_integers():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from orchestrator.plot import integer_ticks

    fig, ax = plt.subplots()
    ax.step([0, 1, 2], [2, 3, 2])
    integer_ticks(ax)
    fig.canvas.draw()
    ticks = ax.get_yticks()
    plt.close(fig)
    assert len(ticks) and all(float(t).is_integer() for t in ticks)



def test_chaos_plot_marks_the_runs_events_as_etrain_plot_does(tmp_path):
    """`etrain chaos --plot`: the injected fault, and the failure, recovery, resize, suspend and resume of the run's
    events, at the same places as `etrain plot` puts them (the same marks)."""
    from orchestrator.chaos.cli import draw_plot

    url = f"file://{tmp_path}/runs"
    finished_run(url)
    store = open_store(url)
    fault = {"kind": "kill_worker", "step": 6, "injected_unix": T0 + 6.2, "time_to_recover_s": 6.0}
    png = tmp_path / "chaos.png"
    marks = draw_plot(str(png), store, "r1", {"faults": [fault]})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [(m["kind"], m["step"]) for m in marks] == [("fault", 6), ("failure", 6), ("recovery", 5),
                                                       ("resize", 9), ("suspend", 10), ("resume", 10)]
    assert marks[0]["fault"] == "kill_worker" and marks[0]["time"] == pytest.approx(5.2)  # since step 1 ended
    assert marks[1:] == run_series(store.get_history("r1"), store.events("r1"))["marks"]
