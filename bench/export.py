"""Export and init_from speed, side by side with their baselines in one run.

    python bench/export.py [--quick]

A built-in decoder of ~110M parameters (~440 MB of fp32 weights; ``--quick``: ~30 MB) with its AdamW
state is committed as one checkpoint step to ``file://`` (world 1). Per round, back to back:

* ``export_ratio_vs_raw``: ``etrain ckpt export --format hf`` (read each tensor from the DCP files,
  check them, convert names and rotary rows, stream to ``model.safetensors``) against a raw
  ``safetensors.torch.save_file`` of the same consolidated tensors, already in memory, to the same
  disk: raw time over export time (the throughput ratio; goal >= 0.8).
  Both times include an fsync of the file written.
* ``init_from_s`` vs ``from_pretrained_s``: loading the export into a built model through
  ``model.init_from`` (:func:`trainer.export.convert.load_weights`: every tensor copied into the parameters),
  against ``transformers``' ``AutoModelForCausalLM.from_pretrained`` of the same directory (the whole
  call; it maps the file, so pages are read when first touched).

Medians over the rounds after a first, uncounted one; the last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from checkpointing.manager import CheckpointManager  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.export.convert import WeightSource, export, load_weights  # noqa: E402
from trainer.models.decoder.model import Transformer  # noqa: E402
from trainer.models.names.llama import hf_name, to_hf

FULL = dict(dim=1024, n_layers=6, n_heads=8, n_kv_heads=8, ffn_hidden=2816, vocab_size=16384, max_seq_len=512)
QUICK = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=704, vocab_size=8192, max_seq_len=256)


def commit_state(root: str, mcfg: ModelConfig) -> tuple[str, dict[str, torch.Tensor]]:
    """A committed step 1 of run "bench" with random weights and AdamW state; its URL and the weights."""
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(mcfg).state_dict().items()}
    model = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    optim = {k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v), "step": torch.tensor(1.0)}
             for k, v in model.items()}
    mgr = CheckpointManager(f"file://{root}", "bench", async_save=False)
    res = mgr.save(1, {"model": model, "optim": optim}, layout={"world_size": 1}, config_hash="bench",
                   trainer_state={"step": 1, "samples_consumed": 0},
                   config={"model": dataclasses.asdict(mcfg), "data": {"tokenizer": "bytes"}})
    mgr.wait()
    assert res is not None and res.status == "committed", res
    mgr.close()
    return mgr.url_of(1), model


def fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 5)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    mcfg = ModelConfig(**(QUICK if args.quick else FULL))
    tmp = tempfile.mkdtemp(prefix="etrain-bench-export-")
    try:
        t0 = time.monotonic()
        url, model = commit_state(os.path.join(tmp, "ck"), mcfg)
        save_s = time.monotonic() - t0
        state_bytes = sum(t.numel() * t.element_size() for t in model.values())
        hf = {hf_name(k): to_hf(k, v, mcfg).contiguous() for k, v in model.items()}
        del model
        print(f"committed {state_bytes / 2**20:.0f} MB of weights (+ AdamW state) in {save_s:.1f}s", flush=True)
        exp, raw, init, pre = [], [], [], []
        for r in range(rounds + 1):  # round 0 warms up (imports, page cache) and is not counted
            out = os.path.join(tmp, f"hf{r}")
            t0 = time.monotonic()
            export(url, out, "hf")
            fsync(os.path.join(out, "model.safetensors"))
            exp.append(time.monotonic() - t0)
            t0 = time.monotonic()
            save_file(hf, os.path.join(tmp, f"raw{r}.safetensors"), metadata={"format": "pt"})
            fsync(os.path.join(tmp, f"raw{r}.safetensors"))
            raw.append(time.monotonic() - t0)
            m = Transformer(mcfg)  # the trainer has built its model when init_from loads
            t0 = time.monotonic()
            load_weights(dict(m.named_parameters()), WeightSource(out, mcfg))
            init.append(time.monotonic() - t0)
            del m
            t0 = time.monotonic()
            m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            pre.append(time.monotonic() - t0)
            del m
            print(f"round {r}: export {exp[-1]:.2f}s, raw safetensors {raw[-1]:.2f}s, init_from {init[-1]:.2f}s, "
                  f"from_pretrained {pre[-1]:.2f}s", flush=True)
            shutil.rmtree(out)
            os.remove(os.path.join(tmp, f"raw{r}.safetensors"))
        e, w, i, p = (statistics.median(x[1:]) for x in (exp, raw, init, pre))
        print(json.dumps({"bench": "export", "quick": args.quick, "rounds": rounds, "weights_mb": round(state_bytes / 2**20),
                          "export_s": round(e, 3), "raw_safetensors_s": round(w, 3),
                          "export_mb_per_s": round(state_bytes / 2**20 / e, 1),
                          "export_ratio_vs_raw": round(w / e, 3), "export_ok": w / e >= 0.8,
                          "init_from_s": round(i, 3), "from_pretrained_s": round(p, 3),
                          "init_from_speedup_vs_from_pretrained": round(p / i, 3)}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
