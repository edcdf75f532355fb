"""``[parallel]``: the parallel layout (dp_replicate x dp_shard x cp x tp x pp) and its precision; the rules of
context parallelism (cp) and of expert parallelism (ep), each in one place.

    check_cp(cfg.parallel, cfg.model, cfg.data.seq_len, tp)   # a run's cp (trainer.parallel.dims, at its size)
    check_ep(cfg.parallel, cfg.model)                         # ep against the model (RunConfig)
    check_ep_carved(ep, dp_shard)                             # ep against a size's dp_shard (ParallelDims)
    ep_degrees(n_experts, dp_shard), expert_degree(...)       # what the planner offers, what ep=0 takes

Every check of cp and of ep is here (the field checks of :class:`ParallelConfig` too): the config, the mesh
(:class:`trainer.parallel.dims.ParallelDims`), the context (:mod:`trainer.parallel.context`) and the planner
(:mod:`trainer.plan.search`) ask these rules and never restate them. What a model's own attention or experts need
is its spec's (:mod:`trainer.models`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from checkpointing.errors import ConfigError

from .checks import MAX_MIB, MAX_RANKS, MAX_SAMPLES, check_finite, check_range, divisors, fmt_list, or_join
from .model import SIZE_BOUNDS, ModelConfig

CP_STYLES = ("ring", "allgather", "ulysses")
# Bounds (docs/operations.md#bounds): the degrees are ranks (each with its least value: -1 and 0 are automatic or
# off); ZeRO++'s scale blocks and the offload buffers are sizes.
DEGREES = {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1, "cp": 1, "ep": 0, "hpz_partition_size": 0}
MAX_QUANT_BLOCK = 1_048_576
MIN_BUFFER_MB = 0.001


@dataclass(kw_only=True)
class ParallelConfig:
    """The parallel layout: dp_replicate x dp_shard x cp x tp x pp = world size."""

    dp_replicate: int = 1
    # -1: whatever the world size leaves after dp_replicate, tp and pp. This is
    # the elastic axis: resizing a run changes it and nothing else.
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    # 0 replicate (DDP), 1 + optimizer state sharded, 2 + gradients sharded,
    # 3 + parameters sharded (FSDP2 fully_shard).
    zero_stage: int = 3
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    # Pipeline stages held by each pp rank (> 1 with interleaved_1f1b).
    pp_stages_per_rank: int = 1
    # Pipeline micro-batches per step on one data-parallel rank; 0 = the local
    # batch divided by train.micro_batch.
    pp_microbatches: int = 0
    # "selective": every block keeps its matmul outputs and recomputes the rest in backward.
    activation_checkpoint: Literal["none", "full", "every_k", "selective"] = "none"
    ac_every_k: int = 2
    # "float8": bf16, with the blocks' linears in float8 through torchao (CUDA, compute capability >= 8.9).
    mixed_precision: Literal["auto", "fp32", "bf16", "float8"] = "auto"
    # "cpu": FSDP2's host offload (ZeRO-3). "nvme": any stage keeps AdamW's state in per-rank files under
    # offload_dir, swapped through a fixed pool of host buffers (trainer.zero.offload; docs/parallelism.md).
    offload: Literal["none", "cpu", "nvme"] = "none"
    # offload="nvme": a local directory (each run and rank gets its own subdirectory of scratch files) and
    # the MiB of host buffers its optimizer state streams through.
    offload_dir: str = ""
    offload_buffer_mb: float = 64.0
    # offload="nvme" in bf16: the fp32 master weights go to the file too (fp32 training has none apart).
    offload_params: bool = False
    # Context parallelism: each sample's sequence split over cp ranks (load-balanced head-tail), attention by
    # "ring" (K/V blocks passed around the cp ranks), "allgather" (K/V gathered whole) or "ulysses"
    # (all-to-all from sequence- to head-sharded; needs the heads divisible by cp). docs/parallelism.md.
    cp: int = 1
    # Expert parallelism (a Mixture of Experts, model.n_experts > 0): each group of ep data-parallel ranks
    # splits the experts' computation, tokens travelling to their experts by all-to-all; carved from
    # dp_shard (ep must divide it, and model.n_experts). 0: automatic, at each size the largest ep dividing both
    # model.n_experts and dp_shard, so that resizing an elastic run may change it. docs/parallelism.md.
    ep: int = 1
    cp_style: Literal["ring", "allgather", "ulysses"] = "ring"
    # Megatron-LM sequence parallelism between the tensor-parallel regions (needs tp > 1).
    sequence_parallel: bool = False
    # Cross-entropy on vocabulary-sharded logits under tensor parallelism (no logits all-gather).
    loss_parallel: bool = True
    # ZeRO-2: gradients are reduce-scattered in buckets of this many MiB during backward.
    bucket_mb: float = 25.0
    # Gradient accumulation: reduce (FSDP reduce-scatter) after every micro-batch instead of only the
    # last (less memory for ZeRO-3, more communication).
    reduce_every_microbatch: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # torch.compile each repeated block (trainer.parallel.compile): faster steps after a first slow one.
    compile: bool = False
    # ZeRO++ (docs/parallelism.md): int8 weights in the parameter all-gather (qwZ), int8 gradients in an
    # all-to-all reduce-scatter (qgZ), one scale per quantization_block elements; a secondary shard of
    # the weights within groups of hpz_partition_size ranks for ZeRO-3's backward all-gather (hpZ; 0 = off).
    quantized_weights: bool = False
    quantized_gradients: bool = False
    quantization_block: int = 256
    hpz_partition_size: int = 0

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp", "ep", "pp_stages_per_rank", "ac_every_k"):
            if getattr(self, name) < 1 and not (name == "ep" and self.ep == 0):
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1"
                                  + (", or 0 to choose it at each size" if name == "ep" else ""))
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard} must be >= 1, or -1 to fill the world size")
        for name, least in DEGREES.items():
            check_range("parallel", name, getattr(self, name), least, MAX_RANKS, "ranks")
        layers = SIZE_BOUNDS["n_layers"]
        for name, least, most in (("pp_stages_per_rank", 1, layers), ("ac_every_k", 1, layers),
                                  ("pp_microbatches", 0, MAX_SAMPLES)):
            check_range("parallel", name, getattr(self, name), least, most)
        if self.cp_style not in CP_STYLES:
            raise ConfigError(f"parallel.cp_style={self.cp_style!r} is not one of {', '.join(map(repr, CP_STYLES))}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.pp_microbatches < 0:
            raise ConfigError(f"parallel.pp_microbatches={self.pp_microbatches} must be >= 0 (0 = automatic)")
        if self.pp_stages_per_rank > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ConfigError(
                f"parallel.pp_stages_per_rank={self.pp_stages_per_rank} needs "
                f'parallel.pp_schedule="interleaved_1f1b" (got {self.pp_schedule!r})'
            )
        if self.pp_schedule == "interleaved_1f1b" and self.pp_stages_per_rank < 2:
            raise ConfigError(
                'parallel.pp_schedule="interleaved_1f1b" needs parallel.pp_stages_per_rank >= 2; '
                'use 2, or pp_schedule="1f1b"'
            )
        if self.pp_schedule == "interleaved_1f1b" and self.pp < 2:
            raise ConfigError(
                f'parallel.pp_schedule="interleaved_1f1b" needs parallel.pp > 1 (got pp={self.pp}): it interleaves '
                'stages across pipeline ranks; set parallel.pp=2 or more, or leave pp_schedule and '
                "pp_stages_per_rank at their defaults"
            )
        check_finite(self, "parallel")
        if self.bucket_mb <= 0:
            raise ConfigError(f"parallel.bucket_mb={self.bucket_mb} must be > 0 (MiB per ZeRO-2 reduce bucket)")
        check_range("parallel", "bucket_mb", self.bucket_mb, 0, MAX_MIB, "MiB per ZeRO-2 reduce bucket")
        check_range("parallel", "offload_buffer_mb", self.offload_buffer_mb, MIN_BUFFER_MB, MAX_MIB,
                    "MiB of host buffers offload=\"nvme\" streams through; tens of MiB are usual")
        if self.offload_dir:
            check_offload_dir(self.offload_dir)
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError(f"parallel.sequence_parallel=true needs parallel.tp > 1 (got tp={self.tp}); "
                              "set parallel.tp=2 or more, or sequence_parallel=false")
        if self.offload == "nvme" or self.offload_params:
            check_nvme_keys(self)
        if self.offload == "cpu" and self.zero_stage != 3:
            raise ConfigError(
                f'parallel.offload="cpu" needs parallel.zero_stage=3 (got {self.zero_stage}); '
                "offload moves the FSDP-sharded parameters and optimizer state to host memory"
            )

        self.check_zeropp()

    def check_zeropp(self) -> None:
        """ZeRO++'s keys: each needs a ZeRO stage that has the collective it changes."""
        if not 4 <= self.quantization_block <= MAX_QUANT_BLOCK or self.quantization_block % 4:
            raise ConfigError(f"parallel.quantization_block={self.quantization_block} must be a multiple of 4 "
                              f"in [4, {MAX_QUANT_BLOCK:_}] (elements per int8 scale block); use 256")
        for key in ("quantized_weights", "quantized_gradients"):
            if getattr(self, key) and self.zero_stage == 0:
                raise ConfigError(f"parallel.{key}=true quantizes a ZeRO collective, and parallel.zero_stage=0 "
                                  f"has none (it all-reduces whole gradients); set parallel.zero_stage to 1, 2 or "
                                  f"3, or {key}=false")
        if self.hpz_partition_size < 0 or self.hpz_partition_size == 1:
            raise ConfigError(f"parallel.hpz_partition_size={self.hpz_partition_size} must be 0 (off) or the ranks "
                              "of one group (>= 2, dividing the data-parallel shard size)")
        if self.hpz_partition_size and self.zero_stage != 3:
            raise ConfigError(f"parallel.hpz_partition_size={self.hpz_partition_size} keeps a secondary shard of "
                              f"ZeRO-3's parameters, and parallel.zero_stage={self.zero_stage} does not shard them; "
                              "set parallel.zero_stage=3, or hpz_partition_size=0")

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one model replica's fixed part: tp x pp."""
        return self.tp * self.pp


def check_nvme_keys(p: ParallelConfig) -> None:
    """offload="nvme"'s own keys (the directory's room is checked before the first process group:
    trainer.zero.offload.offload_preflight)."""
    if p.offload != "nvme":
        raise ConfigError(f'parallel.offload_params=true needs parallel.offload="nvme" (got {p.offload!r})')
    if not p.offload_dir:
        raise ConfigError('parallel.offload="nvme" needs parallel.offload_dir, a local directory for the '
                          "optimizer state's files (e.g. offload_dir=\"/local_nvme/etrain\")")
    if "://" in p.offload_dir:
        raise ConfigError(f"parallel.offload_dir={p.offload_dir!r} must be a local path, not a URL")


def check_offload_dir(path: str) -> None:
    """parallel.offload_dir, whenever it is set: a path that names a directory, not one that climbs out of where
    it is given (its scratch files are created and removed under it)."""
    if "\x00" in path:
        raise ConfigError("parallel.offload_dir holds a NUL byte (\\x00); give a local directory")
    if not path.strip():
        raise ConfigError(f"parallel.offload_dir={path!r} is blank; give a local directory such as "
                          '"/local_nvme/etrain", or leave it unset')
    if ".." in path.replace("\\", "/").split("/"):
        raise ConfigError(f"parallel.offload_dir={path!r} climbs with '..'; give the directory itself, e.g. an "
                          'absolute path such as "/local_nvme/etrain"')


# --- context parallelism's rules ------------------------------------------------------------------


def cp_splits(seq_len: int, cp: int) -> bool:
    """Whether every sample's ``seq_len`` positions split into 2 x cp equal chunks (each cp rank takes one from
    the head and one from the tail: :func:`trainer.parallel.context.zigzag_positions`)."""
    return seq_len % (2 * cp) == 0


def ulysses_splits(n_heads: int, tp: int, cp: int) -> bool:
    """Whether ``cp_style="ulysses"`` can split a tensor-parallel rank's attention heads (n_heads / tp) across
    the cp ranks."""
    return (n_heads // tp) % cp == 0


def cp_refuses_dropout(m: ModelConfig) -> bool:
    """The built-in decoder's attention dropout is not split across the cp ranks: cp > 1 needs model.dropout=0."""
    return m.source == "builtin" and m.dropout > 0


def check_cp(p: ParallelConfig, m: ModelConfig, seq_len: int, tp: int) -> None:
    """Context parallelism's needs of a run with ``p.cp`` > 1 at tensor-parallel degree ``tp`` (the model's own,
    whether its attention can be routed, are asked of its spec: :func:`trainer.models.model_preflight`)."""
    cp, seq = p.cp, seq_len
    if not cp_splits(seq, cp):
        near = [v for v in (seq - seq % (2 * cp), seq - seq % (2 * cp) + 2 * cp) if v >= 2 * cp]
        raise ConfigError(
            f"parallel.cp={cp} splits every sample's data.seq_len={seq} positions into 2 x cp = {2 * cp} equal "
            f"chunks (each rank takes one from the head and one from the tail); use data.seq_len="
            f"{or_join(near)}, or another parallel.cp")
    if p.cp_style == "ulysses" and m.source == "builtin" and not ulysses_splits(m.n_heads, tp, cp):
        good = [d for d in divisors(m.n_heads // tp) if d > 1]
        shown = f" / parallel.tp={tp}" if tp > 1 else ""
        raise ConfigError(
            f'parallel.cp_style="ulysses" splits the attention heads across the cp ranks: model.n_heads='
            f"{m.n_heads}{shown} is not divisible by parallel.cp={cp}; use parallel.cp={or_join(good or [1])}, "
            'or parallel.cp_style="ring"')
    if cp_refuses_dropout(m):
        raise ConfigError(f"parallel.cp={cp} needs model.dropout=0 (got {m.dropout}): attention dropout is not "
                          "split across the cp ranks; set model.dropout=0, or parallel.cp=1")
    if p.compile:  # the ring's sends and receives break a block's single graph
        raise ConfigError(f"parallel.cp={cp} does not combine with parallel.compile=true yet; set "
                          "parallel.compile=false, or parallel.cp=1")


# --- expert parallelism's rules -------------------------------------------------------------------


def ep_degrees(n_experts: int, dp_shard: int) -> list[int]:
    """The ep a size whose dp_shard is ``dp_shard`` can take: the divisors of dp_shard that divide n_experts (ep is
    carved from dp_shard and splits the experts), [1] without experts."""
    return [e for e in divisors(dp_shard) if n_experts % e == 0] if n_experts > 0 else [1]


def expert_degree(ep: int, n_experts: int, dp_shard: int) -> int:
    """``parallel.ep`` as configured, or with ``parallel.ep = 0`` (automatic) the largest of :func:`ep_degrees`."""
    return ep or max(ep_degrees(n_experts, dp_shard))


def ep_carves(ep: int, dp_shard: int) -> bool:
    """Whether ep divides dp_shard (ep is carved from it and adds no ranks)."""
    return dp_shard % ep == 0


def check_ep_carved(ep: int, dp_shard: int) -> None:
    if not ep_carves(ep, dp_shard):
        raise ConfigError(f"parallel.ep={ep} is carved from dp_shard={dp_shard} and must divide it; "
                          f"use a world size whose dp_shard is a multiple of {ep}, parallel.ep in "
                          f"{fmt_list(divisors(dp_shard))}, or parallel.ep=0 (the largest that fits "
                          "each size)")


def check_ep(p: ParallelConfig, m: ModelConfig) -> None:
    """``parallel.ep`` against the model: experts to split (a transformers model's are its spec's to check), and
    an ep that divides them."""
    if p.ep != 1 and not m.n_experts and m.source != "hf":  # a transformers MoE: its spec's preflight
        raise ConfigError(f"parallel.ep={p.ep} splits the experts of a Mixture of Experts, and the model has none; "
                          'set parallel.ep=1, or model.n_experts (e.g. model.preset="moe-tiny")')
    if p.ep > 1 and m.n_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide model.n_experts={m.n_experts}; use one of "
                          f"{fmt_list(divisors(m.n_experts))}")
