"""Per-rank memory for parameters, gradients and optimizer state: predicted and measured.

    predicted = predict(cfg, dims, rank, device_type)   # before anything is built
    measured = optimizer.memory_bytes()                 # on the live run, after a step

The prediction is the ZeRO paper's accounting (Rajbhandari et al., 2020),
applied to the parameters this rank holds after tensor and pipeline
parallelism (``P``), with ``N`` the size of the sharding axis (dp_shard):

=========  ==================  ==================  ===================
stage      parameters          gradients           optimizer state
=========  ==================  ==================  ===================
fp32 (CPU default): 4 + 4 + 8 bytes per parameter (AdamW m and v)
0          4P                  4P                  8P
1          4P                  4P                  8P / N
2          4P                  4P / N              8P / N
3          4P / N              4P / N              8P / N
bf16 (GPU default): 2 + 2 + 12 bytes per parameter (fp32 master, m, v)
0          2P                  2P                  12P
1          2P                  2P                  12P / N
2          2P                  4P / N              12P / N
3          4P / N              4P / N              8P / N
=========  ==================  ==================  ===================

Two deliberate departures from the paper, both on GPU only: stage 2 keeps its
gradient shard in fp32 (the reduction runs in fp32), and stage 3 is FSDP2,
whose sharded parameters are themselves the fp32 master copy, so it holds
4 + 4 + 8 bytes per sharded parameter plus transient bf16 copies of the
blocks being computed. Activations and transient communication buffers are
not counted: they depend on batch and sequence length, not on the stage.
"""

from __future__ import annotations

from .config import RunConfig
from .model import layer_split
from .parallel_dims import ParallelDims


def local_param_count(cfg: RunConfig, dims: ParallelDims, rank: int) -> int:
    """Parameters this rank holds after tensor and pipeline parallelism, before ZeRO."""
    m, tp = cfg.model, dims.tp
    hd = m.head_dim
    attn = (m.dim * m.n_heads * hd * 2 + m.dim * m.n_kv_heads * hd * 2) // tp
    block = attn + 3 * m.dim * m.ffn_hidden // tp + 2 * m.dim
    n_stages = dims.pp * cfg.parallel.pp_stages_per_rank
    split = layer_split(m.n_layers, n_stages)
    pp_rank = dims.coords(rank)["pp"]
    stages = [pp_rank + k * dims.pp for k in range(cfg.parallel.pp_stages_per_rank)] if dims.pp > 1 else [0]
    total = 0
    for s in stages:
        total += len(split[s]) * block
        if s == 0:
            total += m.vocab_size * m.dim // tp
        if s == n_stages - 1:
            total += m.vocab_size * m.dim // tp + m.dim
    return total


def bytes_per_param(stage: int, n: int, mixed: bool) -> dict[str, float]:
    """Bytes per local parameter for a ZeRO stage sharded ``n`` ways."""
    if mixed:
        table = {0: (2, 2, 12), 1: (2, 2, 12 / n), 2: (2, 4 / n, 12 / n), 3: (4 / n, 4 / n, 8 / n)}
    else:
        table = {0: (4, 4, 8), 1: (4, 4, 8 / n), 2: (4, 4 / n, 8 / n), 3: (4 / n, 4 / n, 8 / n)}
    p, g, o = table[stage]
    return {"params": p, "grads": g, "optimizer": o}


def predict(cfg: RunConfig, dims: ParallelDims, rank: int, mixed: bool = False) -> dict[str, int]:
    """Predicted bytes on ``rank`` for parameters, gradients and optimizer state."""
    stage = cfg.parallel.zero_stage if dims.dp > 1 else 0
    n = dims.dp_shard if stage > 0 else 1
    count = local_param_count(cfg, dims, rank)
    return {k: round(v * count) for k, v in bytes_per_param(stage, n, mixed).items()}


def compare(predicted: dict[str, int], measured: dict[str, int]) -> dict[str, float]:
    """measured / predicted per kind (1.0 = exact)."""
    return {k: (measured[k] / predicted[k] if predicted[k] else float("nan")) for k in predicted}
