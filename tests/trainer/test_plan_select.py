"""`etrain plan` says how to run the layout it picks: the `--set` flags and the TOML lines that select it
(each read back by the config loader gives that very layout), and a legend of the layout notation."""

from __future__ import annotations

import dataclasses
import tomllib

from trainer.config.load import config_from_dict, load_config, load_raw
from trainer.plan.accounting import Layout
from trainer.plan.cli import LEGEND
from trainer.plan.cli import main as plan_main
from trainer.plan.cost import DEVICES

TINY = "examples/tiny.toml"


def merged(raw: dict, extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for section, fields in extra.items():
        out.setdefault(section, {}).update(fields)
    return out


def test_the_printed_set_flags_and_toml_lines_select_the_best_layout(capsys):
    from trainer.plan.cli import build_plan

    cfg = load_config(TINY)
    doc = build_plan(cfg, 4, 4, DEVICES["cpu"], budget_s=0.5)
    plan = doc["plan"]
    best, select = plan["best"], plan["select"]
    assert select["set"] and best["layout"] != plan["config_layout"]["layout"]  # tiny's own ZeRO-3 is not the best
    # --set, read back as a run reads it: the very layout the plan describes.
    again = load_config(TINY, select["set"])
    assert Layout.of(again, 4).to_dict() == best["layout"], (select, best["describe"])
    # The TOML lines, pasted into the config, likewise.
    pasted = config_from_dict(merged(load_raw(TINY, []), tomllib.loads("\n".join(select["toml"]))))
    assert Layout.of(pasted, 4).to_dict() == best["layout"]
    assert select["toml"][0] in ("[parallel]", "[train]")

    assert plan_main([TINY, "--device", "cpu", "--workers", "4", "--budget-s", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "  select:    " + " ".join(f"--set {s}" for s in select["set"]) in out
    assert all(f"               {line}\n" in out for line in select["toml"])
    assert "layout: dp RxS = parallel.dp_replicate R x dp_shard S" in out and "HSDP" in LEGEND


def test_the_configs_own_layout_needs_no_change():
    cfg = load_config(TINY)
    own = Layout.of(cfg, 4)
    assert own.changes(cfg, 4) == [] and own.settings(cfg, 4) == "" and own.toml(cfg, 4) == []
    other = dataclasses.replace(own, tp=2, micro_batch=3, sequence_parallel=True)
    assert other.settings(cfg, 4) == "parallel.tp=2 parallel.sequence_parallel=true train.micro_batch=3"
    assert other.toml(cfg, 4) == ["[parallel]", "tp = 2", "sequence_parallel = true", "[train]", "micro_batch = 3"]
