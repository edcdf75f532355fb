"""``parallel.mixed_precision = "float8"``: the blocks' linear layers compute in float8 through torchao, the
rest in bf16 (torchtitan's float8 recipe: dynamic tensorwise scaling).

    check_float8(pcfg, device)           # ConfigError (exit 2) naming the field and the reason, else None
    apply_float8(spec, module, pcfg)     # nn.Linear -> torchao Float8Linear in place, before TP (FQNs unchanged)

Accepted only where it can work: a CUDA device of compute capability 8.9 or more (Ada, Hopper and
later have float8 tensor cores), ``torchao`` importable, and a float8 linear that runs forward and
backward there with the installed torch (torchao's kernels are built against one torch release; a
pairing that does not work is refused with the error it raised). torchao is optional: nothing else
imports it. The output head stays bf16 (its logits decide the loss), as do linears whose sizes are not
multiples of 16 (float8 matmuls need them). Tensor parallelism is refused with float8 for now: it needs
float8-aware parallel styles.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from checkpointing.errors import ConfigError

from ..config import ParallelConfig

FIELD = 'parallel.mixed_precision="float8"'


def float8_refusal(device_type: str, capability: tuple[int, int] | None, probe_error: str | None,
                   tp: int) -> str | None:
    """Why float8 cannot train here (pure: the facts are arguments), or None."""
    if device_type != "cuda":
        return f"it needs a CUDA GPU of compute capability >= 8.9, and this process runs on {device_type}"
    if capability is not None and capability < (8, 9):
        return (f"this GPU has compute capability {capability[0]}.{capability[1]}; float8 matmuls need 8.9 or more "
                "(Ada, Hopper, Blackwell)")
    if tp > 1:
        return f"float8 with tensor parallelism (parallel.tp={tp}) is not supported yet; use tp=1"
    return probe_error


@functools.cache
def probe_torchao(device_index: int) -> str | None:
    """None when a torchao float8 linear runs forward and backward on the device, else what went wrong."""
    try:
        import torchao
        from torchao.float8 import convert_to_float8_training
    except Exception as e:  # noqa: BLE001 - an incompatible build fails in many ways on import
        return (f"torchao is not importable ({type(e).__name__}: {str(e)[:160]}); pip install torchao "
                "(docs/dependencies.md)")
    try:
        dev = torch.device("cuda", device_index)
        m = nn.Sequential(nn.Linear(32, 32, bias=False)).to(dev, torch.bfloat16)
        convert_to_float8_training(m)
        m(torch.randn(16, 32, device=dev, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
        torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 - whatever the pairing raises is the reason
        return (f"torchao {getattr(torchao, '__version__', '?')} does not work with torch {torch.__version__} here "
                f"({type(e).__name__}: {str(e)[:160]}); install the torchao release built for this torch")
    return None


def check_float8(pcfg: ParallelConfig, device: torch.device) -> None:
    """ConfigError naming the field when ``float8`` is asked for where it cannot work."""
    if pcfg.mixed_precision != "float8":
        return
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    why = float8_refusal(device.type, cap, None, pcfg.tp)
    if why is None and device.type == "cuda":
        why = probe_torchao(device.index or 0)
    if why:
        raise ConfigError(f"{FIELD} cannot train here: {why}; or set parallel.mixed_precision=\"bf16\"")


def apply_float8(spec, module: nn.Module, pcfg: ParallelConfig, uses_fsdp: bool) -> None:
    """Swap the linear layers of ``module`` (but the output head) for torchao's float8 ones, in place."""
    if pcfg.mixed_precision != "float8":
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    vocab = spec.vocab_size

    def wanted(mod: nn.Module, fqn: str) -> bool:
        return (isinstance(mod, nn.Linear) and mod.out_features != vocab
                and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)

    # FSDP2 all-gathers the weights in bf16: torchao's float8 all-gather makes every weight a tensor subclass,
    # which the checkpoint and memory-tier paths have not been shown to carry (``uses_fsdp`` is for that switch).
    cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=False)
    convert_to_float8_training(module, config=cfg, module_filter_fn=wanted)
