"""Every parallel layout trains exactly like a plain PyTorch loop over the same global batches.

The reference is :func:`reference_loop`: the model built as the trainer builds it, AdamW from
``torch.optim``, the same batches, written here with no etrain training code. The trainer on one
process must match it bit for bit (fp32); then one 4-process group trains the matrix

    ZeRO stage {0,1,2,3} x precision {fp32, bf16} x layout {dp 4, HSDP 2x2, tp 2 x dp 2,
    tp 2 + sequence parallel x dp 2, pp 2 x dp 2 (gpipe, 1f1b, interleaved 1f1b), tp 2 x pp 2}

(tp x pp leaves dp 1 at world 4, where the stage has no effect: it trains once per precision; one
8-process group trains tp 2 x pp 2 x dp 2 with ZeRO 1 and ZeRO 3). fp32 losses must agree with the
reference within 1e-4 relative over the first 5 steps (3 beyond the matrix); bf16 within BF16_RTOL over
the first 2.
Each layout's measured per-rank memory must be within 5% of trainer.observe.device_memory's prediction.
"""

from __future__ import annotations

import math

import pytest

from tests.harness import run_ranks

# The tiny preset made narrower (bf16 matmuls are slow on CPUs), with grouped-query attention.
DIM, FFN, SEQ, VOCAB = 64, 192, 32, 256
BASE = [
    f"model.dim={DIM}", f"model.ffn_hidden={FFN}", "model.n_kv_heads=2",
    "data.max_bytes=2000000", f"data.seq_len={SEQ}",
    "train.global_batch=8", "train.micro_batch=2", "train.warmup_steps=0", "train.lr=3e-3",
    # Small enough that clipping is active: a wrong global norm would show.
    "train.grad_clip=0.5",
]
# bf16: the first loss is the bf16 forward of identical weights, the second follows a bf16 backward
# and an update of the fp32 master weights (the fp32 matrix runs every layout's code for 5 steps).
STEPS, BF16_STEPS = 5, 2
SHORT = 3  # the layouts beyond the matrix, and world 8 (8 processes on 2 cores are slow)
RTOL = 1e-4
# bf16 keeps 8 significant bits (a relative spacing of 2^-8 = 3.9e-3): the forward of identical
# weights already differs from fp32 by about 1e-3, and a step on fp32 master weights stays there
# (observed: at most 0.9e-3 on any layout). 1e-2 is about 2.5 bf16 spacings.
BF16_RTOL = 1e-2

KINDS = {
    "dp4": [],
    "hsdp2x2": ["parallel.dp_replicate=2"],
    # One micro-batch per rank: the same math, half the (slow, on 2 CPU cores) DTensor dispatches.
    "tp2_dp2": ["parallel.tp=2", "train.micro_batch=4"],
    "tp2_sp_dp2": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch=4"],
    "pp2_dp2_gpipe": ["parallel.pp=2", 'parallel.pp_schedule="gpipe"'],
    "pp2_dp2_1f1b": ["parallel.pp=2", 'parallel.pp_schedule="1f1b"'],
    "pp2_dp2_interleaved": ["parallel.pp=2", 'parallel.pp_schedule="interleaved_1f1b"',
                            "parallel.pp_stages_per_rank=2"],
}
PRECISIONS = {"fp32": ('parallel.mixed_precision="fp32"', STEPS), "bf16": ('parallel.mixed_precision="bf16"', BF16_STEPS)}
MATRIX = {
    f"{kind}_zero{z}_{prec}": ([*over, f"parallel.zero_stage={z}", flag], steps)
    for kind, over in KINDS.items() for z in range(4) for prec, (flag, steps) in PRECISIONS.items()
}
MATRIX.update({
    "tp2_pp2_sp_fp32": (["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"], STEPS),
    "tp2_pp2_sp_bf16": (["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                         'parallel.mixed_precision="bf16"'], BF16_STEPS),
    # Recomputation under FSDP, and under sequence parallelism (its all-gathers run again in backward).
    "dp4_zero3_ac_fp32": (['parallel.activation_checkpoint="full"'], STEPS),
    "tp2_sp_dp2_ac_every2_fp32": (["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch=4",
                                   'parallel.activation_checkpoint="every_k"', "parallel.ac_every_k=2"], SHORT),
    # Accepted at dp > 1 (refused at dp 1); on the CPU it has nothing to move and says so.
    "dp4_zero3_offload_fp32": (['parallel.offload="cpu"'], SHORT),
    # Cross-entropy on gathered logits, for the loss-parallel traffic comparison.
    "tp2_dp2_no_loss_parallel_fp32": (["parallel.tp=2", "train.micro_batch=4", "parallel.loss_parallel=false"],
                                      SHORT),
})
MEMORY_LAYOUTS = {f"zero{z}_dp4": f"dp4_zero{z}_fp32" for z in range(4)}
WORLD8 = {  # on top of tp 2 x pp 2
    "tp2_pp2_dp2_zero1_interleaved": ["parallel.zero_stage=1", 'parallel.pp_schedule="interleaved_1f1b"',
                                      "parallel.pp_stages_per_rank=2"],
    "tp2_pp2_dp2_zero3_sp_1f1b": ["parallel.zero_stage=3", "parallel.sequence_parallel=true"],
}


def reference_loop(payload: dict) -> dict:
    """Plain single-process PyTorch: the built-in decoder (or its Mixture of Experts, with the layers' aux
    losses added to the loss) initialised from the seed, AdamW from
    torch.optim (weight decay on matrices only), global-norm clipping, warmup + cosine learning rate,
    gradient accumulation over micro-batches; the batches read with trainer.data.corpus's Batcher. Run in a
    rank process (one thread) so that its kernels sum in the same order as the trainer's."""
    import torch
    import torch.nn.functional as F

    from trainer.config.load import load_config
    from trainer.data.corpus import Batcher, load_corpus
    from trainer.models.decoder.model import Transformer
    from trainer.models.moe import Experts

    cfg = load_config(None, payload["base"])
    t = cfg.train
    batcher = Batcher(load_corpus(cfg.data), cfg.data.seq_len, t.seed, t.global_batch, 0, 1)
    model = Transformer(cfg.model)
    model.init_weights(t.seed)
    for m in model.modules():  # a Mixture of Experts: its experts by a loop (the trainer's by grouped GEMM)
        if isinstance(m, Experts):
            m.grouped = False
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)

    def lr(step: int) -> float:
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.lr * t.min_lr_ratio + t.lr * (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    losses = []
    n_micro = t.global_batch // t.micro_batch
    for step in range(payload["steps"]):
        x, y = batcher.tokens(batcher.local_positions(step * t.global_batch))
        total = torch.zeros(())
        for i in range(n_micro):
            mb = slice(i * t.micro_batch, (i + 1) * t.micro_batch)
            loss = F.cross_entropy(model(x[mb]).flatten(0, 1).float(), y[mb].flatten())
            aux = [m.aux_loss for m in model.modules() if getattr(m, "aux_loss", None) is not None]
            if aux:  # Mixture of Experts (tests/trainer/test_moe.py): the layers' balancing losses join the loss
                loss = loss + torch.stack(aux).sum()
            loss = loss / n_micro
            loss.backward()
            total += loss.detach()
        norm_sq = torch.zeros(())
        for p in params:
            norm_sq += p.grad.pow(2).sum()
        coef = min(1.0, t.grad_clip / (math.sqrt(norm_sq.item()) + 1e-6))
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coef)
        for group in opt.param_groups:
            group["lr"] = lr(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def plain():
    return run_ranks("tests.trainer.test_parity:reference_loop", 1, {"base": BASE, "steps": STEPS})[0]


@pytest.fixture(scope="module")
def reference(plain):
    return plain["losses"]


# What `make test-compat` trains on the oldest supported torch: ZeRO 1, 2 (fp32 and bf16) and 3, HSDP,
# TP with sequence parallelism under ZeRO 1, the three pipeline schedules, and TP x PP.
COMPAT = ("dp4_zero1_fp32", "dp4_zero2_fp32", "dp4_zero2_bf16", "dp4_zero3_fp32", "hsdp2x2_zero3_fp32",
          "tp2_sp_dp2_zero1_fp32", "pp2_dp2_gpipe_zero1_fp32", "pp2_dp2_1f1b_zero2_fp32",
          "pp2_dp2_interleaved_zero3_fp32", "tp2_pp2_sp_fp32")


def marked(names, layout=lambda name: name) -> list:
    """``names`` as test parameters, the ones whose layout is in COMPAT marked ``compat``."""
    return [pytest.param(n, marks=pytest.mark.compat) if layout(n) in COMPAT else n for n in names]


@pytest.fixture(scope="module")
def layouts(request):
    """Every layout that a selected test of this module reads: the whole matrix in a full run, the
    COMPAT ones under ``-m compat`` (a test without a layout parameter reads them all)."""
    wanted = set()
    for item in request.session.items:
        if item.module is request.module and "layouts" in item.fixturenames:
            name = item.callspec.params.get("name") if hasattr(item, "callspec") else None
            wanted |= {MEMORY_LAYOUTS.get(name, name)} if name else set(MATRIX)
    spec = [(name, over, steps) for name, (over, steps) in MATRIX.items() if name in wanted]
    return run_ranks("tests.jobs:train_layouts", 4, {"base": BASE, "layouts": spec}, timeout=900)


@pytest.mark.compat
def test_one_process_matches_plain_pytorch_bitwise(plain):
    """The trainer at world 1 (ZeRO 0's flat gradient buffer, its clipping, AdamW through its
    optimizer, its schedule) gives the plain loop's losses and parameters bit for bit."""
    import torch

    res = run_ranks("tests.jobs:train_layouts", 1, {"base": BASE, "steps": STEPS, "params": True,
                                                    "layouts": [("world1", [])]})[0]["world1"]
    assert res["losses"] == plain["losses"]
    assert res["params"].keys() == plain["params"].keys()
    differ = [n for n, p in plain["params"].items() if not torch.equal(res["params"][n], p)]
    assert not differ, f"parameters differ after {STEPS} steps: {differ}"
    # And training moved: a loop that silently skipped updates would not.
    assert plain["losses"][-1] < plain["losses"][0]


def check_losses(name: str, results: list[dict], reference: list[float], steps: int) -> None:
    rtol = BF16_RTOL if "bf16" in name else RTOL
    for rank, res in enumerate(results):  # every rank reports the same (all-reduced) loss; check all
        got = res[name]["losses"]
        assert len(got) == steps
        for step, (a, b) in enumerate(zip(got, reference)):
            assert abs(a - b) <= rtol * abs(b), f"{name} rank {rank} step {step + 1}: {a} vs reference {b}"
    if "bf16" in name:  # and it did compute in bf16
        assert any(abs(a - b) > RTOL * abs(b) for a, b in zip(results[0][name]["losses"], reference)), name


@pytest.mark.parametrize("name", marked(MATRIX))
def test_layout_matches_reference(name, reference, layouts):
    check_losses(name, layouts, reference, MATRIX[name][1])


def check_memory(name: str, results: list[dict]) -> None:
    for rank, res in enumerate(results):
        measured, predicted = res[name]["memory"], res[name]["predicted"]
        for kind in ("params", "grads", "optimizer"):
            ratio = measured[kind] / predicted[kind]
            assert 0.95 <= ratio <= 1.05, f"{name} rank {rank} {kind}: measured {measured[kind]} predicted {predicted[kind]}"


@pytest.mark.parametrize("name", marked(n for n in MATRIX if n not in MEMORY_LAYOUTS.values()))
def test_layout_memory_matches_prediction(name, layouts):
    check_memory(name, layouts)


@pytest.mark.parametrize("name", marked(MEMORY_LAYOUTS, MEMORY_LAYOUTS.get))
def test_memory_matches_zero_accounting(name, layouts):
    check_memory(MEMORY_LAYOUTS[name], layouts)


def test_stages_shard_what_they_claim(layouts):
    """Stage k+1 holds strictly less of what it shards than stage k."""
    m = {name: layouts[0][MEMORY_LAYOUTS[name]]["memory"] for name in MEMORY_LAYOUTS}
    assert m["zero1_dp4"]["optimizer"] < m["zero0_dp4"]["optimizer"] / 3
    assert m["zero2_dp4"]["grads"] < m["zero1_dp4"]["grads"] / 3
    assert m["zero3_dp4"]["params"] < m["zero2_dp4"]["params"] / 3


@pytest.mark.slow
def test_3d_layout_at_world_8(reference):
    """tp 2 x pp 2 x dp 2 on 8 processes: ZeRO 1 with interleaved 1F1B, and FSDP with sequence
    parallelism and 1F1B (fresh processes: a pool of 8 would idle on 2 cores for the rest of the session)."""
    layouts = list(WORLD8.items())
    base = [*BASE, "parallel.tp=2", "parallel.pp=2"]
    res = run_ranks("tests.jobs:train_layouts", 8, {"base": base, "steps": SHORT, "layouts": layouts},
                    timeout=600, fresh=True)
    for name in WORLD8:
        check_losses(name, res, reference, SHORT)


def test_sequence_and_loss_parallel_traffic(layouts):
    """tp 2 x dp 2 with one micro-batch per rank and step, the tp axis's collectives.

    Plain TP all-reduces each of a block's two regions' output in forward and its input's gradient
    in backward: four per block, one more each for the embedding and the head. Sequence parallelism
    replaces each with an all-gather and a reduce-scatter of the same size (the same bus bytes,
    Megatron-LM v2); what it still all-reduces is small (the norms' gradients, the loss's per-token
    sums). Loss parallelism never all-gathers the logits; without it they are gathered once.
    """
    def tp(name):
        return {k.split("/")[0]: v for k, v in layouts[0][name]["comm"].items() if k.endswith("/tp")}

    plain_tp, sp, gathered = tp("tp2_dp2_zero3_fp32"), tp("tp2_sp_dp2_zero3_fp32"), tp("tp2_dp2_no_loss_parallel_fp32")
    n_layers, mb = 4, 4
    region = mb * SEQ * DIM * 4  # bytes of one fp32 activation of the whole sequence
    loss = 3 * mb * SEQ * 4  # the loss's all-reduces: max, sum of exponentials, target logit per token
    n = 4 * n_layers + 2
    assert set(plain_tp) == {"all_reduce"}, plain_tp
    assert plain_tp["all_reduce"]["calls"] == n + 3 and plain_tp["all_reduce"]["bytes"] == n * region + loss, plain_tp
    assert sp["all_gather"]["calls"] == sp["reduce_scatter"]["calls"] == n, sp
    assert sp["all_gather"]["bytes"] == sp["reduce_scatter"]["bytes"] == n * region, sp
    assert sp["all_gather"]["bus_bytes"] + sp["reduce_scatter"]["bus_bytes"] == pytest.approx(
        plain_tp["all_reduce"]["bus_bytes"] * n * region / (n * region + loss)), (sp, plain_tp)
    assert sp["all_reduce"]["bytes"] < 0.01 * plain_tp["all_reduce"]["bytes"], (sp, plain_tp)
    assert gathered["all_reduce"]["bytes"] == n * region, gathered
    assert gathered["all_gather"] == pytest.approx({**gathered["all_gather"], "calls": 1, "bytes": mb * SEQ * VOCAB * 4})
