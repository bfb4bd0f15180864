"""Hugging Face mixture-of-experts models in the narrow recipes, through transformers' experts
interface: which modules are experts and routers in every family, the implementation against
transformers' own grouped_mm, routers in FP32, the audit per experts GEMM, what stays out."""

import logging

import pytest
import torch

from mixprec import audit
from mixprec.narrow.experts import hf as hf_experts
from mixprec.precision import Policy

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts_per_tok=2, max_position_embeddings=64)
FAMILIES = {
    "qwen3_moe": dict(num_experts=8),
    "qwen2_moe": dict(num_experts=8, shared_expert_intermediate_size=32),
    "mixtral": dict(num_local_experts=8),
    "olmoe": dict(num_experts=8),
    "deepseek_v3": dict(n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        head_dim=8),
    "gpt_oss": dict(num_local_experts=8, layer_types=["full_attention"] * 2),  # transposed, biased, interleaved
    "phimoe": dict(num_local_experts=8),  # its router subclasses nn.Linear
}


def tiny(family: str, seed: int = 0, **extra):
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(family, **{**SMALL, **FAMILIES.get(family, {}), **extra})
    return transformers.AutoModelForCausalLM.from_config(config)


def batch(seed=0, rows=2, tokens=24):
    ids = torch.randint(0, 128, (rows, tokens), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def experts_of(model):
    return {fqn: m for fqn, m in model.named_modules() if hf_experts.interface_experts(m)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_runs_its_experts_in_the_recipe_and_its_routers_in_fp32(family):
    model = tiny(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = Policy.from_preset("fp8-rowwise")
    policy.setup(model, optimizer)
    rows = policy.layout.modules
    found = experts_of(model)
    assert len(found) == 2
    for fqn, module in found.items():
        assert rows[fqn].kind == "experts" and rows[fqn].compute.name == "rowwise", (fqn, rows[fqn])
        assert hf_experts.runs_narrow(module)
    routers = policy.layout.routers()
    assert len(routers) >= 2 and all(r.storage == r.compute == torch.float32 for r in routers.values())
    if family == "qwen2_moe":  # the one-output gate of the shared expert, by role
        assert any(f.endswith("shared_expert_gate") for f in routers)
    logits = []
    handles = [model.get_submodule(f).register_forward_hook(lambda m, a, out: logits.append(out[0] if isinstance(
        out, tuple) else out)) for f in routers]
    with policy.autocast():
        loss = model(**batch()).loss
    policy.backward(loss)
    for h in handles:
        h.remove()
    assert logits and all(t.dtype == torch.float32 for t in logits)  # the router logits
    grads = [p.grad for m in found.values() for p in hf_experts.expert_weights(m).values()]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
def test_the_base_route_is_transformers_grouped_mm(family):
    """The mixprec implementation's routing, gate, biases and combine (an experts module in the base
    mode: torch's grouped GEMM in the compute dtype) against transformers' grouped_mm, a model in
    bfloat16: the same GEMMs on the same rows, so the same outputs and gradients."""
    ref, mine = tiny(family).bfloat16(), tiny(family).bfloat16()  # ref keeps transformers' default, grouped_mm
    hf_experts.in_base_mode(mine, list(experts_of(mine)), torch.bfloat16)
    assert mine.config._experts_implementation == "mixprec" and ref.config._experts_implementation == "grouped_mm"
    b = batch(1)
    out_ref, out_mine = ref(**b), mine(**b)
    out_ref.loss.backward()
    out_mine.loss.backward()
    assert torch.equal(out_ref.logits, out_mine.logits)
    for (name, p), q in zip(ref.named_parameters(), mine.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_audit_lists_each_experts_gemm_and_fails_when_the_interface_is_bypassed():
    model = tiny("qwen3_moe")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = Policy.from_preset("mxfp8")
    policy.setup(model, optimizer)
    report = audit(model, policy, optimizer, [batch(0), batch(1)])
    assert report["ok"], report
    stage = next(r for r in report["stages"] if r["stage"] == "experts modules by compute (per module)")
    assert stage["promised"] == stage["observed"] == ["2 float8"]
    notes = [n for n in report["notes"] if n.startswith("experts ") and "tokens per expert" not in n]
    tokens = [n for n in report["notes"] if "tokens per expert in the audited step" in n]
    assert len(tokens) == 2  # one line per experts module: the rows each expert received
    assert len(notes) == 2 and all("gate_up_proj: forward float8" in n and "down_proj: forward float8" in n
                                   for n in notes)
    model.config._experts_implementation = "grouped_mm"  # transformers' own: the recipe bypassed
    report = audit(model, policy, optimizer, [batch(0), batch(1)])
    stage = next(r for r in report["stages"] if r["stage"] == "experts modules by compute (per module)")
    assert not report["ok"] and not stage["ok"] and stage["observed"] != stage["promised"], stage


def test_experts_outside_the_interface_are_named_and_left_in_the_base_mode(caplog):
    model = tiny("llama4_text", intermediate_size_mlp=64, num_local_experts=8, num_experts_per_tok=1)
    policy = Policy.from_preset("fp8-rowwise")
    with caplog.at_level(logging.INFO, logger="mixprec"):
        policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    rows = {f: r for f, r in policy.layout.modules.items() if r.kind == "experts"}
    assert len(rows) == 2 and all(r.compute == torch.bfloat16 for r in rows.values())
    assert all("outside transformers' experts interface" in r.why for r in rows.values())
    said = [r.message for r in caplog.records if "Llama4TextExperts is outside" in r.message]
    assert len(said) == 2
    routers = policy.layout.routers()  # Llama4Router subclasses nn.Linear: a router by role, in FP32
    assert len(routers) == 2 and all(r.compute == torch.float32 for r in routers.values())


def test_delayed_scaling_leaves_the_experts_out_with_a_reason():
    model = tiny("mixtral")
    policy = Policy.from_preset("fp8-delayed")
    policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    rows = [r for r in policy.layout.modules.values() if r.kind == "experts"]
    assert rows and all(r.compute == torch.bfloat16 and "delayed scaling" in r.why for r in rows)


@pytest.mark.slow  # cold (an empty Inductor cache) over 20 s beyond its code generation
def test_compiled_moe_block_has_no_graph_break_and_matches_eager():
    model = tiny("qwen3_moe")
    policy = Policy.from_preset("fp8-rowwise")
    policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    block = model.model.layers[0].mlp
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(0))

    def run(x):
        with policy.autocast():
            return block(x)

    eager = run(x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(run)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(run)(x)
    # the experts operators are bit-exact compiled (tests/narrow/test_experts.py), the routing too; around
    # them Inductor computes the gate's silu(gate) * up in FP32 and rounds once where eager rounds each op
    # to bfloat16 (an ulp, 2^-8, on some elements), and such an element may land on the neighbouring e4m3
    # value in the down projection's cast: measured 0.33% relative in bf16-mixed, 0.77% in fp8-rowwise
    err = float((compiled.float() - eager.float()).norm() / eager.float().norm())
    assert compiled.dtype == eager.dtype and err < 2e-2, err


def moe_config(folder, family="qwen3_moe"):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": family, **SMALL, "vocab_size": 512,
                                                    **FAMILIES[family]}))
    return folder


@pytest.mark.parametrize("preset", ["fp8-blockwise", "nvfp4"])
def test_the_documented_commands_train_and_audit_a_moe_model(tmp_path, text_file, capsys, preset):
    """docs/moe.md: `mixprec train` and `mixprec audit` with model.hf_config naming an MoE model."""
    import json

    from conftest import run_train, tiny_args
    from mixprec.cli import main

    config = moe_config(tmp_path / "cfg", "gpt_oss" if preset == "nvfp4" else "qwen3_moe")
    hf = ("--model.hf_config", str(config), "--data.tokenizer", "byte", "--precision.preset", preset)
    records = run_train(tmp_path / "run", text_file, *hf)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    capsys.readouterr()
    args = tiny_args(tmp_path / "unused", text_file, *hf)
    args[0] = "audit"
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stage = next(r for r in report["stages"] if r["stage"] == "experts modules by compute (per module)")
    assert stage["ok"] and stage["observed"] == stage["promised"]
    narrow = 2 if preset == "fp8-blockwise" else 1  # nvfp4 keeps the last decoder block of two in bfloat16
    assert f"{narrow} {'float8' if narrow == 2 else 'e2m1'}" in stage["observed"]


def test_coverage_benchmark_counts_the_experts():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from moe_coverage import coverage

    share, narrow, total = coverage("gpt_oss", "fp8-rowwise")
    assert narrow == total == 2 and share > 0.99


@pytest.mark.parametrize("preset", ["fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4", "mxfp4",
                                    "bf16-mixed", "fp8-delayed"])
def test_audit_passes_on_a_moe_model_in_every_preset(preset):
    from mixprec.optim import AdamW

    model = tiny("gpt_oss")
    policy = Policy.from_preset(preset)
    optimizer = AdamW(model.parameters(), lr=1e-3, states=policy.spec.moments)
    policy.setup(model, optimizer)
    report = audit(model, policy, optimizer, [batch(0), batch(1)])
    assert report["ok"], [r for r in report["stages"] if not r["ok"]]
    stage = next(r for r in report["stages"] if r["stage"] == "experts modules by compute (per module)")
    narrow = {"nvfp4": ["1 bfloat16", "1 e2m1"], "mxfp4": ["2 e2m1"], "bf16-mixed": ["2 bfloat16"],
              "fp8-delayed": ["2 bfloat16"]}.get(preset, ["2 float8"])
    assert stage["observed"] == narrow


def test_another_experts_implementation_is_replaced_and_said(caplog):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("mixtral", **{**SMALL, **FAMILIES["mixtral"]})
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="batched_mm")
    assert model.config._experts_implementation == "batched_mm"
    with caplog.at_level(logging.INFO, logger="mixprec"):
        Policy.from_preset("mxfp8").setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert model.config._experts_implementation == "mixprec"
    assert any("experts_implementation 'batched_mm' replaced by 'mixprec'" in r.message for r in caplog.records)


WRAPPED = {  # routers inside a wrapper module: found by their role, not by their name
    "hunyuan_v1_moe": (dict(num_experts=8), "mlp.gate.wg"),
    "afmoe": (dict(num_experts=8, num_dense_layers=0), "mlp.router.gate"),
    "gemma4_text": (dict(num_experts=8, enable_moe_block=True, top_k_experts=2, expert_intermediate_size=32),
                    "router.proj"),
}


@pytest.mark.parametrize("family", list(WRAPPED))
def test_a_router_inside_a_wrapper_stays_out_of_the_recipe_in_fp32(family):
    from mixprec.narrow.linear.fp8 import FP8Linear

    extra, suffix = WRAPPED[family]
    if family not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    model = tiny(family, **extra)
    policy = Policy.from_preset("fp8-rowwise")
    policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    routers = policy.layout.routers()
    assert sorted(routers) == [f"model.layers.{i}.{suffix}" for i in range(2)], sorted(routers)
    assert all(r.storage == r.compute == torch.float32 for r in routers.values())
    assert not any(isinstance(model.get_submodule(f), FP8Linear) for f in routers)
    assert all(policy.layout.modules[f].compute.name == "rowwise" for f in experts_of(model))
    logits = []
    handles = [model.get_submodule(f).register_forward_hook(lambda m, a, out: logits.append(out)) for f in routers]
    with policy.autocast():
        model(**batch())
    for h in handles:
        h.remove()
    assert len(logits) == 2 and all(t.dtype == torch.float32 for t in logits)


def _as_release(model, missing):
    """Each experts module as an older transformers release builds it: without the flags it set later."""
    for m in experts_of(model).values():
        for name in missing:
            m.__dict__.pop(name, None)
    return model


@pytest.mark.parametrize("release,missing", [  # the flags transformers' decorator sets, release by release
    ("5.0-5.2", ("has_gate", "is_concatenated", "_is_expert_parallel", "has_post_expert_norm")),
    ("5.8-5.17", ("_is_expert_parallel", "has_post_expert_norm")),
    ("5.18-5.19", ("has_post_expert_norm",))])
def test_experts_of_every_release_run_in_the_base_mode_and_the_recipe(release, missing):
    """bf16-mixed: the experts on torch's grouped GEMM in bfloat16, as on the newest release, and
    fp8-rowwise in the recipe, whatever layout flags the release's decorator set."""
    outputs = {}
    for preset in ("bf16-mixed", "fp8-rowwise"):
        for old in (False, True):
            model = tiny("qwen3_moe")
            if old:
                _as_release(model, missing)
            assert len(experts_of(model)) == 2
            policy = Policy.from_preset(preset)
            policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
            rows = [r for r in policy.layout.modules.values() if r.kind == "experts"]
            assert len(rows) == 2 and all(hf_experts.runs_narrow(m) == (preset != "bf16-mixed")
                                          for m in experts_of(model).values())
            with policy.autocast():
                out = model(**batch())
            policy.backward(out.loss)
            outputs[preset, old] = out.logits, [p.grad for p in model.parameters()]
        (new_logits, new_grads), (old_logits, old_grads) = outputs[preset, False], outputs[preset, True]
        assert torch.equal(new_logits, old_logits)
        assert all(torch.equal(a, b) for a, b in zip(new_grads, old_grads))


def test_experts_weights_of_every_token_and_expert_are_read_as_top_k():
    """transformers before 5.2 hands DeepSeek-V2-style routers' weights as (tokens, experts): the same
    output as their top-k columns."""
    model = tiny("qwen3_moe")
    hf_experts.in_base_mode(model, list(experts_of(model)), torch.float32)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[0, 3], [1, 2], [7, 0], [5, 6], [3, 2], [4, 1]])
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(1))
    dense = torch.zeros(6, 8).scatter(1, index, weights)
    assert torch.equal(experts(x, index, weights), experts(x, index, dense))


def test_setting_up_one_model_leaves_another_of_the_same_config_alone():
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen3_moe", **{**SMALL, **FAMILIES["qwen3_moe"]})
    config._experts_implementation = "eager"
    first = transformers.AutoModelForCausalLM.from_config(config)
    other = transformers.AutoModelForCausalLM.from_config(config)
    assert first.config is other.config
    Policy.from_preset("fp8-rowwise").setup(first, torch.optim.AdamW(first.parameters(), lr=1e-3))
    assert first.config._experts_implementation == "mixprec"
    assert all(m.config is first.config for m in experts_of(first).values())
    assert config._experts_implementation == other.config._experts_implementation == "eager"
    assert all(m.config is config for m in experts_of(other).values())
    with torch.no_grad():  # the other model still runs transformers' eager experts
        other(**batch())


def test_experts_choose_their_routes_where_the_model_is_materialised():
    """A model converted on the meta device with only its experts in the recipe: materialised by
    to_empty (each child's _apply), its experts' GEMMs are planned for the CPU, not left on meta's
    routes; the conversion's record follows (Policy.probe, as after fully_shard)."""
    from mixprec.narrow.convert import convert_to_fp8
    from mixprec.narrow.formats.recipe import FP8Recipe

    with torch.device("meta"):
        model = tiny("qwen3_moe")
    fqns = list(experts_of(model))
    conversion = convert_to_fp8(model, FP8Recipe.from_name("rowwise"), compute_dtype=torch.bfloat16,
                                modules=[], experts=fqns, device_type="meta")
    assert not conversion.modules and len(conversion.experts) == 2
    assert all(g.plan.device == "meta" for layer in conversion.experts.values() for g in layer.gemms)
    model.to_empty(device="cpu")
    layers = [model.get_submodule(f).mixprec_experts for f in fqns]
    assert all(g.plan.device == "cpu" for layer in layers for g in layer.gemms)
    assert not any("mixprec_moves" in k for k in model.state_dict())  # nothing saved
    conversion.move("cpu")
    assert conversion.device == "cpu" and not any("meta" in (why or "") for why in conversion.routes.values())
