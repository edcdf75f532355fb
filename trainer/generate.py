"""``etrain generate``: sample text from a checkpoint or an export, with the run's tokenizer.

    etrain generate s3://bucket/runs/tiny --prompt "Once upon a time" --max-new-tokens 64
    etrain generate ./tiny-hf --prompt "Once" --temperature 0          # greedy: the same text every time
    etrain generate file:///ckpt/runs/tiny/checkpoints/step_000001000 --prompt "x" --top-k 20 --seed 7

The source is an etrain checkpoint (a run URL: its newest committed step; or one step), read whole
into memory with the model the manifest's run config names (the built-in decoder, a
``transformers`` model or a python factory's), or a directory written by ``etrain ckpt export
--format hf`` (or any ``transformers`` causal-LM directory), loaded with ``from_pretrained``.
The tokenizer is the run's ``data.tokenizer`` (bytes, or tokenizer files), or the export's own
files. Sampling is a plain loop without a KV cache: each new token re-runs the model on the
context (the last ``max_seq_len`` tokens); ``--temperature 0`` takes the argmax (deterministic),
otherwise softmax(logits / T) over the ``--top-k`` best (0: all), drawn from a generator seeded
by ``--seed``. Generation stops after ``--max-new-tokens`` or at the tokenizer's end-of-text id.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable

import torch

from checkpointing.cli_args import ArgumentParser
from checkpointing.errors import CheckpointError, ConfigError, EtrainError, StorageError
from checkpointing.export.weights import ModelSource

from .export.convert import model_config, refuse_incomplete_export, run_config, tokenizer_files
from .models.hf.hf_dir import open_weights, read_config, refuse_nonfinite, require_hf
from .models import spec_for
from .models.brought import hf_max_positions, plain_forward
from .models.hf.spec import hf_forward
from .data.tokenize import ByteTokenizer, load_tokenizer


@dataclasses.dataclass
class Loaded:
    """A model ready to sample from: token ids [1, seq] -> logits [1, seq, vocab]."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    tokenizer: object
    max_len: int
    device: torch.device


def load(source: str, device: str | torch.device = "cpu", *, trust_code: bool = False) -> Loaded:
    """The model and tokenizer of a checkpoint URL or an export directory (module docstring). A checkpoint
    of a model made by a Python factory is loaded only with ``trust_code``: its manifest names the module to
    import, and a manifest is data."""
    device = torch.device(device)
    path = os.path.expanduser(source)
    refuse_incomplete_export(path, source)
    if os.path.isdir(path) and os.path.lexists(os.path.join(path, "config.json")):
        return _load_export(path, device)
    src = ModelSource.open(source)
    cfg = run_config(src)
    mcfg = model_config(cfg)
    spec = spec_for(mcfg)
    if spec.runs_code and not trust_code:
        raise ConfigError(f"{src.url} holds a model made by a Python factory (model.factory = {mcfg.factory!r}), "
                          "which generating from it would import and run, named by the checkpoint's manifest: "
                          "pass --trust-code if you trust whoever wrote the checkpoint, or export it "
                          "(etrain ckpt export --format safetensors) and load it yourself")
    state = {fqn: src.read(fqn) for fqn in src.specs()}
    for fqn, t in state.items():
        refuse_nonfinite(fqn, t, src.url)
    model, max_len = spec.inference_model(state)
    tokenizer = load_tokenizer(str(cfg.get("data", {}).get("tokenizer", "bytes")))
    return Loaded(_forward(model.to(device).eval()), tokenizer, max_len, device)


def _load_export(path: str, device: torch.device) -> Loaded:
    """A transformers directory, validated (:mod:`trainer.models.hf.hf_dir`) before transformers reads it."""
    require_hf(f"etrain generate of the transformers directory {path}")
    config = read_config(path, path)
    weights = open_weights(path, path)  # headers, index, a .bin only through torch.load(weights_only=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                           use_safetensors=weights.safetensors, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a directory it cannot load
        raise ConfigError(f"{path}: transformers cannot load it ({type(e).__name__}: {str(e)[:200]})") from None
    # transformers initializes what the weights lack at random: a model that would sample noise
    for key, problem in (("missing_keys", "lack"), ("unexpected_keys", "hold tensors the model has no place for:"),
                         ("mismatched_keys", "differ in shape from the model in")):
        if info.get(key):
            raise ConfigError(f"{path}: the weights {problem} {sorted(map(str, info[key]))[:4]}; config.json and "
                              "the weights are of different models")
    state = model.state_dict()
    for name in weights.entries:  # what the model holds is what the files hold, every value finite
        if name in state and not torch.equal(state[name], weights.read(name).to(state[name].dtype)):
            raise ConfigError(f"{path}: the model's {name!r} is not the tensor of that name in the weights "
                              "(config.json ties or reshapes it); config.json and the weights are of different models")
    if tokenizer_files(path):
        tokenizer = load_tokenizer(path)
    elif config.get("etrain_tokenizer", "bytes") == "bytes":
        tokenizer = ByteTokenizer()
    else:
        raise ConfigError(f"{path} holds no tokenizer files; copy the run's tokenizer into it")
    return Loaded(_forward(model.to(device).eval()), tokenizer, hf_max_positions(model.config) or 1 << 30, device)


def _forward(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """Logits for token ids, as training computes them (a transformers model or any other)."""
    hf = hasattr(model, "config") and hasattr(model, "generation_config")
    return functools.partial(hf_forward if hf else plain_forward, model)


def decode(tokenizer, ids: list[int]) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")
    return tokenizer.tok.decode(ids)


@torch.no_grad()
def generate(m: Loaded, prompt: str, *, max_new_tokens: int = 64, temperature: float = 1.0, top_k: int = 0,
             seed: int = 0) -> str:
    """The prompt's continuation (the new text only)."""
    check_sampling(temperature, top_k, max_new_tokens)
    ids = [int(i) for i in m.tokenizer.encode_batch([prompt])[0]]
    if not ids:
        if m.tokenizer.eos_id is None:
            raise ConfigError("--prompt is empty and the tokenizer has no end-of-text token to start from")
        ids = [m.tokenizer.eos_id]
    start = len(ids)
    g = torch.Generator(device=m.device).manual_seed(seed)
    for _ in range(max_new_tokens):
        ctx = torch.tensor([ids[-m.max_len:]], dtype=torch.long, device=m.device)
        logits = m.forward(ctx)[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        if nxt == m.tokenizer.eos_id:
            break
        ids.append(nxt)
    return decode(m.tokenizer, ids[start:])


def check_sampling(temperature: float, top_k: int, max_new_tokens: int) -> None:
    """ConfigError naming the flag whose value cannot sample."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature {temperature} must be a finite number >= 0 (0: greedy)")
    for flag, value in (("--top-k", top_k), ("--max-new-tokens", max_new_tokens)):
        if value < 0:
            raise ConfigError(f"{flag} {value} must be >= 0")


def pick_device(spec: str) -> torch.device:
    """``--device``: auto (cuda when there is one), cpu, cuda or cuda:N; ConfigError otherwise."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {spec!r} is not a device here; use cpu, cuda or cuda:N")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ConfigError(f"--device {spec}: this machine has {have} CUDA device{'s' if have != 1 else ''}; "
                          "use --device cpu" + (f" or cuda:0..{have - 1}" if have else ""))
    return device


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="etrain generate", description="Sample text from a checkpoint or an export.")
    ap.add_argument("source", metavar="URL", help="a checkpoint (<root>/<run_id>[/checkpoints/step_N]) or an "
                                                  "export directory (etrain ckpt export --format hf)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    ap.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0: greedy (deterministic)")
    ap.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest (0: all)")
    ap.add_argument("--seed", type=int, default=0, metavar="S")
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when there is one)")
    ap.add_argument("--trust-code", action="store_true", help="a checkpoint of a Python factory's model: import "
                    "and run the factory its manifest names (only for checkpoints whose writer you trust)")
    args = ap.parse_args(argv)
    try:
        check_sampling(args.temperature, args.top_k, args.max_new_tokens)
        loaded = load(args.source, pick_device(args.device), trust_code=args.trust_code)
        text = generate(loaded, args.prompt, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    except (ConfigError, CheckpointError) as e:
        print(f"etrain generate: {e}", file=sys.stderr)
        return 1 if isinstance(e, StorageError) else 2
    except EtrainError as e:
        print(f"etrain generate: {e}", file=sys.stderr)
        return 1
    print(args.prompt + text, flush=True)
    return 0
