"""Step time of a Hugging Face Llama trained by etrain against a minimal hand-written FSDP2 loop.

    python bench/hf_step.py [--quick] [--world 2]

The model is ``transformers``' LlamaForCausalLM built from a config written here (no download): the
largest that steps in under a second at world 2 on this 2-core machine. etrain trains it with
``model.source = "hf"`` at ZeRO-3; the baseline is what one writes by hand: ``fully_shard`` per
decoder layer and the root, torch's AdamW and clip_grad_norm_, the same global batch, in the same
processes, alternating rounds so noise hits both alike. Prints the median seconds per step of each
and, last, one JSON line with ``tokens_per_s``, ``baseline_tokens_per_s`` and ``overhead_ratio``
(etrain's step time over the baseline's; 1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.torchrun import alternate, parse_args, relaunch, slowest_rank_medians, time_steps  # noqa: E402

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
SEQ, GLOBAL_BATCH, MICRO = 128, 8, 4


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.config.load import load_config
    from trainer.loop import Trainer
    from trainer.world import World, init_distributed, shutdown_distributed

    world = World.from_env()
    device = torch.device("cpu")
    init_distributed(world, device)
    rounds = args.rounds or (3 if args.quick else 7)
    per_round = args.steps_per_round or (4 if args.quick else 8)
    cfg_dir = os.path.join(tempfile.gettempdir(), f"etrain-bench-hf-{os.getppid()}")
    if world.is_main:
        os.makedirs(cfg_dir, exist_ok=True)
        with open(os.path.join(cfg_dir, "config.json"), "w") as f:
            json.dump(LLAMA, f)
    dist.barrier()
    cfg = load_config(None, ['model.source="hf"', f'model.hf_config="{cfg_dir}"', "data.max_bytes=4000000",
                             f"data.seq_len={SEQ}", f"train.global_batch={GLOBAL_BATCH}", f"train.micro_batch={MICRO}",
                             "train.warmup_steps=0", "parallel.zero_stage=3", f"train.steps={10**6}",
                             "metrics.enabled=false"])
    trainer = Trainer(cfg, world, device=device)

    # The baseline: transformers' model, sharded by hand.
    mesh = init_device_mesh("cpu", (world.size,))
    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg_dir), dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay, foreach=True)
    x, y = trainer.batcher.tokens(trainer.batcher.local_positions(0))
    n_micro = (GLOBAL_BATCH // world.size) // MICRO

    def baseline_step() -> None:
        for i in range(n_micro):
            sl = slice(i * MICRO, (i + 1) * MICRO)
            logits = model(input_ids=x[sl]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y[sl].flatten()) / n_micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # warm-up
        baseline_step()
        trainer.train_step()
    ours, base = alternate(rounds, lambda: time_steps(trainer.train_step, per_round),
                           lambda: time_steps(baseline_step, per_round))
    ours_s, base_s = slowest_rank_medians(ours, base)
    if world.is_main:
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg_dir))
                       .parameters())
        tokens = GLOBAL_BATCH * SEQ
        print(f"etrain  : {ours_s * 1e3:.1f} ms/step (median of {len(ours)})")
        print(f"baseline: {base_s * 1e3:.1f} ms/step (hand-written FSDP2 loop over the same transformers model)")
        print(json.dumps({
            "bench": "hf_step", "model": "LlamaForCausalLM", "params": n_params, "world": world.size,
            "zero_stage": 3, "device": "cpu", "tokens_per_s": round(tokens / ours_s, 1),
            "baseline_tokens_per_s": round(tokens / base_s, 1), "overhead_ratio": round(ours_s / base_s, 4),
            "seconds_per_step": round(ours_s, 4), "steps_measured": len(ours),
        }), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    a = parse_args("fewer rounds (about a minute here)")
    if "RANK" in os.environ:
        worker(a)
    else:
        sys.exit(relaunch(__file__, a.world))
