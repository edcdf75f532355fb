"""Document masking (``[model] document_mask = true``, trainer.models.documents): inside a packed sample each
document attends only to itself, so its logits, its share of the loss and the gradients equal those of the
document trained alone, for the built-in decoder and a transformers Llama (sdpa and eager attention).

Everything runs in one process at world 1, through the trainer's own ``build_model_parts`` (the data's
end-of-document id handed to the model's spec), ``ModelParts.forward`` and ``ModelParts.loss``, on the CPU
with tiny models. With the mask off the same comparison fails, and what the mask cannot go with is refused
before any process group, naming the key.
"""

from __future__ import annotations

import json

import pytest
import torch

from checkpointing.errors import ConfigError
from trainer.config.load import load_config
from trainer.models import model_preflight, spec_for
from trainer.models.documents import document_causal_mask, document_eos_id
from trainer.parallel.dims import ParallelDims
from trainer.parallel.parallelize import build_model_parts

EOS = 0  # the bytes tokenizer's end-of-document id (data.tokenizer="bytes", the default)
SEQ = 32
# Two packed samples of SEQ tokens: (start, end) of each document; each but a sample's last ends with EOS.
DOCS = [[(0, 7), (7, 19), (19, 32)], [(0, 20), (20, 32)]]
BUILTIN = ["model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=96"]


def packed_stream() -> torch.Tensor:
    """(2, SEQ + 1) token ids: DOCS's documents with EOS after each, and one more token for the targets."""
    g = torch.Generator().manual_seed(7)
    stream = torch.randint(1, 256, (len(DOCS), SEQ + 1), generator=g)
    for row, docs in enumerate(DOCS):
        for _, end in docs[:-1]:
            stream[row, end - 1] = EOS
    return stream


def hf_dir(tmp_path, attn: str) -> str:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "attn_implementation": attn}))
    return str(tmp_path)


def parts_of(overrides: list[str], mask: bool, world: int = 1, rank: int = 0):
    cfg = load_config(None, [f"data.seq_len={SEQ}", f"model.document_mask={str(mask).lower()}", *overrides])
    model_preflight(cfg)
    dims = ParallelDims.from_config(cfg, world)
    return build_model_parts(cfg, dims, dims.build_mesh("cpu"), rank, torch.device("cpu"))


def grads(parts) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in parts.named_parameters() if p.grad is not None}
    for p in parts.modules[0].parameters():
        p.grad = None
    return out


def packed_and_alone(parts):
    """(logits, loss, gradients) of the packed batch, and the same three made of every document run alone:
    its logits in its place, the loss as the batch's mean over its tokens, the gradients of that loss."""
    stream = packed_stream()
    inputs, targets = stream[:, :-1], stream[:, 1:]
    logits = parts.forward(inputs)
    loss = parts.loss(logits, targets)
    loss.backward()
    packed = (logits.detach(), loss.detach(), grads(parts))
    alone_logits = torch.empty_like(logits)
    alone_loss = torch.zeros(())
    for row, docs in enumerate(DOCS):
        for start, end in docs:
            out = parts.forward(inputs[row : row + 1, start:end])
            share = parts.loss(out, targets[row : row + 1, start:end]) * (end - start) / targets.numel()
            share.backward()  # the gradients add up over the documents
            alone_logits[row, start:end] = out[0].detach()
            alone_loss += share.detach()
    return packed, (alone_logits, alone_loss, grads(parts))


MODELS = {"builtin": lambda tmp: BUILTIN,
          "hf_sdpa": lambda tmp: ['model.source="hf"', f'model.hf_config="{hf_dir(tmp, "sdpa")}"'],
          "hf_eager": lambda tmp: ['model.source="hf"', f'model.hf_config="{hf_dir(tmp, "eager")}"']}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_document_of_a_packed_sample_trains_as_it_would_alone(model, tmp_path):
    (logits, loss, grad), (logits1, loss1, grad1) = packed_and_alone(parts_of(MODELS[model](tmp_path), True))
    torch.testing.assert_close(logits, logits1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, loss1, rtol=1e-6, atol=1e-6)
    assert grad.keys() == grad1.keys() and len(grad) > 4
    for name in grad:
        torch.testing.assert_close(grad[name], grad1[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("model", ["builtin", "hf_sdpa"])
def test_without_the_mask_a_document_sees_the_ones_before_it(model, tmp_path):
    (logits, loss, _), (logits1, loss1, _) = packed_and_alone(parts_of(MODELS[model](tmp_path), False))
    first = DOCS[0][0][1]
    torch.testing.assert_close(logits[0, :first], logits1[0, :first], rtol=1e-5, atol=1e-5)  # nothing before it
    assert (logits[0, first:] - logits1[0, first:]).abs().max() > 1e-3
    assert abs(loss.item() - loss1.item()) > 1e-6


def tp_job(payload: dict) -> dict:
    """One rank of a tensor- and sequence-parallel run: the whole logits, loss and gradients of the packed batch."""
    from torch.distributed.tensor import DTensor

    from trainer.world import World, forget_meshes, init_distributed, shutdown_distributed

    world = World.from_env()
    init_distributed(world, torch.device("cpu"))
    try:
        forget_meshes()
        parts = parts_of(payload["overrides"], payload.get("mask", True), world.size, world.rank)
        stream = packed_stream()
        logits = parts.forward(stream[:, :-1])
        loss = parts.loss(logits, stream[:, 1:])
        loss.backward()
        whole = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach()
                 for n, p in parts.named_parameters()}
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        return {"logits": logits.detach(), "loss": loss.detach(), "grads": whole}
    finally:
        shutdown_distributed()


def test_tensor_and_sequence_parallelism_keep_the_mask():
    """The decoder's attention takes the mask through its tensor-parallel plan (.decoder.tp): at tp 2 with
    sequence parallelism the packed batch trains as at world 1."""
    from tests.harness import run_ranks

    tp = [*BUILTIN, "parallel.tp=2", "parallel.sequence_parallel=true", "train.global_batch=2",
          "train.micro_batch=2"]
    got = run_ranks("tests.trainer.test_document_mask:tp_job", 2, {"overrides": tp}, timeout=300)[0]
    (logits, loss, grad), _ = packed_and_alone(parts_of([*BUILTIN, "train.global_batch=2", "train.micro_batch=2"],
                                                        True))
    torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["loss"], loss, rtol=1e-6, atol=1e-6)
    for name in grad:
        torch.testing.assert_close(got["grads"][name], grad[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_mask_is_causal_within_each_document():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8]])
    allowed = document_causal_mask(tokens, EOS)[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0],
                       [1, 1, 1, 0, 0, 0],  # the end-of-document token is its own document's last
                       [0, 0, 0, 1, 0, 0],
                       [0, 0, 0, 1, 1, 0],
                       [0, 0, 0, 0, 0, 1]]
    assert document_causal_mask(torch.tensor([[1, 2, 3]]), EOS)[0, 0].equal(torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("overrides, names", [
    (["parallel.pp=2"], ["model.document_mask", "parallel.pp=2", "parallel.pp=1"]),
    (["parallel.cp=2"], ["model.document_mask", "parallel.cp=2", "parallel.cp=1"]),
    (['data.source="python"', 'data.factory="tests.data_jobs:token_documents"'], ["model.document_mask",
                                                                            'data.source="python"']),
])
def test_what_the_mask_cannot_reach_is_refused_before_any_process_group(overrides, names):
    cfg = load_config(None, [f"data.seq_len={SEQ}", "model.document_mask=true", *BUILTIN, *overrides])
    with pytest.raises(ConfigError) as e:
        model_preflight(cfg)
    assert all(n in str(e.value) for n in names), str(e.value)
    assert not {"pp", "cp"} & set(spec_for(cfg.model).allows())  # etrain plan offers neither


def test_a_factory_model_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"model\.document_mask=true .* model\.source=\"python\""):
        load_config(None, ['model.source="python"', 'model.factory="tests.custom_model:build"',
                           "model.document_mask=true"])


def test_a_transformers_model_whose_mask_would_drop_its_window_is_refused(tmp_path):
    from transformers import MistralConfig

    config = MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(config.to_json_string())
    cfg = load_config(None, [f"data.seq_len={SEQ}", "model.document_mask=true", 'model.source="hf"',
                             f'model.hf_config="{tmp_path}"'])
    with pytest.raises(ConfigError, match=r"model\.document_mask=true: .*sliding window of 8"):
        model_preflight(cfg)


def test_a_transformers_mixture_of_experts_is_refused(tmp_path):
    from tests.trainer.test_hf_moe import MIXTRAL

    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    cfg = load_config(None, [f"data.seq_len={SEQ}", "model.document_mask=true", 'model.source="hf"',
                             f'model.hf_config="{tmp_path}"', "parallel.ep=1"])
    with pytest.raises(ConfigError, match=r"model\.document_mask=true: a mixtral model's balancing loss"):
        model_preflight(cfg)


def test_data_without_an_end_of_document_token_is_refused():
    class NoEos:
        eos_id = None

    cfg = load_config(None, [f"data.seq_len={SEQ}", "model.document_mask=true"])
    with pytest.raises(ConfigError, match=r"model\.document_mask=true: data\.tokenizer='bytes' names no"):
        document_eos_id(cfg, lambda name: NoEos(), lambda d: "text")
    with pytest.raises(ConfigError, match=r"token files and data\.tokenizer=\"bytes\""):
        document_eos_id(cfg, lambda name: NoEos(), lambda d: "tokens")
    assert document_eos_id(load_config(None, []), lambda name: NoEos(), lambda d: "text") is None
