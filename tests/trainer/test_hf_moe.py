"""transformers' Mixture-of-Experts models from a local config (``model.source = "hf"``).

The reference is a plain single-process loop written here: transformers' own Mixtral (from_config under the
same seed), its own balancing loss (``output_router_logits=True``: ``out.aux_loss`` times the config's
``router_aux_loss_coef``, added to the language-model loss of each micro-batch), torch's AdamW and clipping,
the run's batches in the run's micro-batches; no etrain training code.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.harness import run_ranks
from tests.moe_jobs import assert_matches_world1
from tests.checkpointing.test_input_safety import PY, ROOT
from tests.trainer.test_models import STEPS, TRAIN, hf, plain_setup

MIXTRAL = {"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.05,
           "tie_word_embeddings": False}


def write(tmp, doc: dict) -> str:
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(doc, f)
    return str(tmp)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return write(tmp_path_factory.mktemp("mixtral"), MIXTRAL)


def reference_losses(hf_dir: str) -> tuple[list[float], list[float]]:
    """(losses, aux losses) of the plain loop: 8 samples a step in micro-batches of 2, as the run takes them."""
    model, opt, batcher = plain_setup(hf_dir)
    coef = model.config.router_aux_loss_coef
    losses, auxes = [], []
    for step in range(STEPS):
        x, y = batcher.tokens(batcher.local_positions(step * 8))
        total = aux_total = 0.0
        for i in range(0, 8, 2):
            out = model(input_ids=x[i:i + 2], output_router_logits=True)
            aux = coef * out.aux_loss
            loss = (torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), y[i:i + 2].flatten())
                    + aux) / 4
            loss.backward()
            total += loss.item()
            aux_total += aux.item() / 4
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        auxes.append(aux_total)
    return losses, auxes


def close(name: str, got: list[float], ref: list[float], tol: float = 1e-4) -> None:
    assert len(got) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= tol * abs(b), f"{name} step {step + 1}: {a} vs {b}"


@pytest.fixture(scope="module")
def world1(mixtral):
    return run_ranks("tests.moe_jobs:train_moe", 1, {"base": TRAIN, "steps": STEPS, "grads": True, "layouts": [
        ("zero0", hf(mixtral) + ["parallel.zero_stage=0"])]}, timeout=300)[0]


@pytest.fixture(scope="module")
def runs(mixtral, world1):
    one = world1
    two = run_ranks("tests.moe_jobs:train_moe", 2, {"base": TRAIN, "steps": STEPS, "grads": True, "layouts": [
        ("zero3", hf(mixtral) + ["parallel.zero_stage=3"]),
        ("ep2_zero3", hf(mixtral) + ["parallel.zero_stage=3", "parallel.ep=2"]),
        ("ep2_zero1", hf(mixtral) + ["parallel.zero_stage=1", "parallel.ep=2"])]}, timeout=300)
    return one, two


def test_mixtral_matches_a_plain_transformers_loop_with_its_router_loss(mixtral, runs):
    """World 1 (ZeRO 0) equals the plain loop with Mixtral's own balancing loss; ZeRO-3 at world 2 (dp 2)
    equals world 1. Without the balancing loss the run's losses would differ by coef x aux (~0.1 here)."""
    one, two = runs
    ref, ref_aux = reference_losses(mixtral)
    assert ref[-1] < ref[0]
    assert min(ref_aux) > 0.05  # coef 0.05 x a loss near top_k: a term the match would notice
    close("world 1", one["zero0"]["losses"], ref)
    close("world 1 aux", one["zero0"]["aux"], ref_aux, 1e-3)
    close("zero3 world 2", two[0]["zero3"]["losses"], one["zero0"]["losses"])
    assert two[0]["zero3"]["losses"] == two[1]["zero3"]["losses"]
    close("zero3 world 2 aux", two[0]["zero3"]["aux"], one["zero0"]["aux"], 1e-3)
    # The step log's loads: each layer's routed slots (8 samples x 32 tokens x top 2), over the dp ranks.
    loads = one["zero0"]["tokens_per_expert"][0]
    assert set(loads) == {"0", "1"} and all(sum(v) == 8 * 32 * 2 for v in loads.values())
    assert two[0]["zero3"]["tokens_per_expert"][0] == loads
    assert one["zero0"]["imbalance"][0] == max(max(v) / (sum(v) / 4) for v in loads.values()) > 1


@pytest.mark.parametrize("layout", ["ep2_zero3", "ep2_zero1"])
def test_mixtral_experts_split_by_ep_match_world1(runs, layout):
    """ep 2 at world 2: each rank holds 2 of the 4 experts of every layer (ep-sharded DTensors), the routed
    slots travel by all-to-all on the ep axis, and the losses and the first step's expert gradients equal
    world 1's (the gradient divide: a naive factor gives 2x)."""
    one, two = runs
    for rank in (0, 1):
        got = two[rank][layout]
        close(f"{layout} rank {rank}", got["losses"], one["zero0"]["losses"])
        assert got["experts"] == {"placement": "Shard(dim=0)", "first": 2 * rank, "n": 2}
        assert got["comm"]["all_to_all/ep"]["calls"] > 0
        assert got["tokens_per_expert"] == one["zero0"]["tokens_per_expert"]
    grads, ref = two[0][layout]["grads"], one["zero0"]["grads"]
    assert len(grads) == 4 and set(grads) <= set(ref)  # gate_up_proj and down_proj of both layers
    for name, g in grads.items():
        assert torch.allclose(g, ref[name], atol=1e-5, rtol=0), name


@pytest.mark.slow
def test_mixtral_at_world4_ep2_under_hsdp_and_ep4_under_zero3_match_world1(mixtral, world1):
    """World 4: ep 2 under HSDP (dp_replicate 2 x dp_shard 2, ep carved from dp_shard) and ep 4 under ZeRO-3
    (one expert per rank): the first 5 losses within 1e-4 of world 1's and the first step's expert gradients
    within 1e-5 (a divide factor of the experts' own FSDP mesh would give 2x and 4x)."""
    four = run_ranks("tests.moe_jobs:train_moe", 4, {"base": TRAIN, "steps": STEPS, "grads": True, "layouts": [
        ("ep2_hsdp", hf(mixtral) + ["parallel.ep=2", "parallel.dp_replicate=2"]),
        ("ep4_zero3", hf(mixtral) + ["parallel.ep=4", "parallel.zero_stage=3"])]}, timeout=900)
    for rank, res in enumerate(four):
        assert res["ep2_hsdp"]["experts"] == {"placement": "Shard(dim=0)", "first": 2 * (rank % 2), "n": 2}
        assert res["ep4_zero3"]["experts"] == {"placement": "Shard(dim=0)", "first": rank, "n": 1}
        assert all(r["tokens_per_expert"] == world1["zero0"]["tokens_per_expert"] for r in res.values())
    assert_matches_world1(four, world1["zero0"])


@pytest.mark.exhaustive  # world 8; ep 2 under HSDP and ep 4 at world 4 run in the slow tier
def test_mixtral_ep4_under_hsdp_at_world8_matches_world1(mixtral):
    """World 8: ep 4 under HSDP (dp_replicate 2 x dp_shard 4, one expert per rank, each expert's FSDP unit
    over the two replicas), micro-batches of one sample as world 1's (the router's loss is per micro-batch):
    the first 5 losses within 1e-4 and the first step's expert gradients within 1e-5 of world 1's."""
    micro = TRAIN + ["train.micro_batch=1"]
    one = run_ranks("tests.moe_jobs:train_moe", 1, {"base": micro, "steps": STEPS, "grads": True, "layouts": [
        ("zero0", hf(mixtral) + ["parallel.zero_stage=0"])]}, timeout=300)[0]["zero0"]
    eight = run_ranks("tests.moe_jobs:train_moe", 8, {"base": micro, "steps": STEPS, "grads": True, "layouts": [
        ("ep4_hsdp", hf(mixtral) + ["parallel.ep=4", "parallel.dp_replicate=2"])]}, timeout=900)
    for rank, res in enumerate(eight):
        assert res["ep4_hsdp"]["experts"] == {"placement": "Shard(dim=0)", "first": rank % 4, "n": 1}
    assert_matches_world1(eight, one)


def test_mixtral_tp_plan_leaves_its_experts_whole(mixtral):
    """Under tp a Mixtral keeps its own plan for attention, the embedding and the head, and none of transformers'
    expert TP entries (packed_colwise, moe_tp_experts): its sparse blocks run whole on every tp rank."""
    from trainer.config.load import load_config
    from trainer.models import model_preflight, spec_for

    cfg = load_config(None, TRAIN + hf(mixtral) + ["parallel.tp=2"])
    model_preflight(cfg)  # tp was refused for an MoE; the experts' styles are ones etrain does not map
    plan = spec_for(cfg.model).build("meta")._tp_plan
    assert "model.layers.*.self_attn.q_proj" in plan and not any("experts" in k for k in plan), plan


@pytest.mark.slow
def test_mixtral_ep2_tp2_world4_matches_world1(mixtral):
    """ep 2 x tp 2 at world 4 under ZeRO-3: attention split over tp, each rank's ep group the two data-parallel
    ranks of its tp coordinate, the experts whole across tp; 5 losses within 1e-4 of world 1's, the gradient norm,
    the first step's expert gradients within 1e-5 (nothing summed over tp) and the loads per expert."""
    one = run_ranks("tests.moe_jobs:train_moe", 1, {"base": TRAIN, "steps": STEPS, "grads": True, "layouts": [
        ("zero0", hf(mixtral) + ["parallel.zero_stage=0"])]}, timeout=300)[0]["zero0"]
    four = run_ranks("tests.moe_jobs:train_moe", 4, {"base": TRAIN, "steps": STEPS, "grads": True, "layouts": [
        ("ep2_tp2", hf(mixtral) + ["parallel.zero_stage=3", "parallel.ep=2", "parallel.tp=2"])]}, timeout=600)
    from tests.trainer.test_parity import check_memory

    check_memory("ep2_tp2", four)  # the trainer's prediction: the sparse blocks whole on every tp rank
    for rank, res in enumerate(four):
        got = res["ep2_tp2"]
        close(f"ep2 x tp2 rank {rank}", got["losses"], one["losses"])
        assert got["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
        assert got["experts"] == {"placement": "Shard(dim=0)", "first": 2 * (rank // 2), "n": 2}
        assert got["tokens_per_expert"] == one["tokens_per_expert"]
        assert got["comm"]["all_to_all/ep"]["calls"] > 0 and got["comm"]["all_reduce/tp"]["calls"] > 0
        assert len(got["grads"]) == 4  # gate_up_proj and down_proj of both layers
        for name, g in got["grads"].items():
            assert torch.allclose(g, one["grads"][name], atol=1e-5, rtol=0), (rank, name)


@pytest.mark.slow  # five trainer processes, each importing transformers: about 15-30 s here
def test_unmapped_moe_and_ep_exit_2(tmp_path):
    """An MoE family etrain cannot map, an ep that does not divide the experts, and pipeline stages (the
    balancing loss needs every layer's router logits) exit 2 naming the fix."""
    deepseek = write(tmp_path / "ds", {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64,
                                       "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                                       "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
                                       "num_experts_per_tok": 2, "max_position_embeddings": 64})
    three = write(tmp_path / "three", dict(MIXTRAL, num_local_experts=3))
    cases = [(hf(deepseek), "model_type 'deepseek_v3' is a Mixture of Experts"),
             (hf(three) + ["parallel.ep=2"], "parallel.ep=2 does not divide the model's 3 experts"),
             (hf(three) + ["parallel.pp=2", 'model.pp_split_points=["model.layers.1"]'],
              "parallel.pp=2: a mixtral model's balancing loss"),
             (hf(three) + ["parallel.cp=2"], "parallel.cp=2 is not supported with a mixtral model")]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1")  # no peer: a run that got as far as a process group would hang, not exit 2
    procs = [(subprocess.Popen([PY, "-m", "trainer", *[a for o in overrides for a in ("--set", o)]], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), message)
             for overrides, message in cases]  # side by side
    errs = []
    for p, message in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 2 and message in err and "Traceback" not in err, err
        errs.append(err)
    assert "use one of the mapped families mixtral, qwen2_moe, qwen3_moe" in errs[0], errs[0]


QWEN = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.05, "tie_word_embeddings": False}


@pytest.mark.slow
@pytest.mark.parametrize("doc", [dict(QWEN, model_type="qwen2_moe", shared_expert_intermediate_size=64),
                                 dict(QWEN, model_type="qwen3_moe", head_dim=16, norm_topk_prob=True)],
                         ids=["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_matches_the_plain_loop_and_splits_by_ep(tmp_path, doc):
    """Qwen2-MoE (a shared expert beside the routed ones) and Qwen3-MoE: world 1 equals the plain transformers
    loop, and ep 2 under ZeRO-3 at world 2 equals world 1 (losses, expert gradients), and so does tp 2 (the sparse
    blocks whole on both tp ranks; Qwen3's per-head norms on their heads' shard, their gradient summed over tp)."""
    d = write(tmp_path / doc["model_type"], doc)
    one = run_ranks("tests.moe_jobs:train_moe", 1, {"base": TRAIN, "steps": STEPS, "grads": True, "layouts": [
        ("zero0", hf(d) + ["parallel.zero_stage=0"])]}, timeout=300)[0]["zero0"]
    both = run_ranks("tests.moe_jobs:train_moe", 2, {"base": TRAIN, "steps": STEPS, "grads": True, "layouts": [
        ("ep2", hf(d) + ["parallel.zero_stage=3", "parallel.ep=2"]), ("tp2", hf(d) + ["parallel.tp=2"])]},
        timeout=300)[0]
    two, tp2 = both["ep2"], both["tp2"]
    ref, _ = reference_losses(d)
    close("world 1", one["losses"], ref)
    close("ep 2", two["losses"], one["losses"])
    assert two["experts"] == {"placement": "Shard(dim=0)", "first": 0, "n": 2}
    for name, g in two["grads"].items():
        assert torch.allclose(g, one["grads"][name], atol=1e-5, rtol=0), name
    close("tp 2", tp2["losses"], one["losses"])
    assert tp2["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4)
    assert tp2["grads"].keys() == one["grads"].keys()
    for name, g in tp2["grads"].items():
        assert torch.allclose(g, one["grads"][name], atol=1e-5, rtol=0), name


MOE = ['model.preset="moe-tiny"', "model.dim=64", "model.ffn_hidden=48", "model.n_layers=2", "model.n_experts=4",
       "model.top_k=2", "data.max_bytes=200000", "data.seq_len=16", "train.global_batch=4", "train.micro_batch=2",
       "train.warmup_steps=0", "train.lr=3e-3", "metrics.enabled=false", 'parallel.mixed_precision="fp32"']


def export_and_compare(tmp_path, base: list[str], layout: list[str], world: int):
    """2 steps of the built-in MoE of ``base`` in ``layout``, saved; `etrain ckpt export --format hf` of it
    loaded by AutoModelForCausalLM, whose logits must be those of the checkpoint's own model (the built-in
    decoder loaded from the safetensors export) within 1e-4; and ``model.init_from`` reads the directory
    back into the built-in names bit for bit. Returns (the export's config.json, transformers' model)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from orchestrator.cli.main import main as etrain
    from trainer.config.load import load_config
    from trainer.export.convert import WeightSource, export
    from trainer.models.decoder.model import Transformer

    url = f"file://{tmp_path}/ck"
    res = run_ranks("tests.ckpt_jobs:run_plan", world, {"base": base + [f'checkpoint.url="{url}"'], "actions": [
        {"layout": layout, "train": 2, "save": "moe", "state": False}]})
    assert res[0][0]["saves"] == [(2, "committed", "")], res[0][0]
    step = f"{url}/moe/checkpoints/step_000000002"
    out = str(tmp_path / "hf")
    assert etrain(["ckpt", "export", step, out, "--format", "hf"]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    theirs_model = AutoModelForCausalLM.from_pretrained(out).eval()
    export(step, str(tmp_path / "moe.safetensors"), "safetensors")
    mcfg = load_config(None, base).model
    ours_model = Transformer(mcfg).eval()
    ours_model.load_state_dict(load_file(str(tmp_path / "moe.safetensors")))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = ours_model(tokens), theirs_model(input_ids=tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    # model.init_from reads the directory back into the built-in names (gate_up_proj split in two).
    src = WeightSource(out, mcfg)
    src.check({n: tuple(t.shape) for n, t in ours_model.state_dict().items()})
    for name, t in ours_model.state_dict().items():
        assert torch.equal(src.read(name), t), name
    return config, theirs_model


def test_builtin_moe_exports_as_mixtral_and_transformers_computes_its_logits(tmp_path):
    """Saved at ep 2 (world 2, ZeRO-3), a built-in MoE that Mixtral holds exports as a Mixtral (config.json,
    fused gate_up_proj) with the checkpoint's logits, and reads back (export_and_compare)."""
    config, model = export_and_compare(tmp_path, MOE, ["parallel.zero_stage=3", "parallel.ep=2"], 2)
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert tuple(model.model.layers[1].mlp.experts.gate_up_proj.shape) == (4, 96, 64)


@pytest.mark.slow  # about 12 s here; test_qwen2_moe_mapping_holds_the_model checks the mapping in the fast tier
def test_builtin_moe_with_shared_experts_and_dense_blocks_exports_as_qwen2_moe(tmp_path):
    """A built-in MoE that Mixtral cannot hold (every other block dense, a shared expert) exports as a
    Qwen2-MoE (decoder_sparse_step 2, the shared expert behind a zero gate, zero q/k/v biases) whose logits
    are the checkpoint's within 1e-4, and reads back (export_and_compare)."""
    base = MOE + ["model.n_layers=4", "model.moe_every=2", "model.n_shared_experts=1"]
    config, model = export_and_compare(tmp_path, base, ["parallel.zero_stage=0"], 1)
    assert (config["model_type"], config["decoder_sparse_step"], config["shared_expert_intermediate_size"],
            config["norm_topk_prob"]) == ("qwen2_moe", 2, 48, True)
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock"] * 2, kinds
    assert not model.model.layers[1].mlp.shared_expert_gate.weight.any()


@pytest.mark.parametrize("extra", [["model.n_layers=3", "model.moe_every=3"],
                                   ["model.n_layers=2", "model.moe_every=2", "model.n_shared_experts=2"]],
                         ids=["dense_blocks", "shared_experts"])
def test_qwen2_moe_mapping_holds_the_model(tmp_path, extra):
    """The mapping alone (no checkpoint): a built-in MoE with dense blocks before each MoE one, without and
    with shared experts, its state dict renamed, merged and completed with the added zeros (a shared expert
    without rows where there is none), loads strictly into the Qwen2-MoE of its config.json, whose logits are
    the model's within 1e-4; written as the export writes it, model.init_from reads it back bit for bit."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.config.load import load_config
    from trainer.export.convert import WeightSource
    from trainer.models import spec_for
    from trainer.models.decoder.model import Transformer

    mcfg = load_config(None, MOE + extra).model
    ours = Transformer(mcfg).eval()
    ours.init_weights(1)
    names = spec_for(mcfg).hf_names()
    by_name: dict = {}
    for fqn, t in ours.state_dict().items():
        by_name.setdefault(names.hf_name(fqn), {})[fqn] = names.to_hf(fqn, t)
    state = {n: names.merge(n, parts) if len(parts) > 1 else next(iter(parts.values())) for n, parts in by_name.items()}
    state.update({n: torch.zeros(shape) for n, shape in names.added().items()})
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**names.config_json("bytes"))).eval()
    theirs.load_state_dict(state, strict=True)
    kinds = [type(layer.mlp).__name__ for layer in theirs.model.layers]
    assert kinds == ["Qwen2MoeMLP"] * (mcfg.moe_every - 1) + ["Qwen2MoeSparseMoeBlock"], kinds
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - theirs(input_ids=tokens).logits).abs().max().item() < 1e-4
    os.makedirs(tmp_path / "qwen")  # the layout etrain's export writes (transformers' own save splits experts)
    save_file({n: t.contiguous() for n, t in state.items()}, str(tmp_path / "qwen" / "model.safetensors"))
    src = WeightSource(str(tmp_path / "qwen"), mcfg)
    src.check({n: tuple(t.shape) for n, t in ours.state_dict().items()})
    for name, t in ours.state_dict().items():
        assert torch.equal(src.read(name), t), name


@pytest.mark.slow
def test_mixtral_checkpoint_at_ep2_resumes_at_world1(tmp_path, mixtral):
    """3 steps at ep 2 under ZeRO-3 (world 2), saved; resumed at world 1 (ZeRO 0) for 2 more: the 5 losses of
    an uninterrupted world-1 run (DCP reshards the ep-split gate_up_proj and down_proj by their names)."""
    base = TRAIN + hf(mixtral) + [f'checkpoint.url="file://{tmp_path}"']
    plain = run_ranks("tests.ckpt_jobs:run_plan", 1, {"base": base, "actions": [
        {"layout": ["parallel.zero_stage=0"], "train": 5, "state": False}]})[0][0]["losses"]
    first = run_ranks("tests.ckpt_jobs:run_plan", 2, {"base": base, "actions": [
        {"layout": ["parallel.ep=2", "parallel.zero_stage=3"], "train": 3, "save": "moe", "state": False}]})[0][0]
    second = run_ranks("tests.ckpt_jobs:run_plan", 1, {"base": base, "actions": [
        {"layout": ["parallel.zero_stage=0"], "load": "moe", "train": 2, "state": False}]})[0][0]
    assert second["loaded_step"] == 3
    close("resumed", first["losses"] + second["losses"], plain)


def test_mixtral_is_planned_as_the_builtin_moe_of_its_sizes(mixtral):
    """The planner accounts a Mixtral as the built-in MoE of its sizes: the same parameters, experts apart."""
    from trainer.config.load import load_config
    from trainer.models import spec_for

    spec = spec_for(load_config(None, TRAIN + hf(mixtral)).model)
    m = spec.planning_model(32)
    assert (m.source, m.n_experts, m.top_k, m.moe_every, m.ffn_hidden, m.n_shared_experts) == ("builtin", 4, 2, 1,
                                                                                                96, 0)
    assert spec.allows() == ("tp",)  # data, expert and tensor parallelism (its sparse blocks whole on each tp rank)
    shape = spec_for(m).shape()
    assert shape.n_params == sum(p.numel() for p in spec.build("meta").parameters())
    assert shape.experts == 2 * 4 * 3 * 64 * 96
    from checkpointing.errors import ConfigError

    cfg = load_config(None, TRAIN + hf(mixtral) + ["model.router_bias_update_rate=0.01"])
    with pytest.raises(ConfigError, match="a mixtral router has none; set it to 0"):
        spec_for(cfg.model).check_moe(cfg)
