"""``[checkpoint] export_every``: transformers exports written in the background beside the checkpoints.

One world-2 run (``python -m trainer``'s ``train_config`` in each rank process, interval_steps=2,
export_every=4, 8 steps, keep_last=1, a word-level tokenizer trained here) leaves ``exports/step_000000004``
and ``exports/step_000000008``, each committed by its manifest. ``transformers`` loads the export and
its logits equal the model of the checkpoint of the same step (each export is a tracker event); its files are bitwise those of
``etrain ckpt export`` of that step; its tokenizer loads with ``AutoTokenizer`` and encodes as the
run's. An export directory without its manifest is reported incomplete and refused, and is written
again; a complete one is not; a resumed run exports the step it resumes from only when its export
is incomplete. The S3 variant exports a copy of the checkpoint on the moto server.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from checkpointing.errors import ConfigError
from checkpointing.export.weights import EXPORT_MANIFEST, list_exports, read_export_manifest
from checkpointing.manager import CheckpointManager
from checkpointing.manifest import MANIFEST_NAME
from checkpointing.storage.base import Storage
from orchestrator.cli.main import main as etrain
from tests.harness import run_ranks
from trainer.config.load import load_config
from trainer.export.every import ExportJobs, ExportResult
from trainer.export.every import main as export_step

RUN = "ev"
EOS = "<|endoftext|>"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly bishop".split()


def base(root, tok_dir) -> list[str]:
    return ["data.max_bytes=60000", "data.seq_len=16", "train.global_batch=4", "train.micro_batch=2",
            "train.warmup_steps=1", "train.steps=8", "metrics.enabled=false", "model.vocab_size=320",
            f'data.tokenizer="{tok_dir}/tokenizer.json"', f'data.source="{tok_dir}/docs.jsonl"',
            f'data.cache_dir="{root}/cache"', f'checkpoint.url="file://{root}/ck"', f'run_id="{RUN}"',
            "checkpoint.interval_steps=2", "checkpoint.export_every=4", "checkpoint.keep_last=1"]


def train_job(payload: dict) -> dict:
    """One rank of ``python -m trainer`` on ``payload["overrides"]``; rank 0 also returns its exports."""
    from trainer.cli import train_config

    out = train_config(lambda: load_config(None, payload["overrides"]), quiet=True)
    cfg = load_config(None, payload["overrides"])
    jobs = ExportJobs._registry.get((cfg.checkpoint.url.rstrip("/"), cfg.run_id))
    return {"exit": out.exit_code, "error": out.error, "step": out.step,
            "exports": [r.__dict__ for r in jobs.results] if jobs else []}


def resume_job(payload: dict) -> dict:
    """Load the newest checkpoint into a world-2 trainer (what a resumed run does first), then wait
    for what rank 0's exports did."""
    from tests.ckpt_jobs import CPU
    from trainer.export.every import wait_for_exports
    from trainer.checkpoints import checkpoint_manager
    from trainer.loop import Trainer
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, CPU)
    try:
        cfg = load_config(None, payload["overrides"])
        trainer = Trainer(cfg, world)
        out = {}
        for attempt in ("complete", "incomplete"):
            if attempt == "incomplete" and world.rank == 0:
                os.remove(payload["manifest"])  # as if the previous run ended while exporting
            mgr = checkpoint_manager(cfg, world)
            out["step"] = trainer.load_checkpoint(mgr).step
            out[attempt] = [(r.step, r.status) for r in wait_for_exports(mgr, quiet=True)]
        return out
    finally:
        shutdown_distributed()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """Documents and a word-level tokenizer trained on them (tokenizers), saved as tokenizer.json."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    rng = np.random.default_rng(0)
    docs = [f"doc {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(8, 40)))) for i in range(300)]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(vocab_size=300, special_tokens=["[UNK]", EOS],
                                                            show_progress=False))
    tok.save(str(d / "tokenizer.json"))
    with open(d / "docs.jsonl", "w") as f:
        for t in docs:
            f.write(json.dumps({"text": t}) + "\n")
    return d


@pytest.fixture(scope="module")
def run(tmp_path_factory, tok_dir):
    root = tmp_path_factory.mktemp("every")
    t0 = time.monotonic()
    overrides = base(root, tok_dir) + [f'logging.tensorboard_dir="{root}/tb"']
    res = run_ranks("tests.trainer.test_export_every:train_job", 2, {"overrides": overrides}, timeout=300)
    assert [r["exit"] for r in res] == [0, 0], res
    return {"root": root, "url": f"file://{root}/ck", "exports": res[0]["exports"], "seconds": time.monotonic() - t0}


def exports_dir(root, step: int):
    return root / "ck" / RUN / "exports" / f"step_{step:09d}"


def test_a_run_exports_every_4th_step_committed_by_a_manifest(run):
    root = run["root"]
    assert [(e["step"], e["status"]) for e in run["exports"]] == [(4, "exported"), (8, "exported")], run["exports"]
    assert list_exports(Storage(run["url"]), RUN) == {4: "complete", 8: "complete"}
    for step in (4, 8):
        d = exports_dir(root, step)
        m = json.loads((d / EXPORT_MANIFEST).read_text())
        assert m["step"] == step and m["source"].endswith(f"/{RUN}/checkpoints/step_{step:09d}")
        assert sorted(f["path"] for f in m["files"]) == sorted(p for p in os.listdir(d) if p != EXPORT_MANIFEST)
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(d))
    # keep_last=1 pruned the checkpoints behind it, never the one an export was reading
    assert CheckpointManager(run["url"], RUN).committed_steps()[-1] == 8
    # each export is an event for the trackers, at the training step when it was written
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "tb" / RUN))
    acc.Reload()
    assert [e.value for e in acc.Scalars("events/export/step")] == [4.0, 8.0]
    assert [e.value for e in acc.Scalars("events/export")] == [1.0, 2.0]


def test_transformers_loads_the_export_with_the_logits_of_its_checkpoint(run, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.export.convert import export, model_config
    from trainer.models.decoder.model import Transformer

    step_url = f"{run['url']}/{RUN}/checkpoints/step_000000008"
    export(step_url, str(tmp_path / "ck8.safetensors"), "safetensors")
    cfg = CheckpointManager(run["url"], RUN).read_manifest(8).config
    model = Transformer(model_config(cfg)).eval()
    model.load_state_dict(load_file(str(tmp_path / "ck8.safetensors")))
    hf = AutoModelForCausalLM.from_pretrained(str(exports_dir(run["root"], 8))).eval()
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(input_ids=tokens).logits).abs().max().item() < 1e-4
    # the same files, bitwise, as `etrain ckpt export` of that step
    out = tmp_path / "by-hand"
    assert etrain(["ckpt", "export", step_url, str(out), "--format", "hf"]) == 0
    ours = exports_dir(run["root"], 8)
    assert sorted(os.listdir(out)) == sorted(os.listdir(ours))
    for name in os.listdir(ours):
        if name != EXPORT_MANIFEST:
            assert (out / name).read_bytes() == (ours / name).read_bytes(), name
    files = [json.loads((d / EXPORT_MANIFEST).read_text())["files"] for d in (out, ours)]
    assert files[0] == files[1]


def test_the_export_tokenizer_encodes_as_the_run_did(run, tok_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from trainer.data.tokenize import load_tokenizer

    ours = load_tokenizer(str(tok_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(exports_dir(run["root"], 8)))
    texts = ["the quick brown fox", "doc 7: seven wizards  quietly\n\nhex naïve café 😀", "", "doc 299: lazy"]
    assert [auto.encode(t, add_special_tokens=False) for t in texts] == \
        [a.tolist() for a in ours.encode_batch(texts)]
    assert [auto.encode(t) for t in texts] == [e.ids for e in Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
                                               .encode_batch(texts)]
    assert auto.eos_token == EOS and auto.convert_tokens_to_ids(EOS) == ours.eos_id


def test_an_export_without_its_manifest_is_incomplete_refused_and_written_again(run, tmp_path, capsys):
    from trainer.export.convert import WeightSource, model_config

    root, url = run["root"], run["url"]
    before = {p: (exports_dir(root, 4) / p).read_bytes() for p in os.listdir(exports_dir(root, 4))}
    cut = exports_dir(root, 12)  # what an export cut short leaves: files, no manifest
    shutil.copytree(exports_dir(root, 4), cut)
    os.remove(cut / EXPORT_MANIFEST)
    assert list_exports(Storage(url), RUN) == {4: "complete", 8: "complete", 12: "incomplete"}
    from checkpointing.cli import main as ckpt

    assert ckpt(["ls", url, "--run", RUN, "--json"]) == 0  # etrain ckpt ls shows them beside the checkpoints
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[8]["export"] == "complete" and "export" not in rows.get(6, {})
    assert ckpt(["ls", url, "--run", RUN]) == 0
    assert "        12  incomplete" in capsys.readouterr().out
    # verify checks an export as an export: its manifest, every file's crc32c, the checkpoint it came from
    assert ckpt(["verify", f"{url}/{RUN}/exports/step_000000004"]) == 0
    assert "ok   " in capsys.readouterr().out
    assert ckpt(["verify", f"{url}/{RUN}/exports/step_000000012"]) == 1
    assert "FAIL " in (out := capsys.readouterr().out) and "incomplete" in out, out
    assert ckpt(["inspect", f"{url}/{RUN}/exports/step_000000004"]) == 1  # an export is not a checkpoint
    err = capsys.readouterr().err
    assert "is an export of run 'ev'" in err and err.count("\n") == 1, err
    assert read_export_manifest(Storage(url), f"{RUN}/exports/step_000000012") is None
    mcfg = model_config(CheckpointManager(url, RUN).read_manifest(8).config)
    with pytest.raises(ConfigError, match="incomplete export"):
        WeightSource(str(cut), mcfg)
    from trainer.generate import load as load_for_generate

    with pytest.raises(ConfigError, match="incomplete export"):  # etrain generate refuses it too
        load_for_generate(str(cut))
    assert WeightSource(str(exports_dir(root, 4)), mcfg).hf_names  # a complete one is a transformers directory
    # the export of step 4 again, as export_every runs it: a complete one is left alone ...
    assert export_step([url, RUN, "4"]) == 0
    assert {p: (exports_dir(root, 4) / p).read_bytes() for p in os.listdir(exports_dir(root, 4))} == before
    # ... an incomplete one (a stray file, no manifest) is replaced: the same files, committed again
    os.remove(exports_dir(root, 4) / EXPORT_MANIFEST)
    (exports_dir(root, 4) / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    assert export_step([url, RUN, "4"]) == 0
    after = {p: (exports_dir(root, 4) / p).read_bytes() for p in os.listdir(exports_dir(root, 4))}
    assert after.keys() == before.keys()
    assert all(after[p] == before[p] for p in before if p != EXPORT_MANIFEST)
    # a manifest is data, checked before use: one of another step is corrupt
    manifest = json.loads((exports_dir(root, 4) / EXPORT_MANIFEST).read_text())
    (cut / EXPORT_MANIFEST).write_text(json.dumps(manifest))
    assert list_exports(Storage(url), RUN)[12].startswith("corrupt: ") and "directory names (12)" in \
        list_exports(Storage(url), RUN)[12]
    shutil.rmtree(cut)


def test_a_resumed_run_exports_its_step_only_when_the_export_is_incomplete(run, tok_dir):
    overrides = base(run["root"], tok_dir) + ["checkpoint.resume=true"]
    manifest = str(exports_dir(run["root"], 8) / EXPORT_MANIFEST)
    res = run_ranks("tests.trainer.test_export_every:resume_job", 2, {"overrides": overrides, "manifest": manifest},
                    timeout=300)
    assert res[0]["step"] == 8
    assert res[0]["complete"][-1] == (8, "exists") and res[0]["incomplete"][-1] == (8, "exported"), res[0]
    assert res[1]["complete"] == res[1]["incomplete"] == []  # rank 0 alone exports
    assert list_exports(Storage(run["url"]), RUN)[8] == "complete"


def test_one_export_at_a_time_and_a_newer_step_replaces_a_waiting_one(tmp_path):
    """The queue alone: an export that takes 0.3 s, steps 4, 8 and 12 due at once. 4 runs, 8 waits
    and is replaced by 12; retention keeps what runs and waits."""
    mgr = CheckpointManager(f"file://{tmp_path}", "q")
    jobs = ExportJobs(f"file://{tmp_path}", "q", 4)
    jobs.manager = mgr
    running = []

    def slow(step):
        running.append((step, set(mgr.pinned)))
        time.sleep(0.3)
        return ExportResult(step, "exported", jobs.export_url(step))

    jobs._export = slow
    for step in (2, 4, 8, 12):  # 2 is not due
        jobs.submit(step)
    assert jobs.wait(10)
    assert [(r.step, r.status) for r in jobs.results] == [(8, "skipped"), (4, "exported"), (12, "exported")]
    assert running == [(4, {4}), (12, {12})] and mgr.pinned == frozenset()
    assert jobs.export_url(12) == f"file://{tmp_path}/q/exports/step_000000012"


def test_a_failed_export_is_reported_and_never_raised(run, caplog):
    """A real export process that fails (step 12 was never committed): a result and a warning with the
    process's own message; nothing raised, nothing left behind."""
    jobs = ExportJobs(run["url"], RUN, 4)
    jobs.submit(12)
    assert jobs.wait(120)
    (failed,) = jobs.results
    assert failed.status == "failed" and failed.step == 12 and "never committed" in failed.error, failed
    assert "export of step 12 to " in caplog.text and "failed (training goes on)" in caplog.text
    assert list_exports(Storage(run["url"]), RUN) == {4: "complete", 8: "complete"}


def test_export_every_must_be_a_multiple_of_interval_steps(tmp_path, monkeypatch, capsys):
    url = f'checkpoint.url="file://{tmp_path}/ck"'
    with pytest.raises(ConfigError, match=r"checkpoint.export_every=5 must be a multiple of "
                                          r"checkpoint.interval_steps=2; use export_every=4"):
        load_config(None, [url, "checkpoint.interval_steps=2", "checkpoint.export_every=5"])
    with pytest.raises(ConfigError, match="interval_steps=0; use interval_steps=4 or a divisor"):
        load_config(None, [url, "checkpoint.export_every=4"])
    with pytest.raises(ConfigError, match='model.source="python"'):
        load_config(None, [url, "checkpoint.interval_steps=2", "checkpoint.export_every=4", 'model.source="python"',
                           'model.factory="tests.custom_model:build"'])
    assert load_config(None, [url, "checkpoint.interval_steps=2", "checkpoint.export_every=6"]).checkpoint.export_every
    from trainer.cli import main as train

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert train(["--set", url, "--set", "checkpoint.interval_steps=3", "--set", "checkpoint.export_every=4"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.export_every=4 must be a multiple of checkpoint.interval_steps=3" in err, err
    assert not os.path.exists(tmp_path / "ck")  # refused before anything was written
    assert train(["--set", 'checkpoint.url="memory://ev"', "--set", "checkpoint.interval_steps=2", "--set",
                  "checkpoint.export_every=2", "--set", "data.max_bytes=20000"]) == 2
    assert "needs storage another process can read" in capsys.readouterr().err


def test_export_to_s3_and_from_s3(run, s3_server, tmp_path):
    """``etrain ckpt export`` to an S3 URL, and the export of a committed step held on S3 (a copy of the
    run's checkpoint on the moto server) as export_every writes it: the same bytes as on file://."""
    from tests.conftest import new_bucket

    root = run["root"]
    s3 = f"s3://{new_bucket(s3_server)}/runs"
    local = Storage(run["url"])
    rel = f"{RUN}/checkpoints/step_000000008"
    names = [n for n, size in local.list_dir(rel).items() if size is not None and n != MANIFEST_NAME]
    Storage(s3).put_many([(f"{rel}/{n}", local.get(f"{rel}/{n}")) for n in names])
    Storage(s3).put(f"{rel}/{MANIFEST_NAME}", local.get(f"{rel}/{MANIFEST_NAME}"))  # the commit, last
    assert export_step([s3, RUN, "8"]) == 0
    remote = Storage(s3)
    ours = exports_dir(root, 8)
    erel = f"{RUN}/exports/step_000000008"
    assert read_export_manifest(remote, erel)["files"] == json.loads((ours / EXPORT_MANIFEST).read_text())["files"]
    for name in os.listdir(ours):
        if name != EXPORT_MANIFEST:
            assert remote.get(f"{erel}/{name}") == (ours / name).read_bytes(), name
    assert list_exports(remote, RUN) == {8: "complete"}
    # a complete export on S3 is not written again (the parent's check, no process started)
    jobs = ExportJobs(s3, RUN, 4)
    jobs.submit(8)
    assert jobs.wait(60) and [(r.step, r.status) for r in jobs.results] == [(8, "exists")]
    # one safetensors file to a URL; an existing one is refused without --overwrite
    target = f"{s3}/single/model.safetensors"
    assert etrain(["ckpt", "export", f"{s3}/{rel}", target, "--format", "safetensors"]) == 0
    export_local = tmp_path / "m.safetensors"
    assert etrain(["ckpt", "export", f"{s3}/{rel}", str(export_local), "--format", "safetensors"]) == 0
    assert remote.get("single/model.safetensors") == export_local.read_bytes()
    assert etrain(["ckpt", "export", f"{s3}/{rel}", target, "--format", "safetensors"]) == 2
