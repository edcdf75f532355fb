"""The Python API end to end, runnable as is: ``.venv/bin/python examples/python_api.py``.

1. trains a small Hugging Face Llama (built from a config written here, nothing downloaded) in this
   process with a held-out evaluation, and runs it again with ``resume=True``, as a retried job would: it
   restores the last checkpoint and has no step left to train (training on past ``train.steps`` would be
   another config, and the resume would warn that its learning-rate schedule moves);
2. submits the same model as an elastic run on a local Ray (127.0.0.1), resizes it from 2 workers to 1,
   suspends it, resumes it on 2, and waits for it to finish.
"""

from __future__ import annotations

import json
import os
import tempfile

import etrain

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "tie_word_embeddings": False}


def main() -> None:
    work = tempfile.mkdtemp(prefix="etrain-api-")
    os.makedirs(f"{work}/llama")
    with open(f"{work}/llama/config.json", "w") as f:
        json.dump(LLAMA, f)
    config = {
        "run_id": "api-example",
        "model": {"source": "hf", "hf_config": f"{work}/llama"},
        "data": {"seq_len": 64, "max_bytes": 2_000_000},
        "train": {"steps": 20, "global_batch": 8, "micro_batch": 4, "log_every": 5},
        "eval": {"every_steps": 10, "batches": 2, "val_fraction": 0.05},
        "checkpoint": {"url": f"file://{work}/ckpt", "interval_steps": 10},
        "metrics": {"file_sd_dir": "-"},
    }

    # 1. In this process (under torchrun, each rank runs this same call).
    result = etrain.train(config)
    print(f"trained to step {result.step}: loss {result.first_loss:.3f} -> {result.loss:.3f}, "
          f"eval loss {result.eval_loss:.3f}")
    result = etrain.train(config, resume=True, quiet=True)  # the same config: nothing changed, nothing to warn of
    print(f"resumed at step {result.step}: nothing left to train")

    # 2. On Ray: an elastic run that goes on in the background of this process.
    run = etrain.submit({**config, "run_id": "api-example-ray", "train": {**config["train"], "steps": 60}},
                        workers=2, min_workers=1, max_workers=2, store=f"file://{work}/ckpt")
    print("submitted:", run)
    run.wait(until_step=10)
    run.resize(1)                      # at the next step boundary
    run.wait(until_step=20)
    run.suspend()
    print("suspended at step", run.wait()["step"])
    final = run.resume(workers=2).wait()
    print(f"{final['phase']} at step {final['step']}; loss {final['loss']:.3f}; "
          f"{len(run.events('resized'))} resizes")


if __name__ == "__main__":
    main()
