"""mixprec's own mixture-of-experts flavors (mixprec.models.moe): the router in FP32 in every
preset, the experts in the preset's recipe, the two balancings, and runs that resume bit for bit."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import kill_9_after, run_train, tiny_args
from mixprec.models import moe
from mixprec.models.llama import build_model, model_args, rope_tables
from mixprec.precision import Policy
from mixprec.precision.presets import PRESETS

MOE = ("--model.flavor", "moe-debug")


def built(preset: str, **overrides):
    model = build_model(model_args("moe-debug", 256, **overrides), device="cpu",
                        storage_dtype=Policy.from_preset(preset).storage_dtype, seed=0)
    policy = Policy.from_preset(preset)
    policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, policy


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-true", "fp8-rowwise", "nvfp4"])
def test_the_router_computes_in_float32_and_the_experts_in_the_recipe(preset):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Logits(TorchDispatchMode):  # the routers' GEMMs: (tokens, 64) @ (64, 8 experts)
        seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == 8:
                self.seen.add((args[-2].dtype, args[-1].dtype, out.dtype))
            return out

    model, policy = built(preset)
    tokens = torch.randint(0, 256, (2, 16))
    with policy.autocast(), Logits() as mode:
        model(tokens, tokens)
    assert mode.seen == {(torch.float32,) * 3}
    for i in range(2):
        router = model.layers[i].feed_forward.router
        assert router.weight.dtype == router.bias.dtype == torch.float32
        layout = policy.layout.modules[f"layers.{i}.feed_forward.experts"]
        assert layout.kind == "experts"
        narrow = PRESETS[preset].fp8 is not None and not (preset == "nvfp4" and i == 1)  # its last block in bf16
        assert layout.compute == (PRESETS[preset].fp8 if narrow else torch.bfloat16), layout.why
        assert model.layers[i].feed_forward.experts.mixprec_experts.narrow == narrow


def test_the_bias_moves_towards_the_underloaded_experts_and_keeps_its_level():
    model, _ = built("fp32")
    router = model.layers[0].feed_forward.router
    router.tokens.copy_(torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5]))  # mean 5: expert 0 over, 1 under
    model.layers[1].feed_forward.router.tokens.fill_(5.0)  # even: its bias stays
    load, low, high = moe.update_balance(moe.moe_layers(model)).tolist()
    step = 1e-3 * torch.tensor([-1.0, 1, 0, 0, 0, 0, 0, 0])
    torch.testing.assert_close(router.bias, step - step.mean())
    assert model.layers[1].feed_forward.router.bias.eq(0).all()
    assert load == 2.0 and (low, high) == pytest.approx((-1e-3, 1e-3))
    assert router.tokens.eq(0).all()


def test_the_top_k_is_chosen_on_score_plus_bias_and_weighted_by_the_score_alone():
    model, _ = built("fp32")
    router = model.layers[0].feed_forward.router
    x = torch.randn(5, 64)
    router.bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 10.0, 10.0]))  # forces experts 6 and 7
    weights, index = router(x)
    assert sorted(index[0].tolist()) == [6, 7] and all(sorted(r) == [6, 7] for r in index.tolist())
    scores = (x @ router.weight.T).sigmoid()[:, 6:]
    want = scores / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.sort(-1).values, want.sort(-1).values)


def test_the_auxiliary_loss_is_the_switch_loss_and_only_trains():
    model, _ = built("fp32", balance="aux")
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        lm = model(tokens, tokens)
    total = model(tokens, tokens)
    aux, h = 0.0, model.tok_embeddings(tokens)  # each block's f_e * P_e again, from its router's inputs
    cos, sin = rope_tables(16, model.args.head_dim, model.args.rope_theta, "cpu")
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)
    for layer in model.layers:
        x = layer.ffn_norm(h + layer.attention(layer.attention_norm(h), cos, sin, mask)).flatten(0, 1)
        scores = (x @ layer.feed_forward.router.weight.T).sigmoid()
        index = torch.topk(scores, 2, dim=-1).indices
        share = torch.bincount(index.flatten(), minlength=8).float() / index.numel()
        aux = aux + 8 * (share * (scores / scores.sum(-1, keepdim=True)).mean(0)).sum()
        h = layer(h, cos, sin, mask)
    assert (total - lm).item() == pytest.approx(1e-2 * aux.item(), rel=1e-4)
    total.backward()
    assert model.layers[0].feed_forward.router.weight.grad.abs().sum() > 0


# bf16-kahan-8bit steps the experts' (E, 2I, D) moments in 8 bits; bf16-mixed-8bit would add nothing more here
@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if p != "bf16-mixed-8bit"))
def test_moe_debug_trains_in_every_preset(tmp_path, text_file, preset, capsys):
    records = run_train(tmp_path, text_file, *MOE, "--precision.preset", preset, "--training.steps", "3",
                        "--metrics.log_freq", "1", "--training.eval_interval", "3")
    assert all(r["loss"] == r["loss"] and r["router_load"] >= 1.0 for r in records)
    out = capsys.readouterr().out
    assert ("feed_forward.router computes in float32" in out) == (preset != "fp32")
    if PRESETS[preset].fp8 is not None and PRESETS[preset].fp8.delayed:
        assert "feed_forward.experts stays in bfloat16: delayed scaling keeps one amax history" in out


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-rowwise", "nvfp4"])
def test_a_resumed_moe_run_writes_the_uninterrupted_runs_checkpoint_bit_for_bit(tmp_path, text_file, preset):
    flags = (*MOE, "--precision.preset", preset, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0")
    full = run_train(tmp_path / "full", text_file, *flags)
    run_train(tmp_path / "cut", text_file, *flags, "--training.steps", "2")
    resumed = run_train(tmp_path / "cut", text_file, *flags)
    assert [(r["loss"], r.get("router_load"), r.get("expert_bias_max")) for r in resumed] == \
        [(r["loss"], r.get("router_load"), r.get("expert_bias_max")) for r in full]
    a = torch.load(tmp_path / "full" / "checkpoint" / "step-6.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "cut" / "checkpoint" / "step-6.pt", weights_only=True)["model"]
    bias = "layers.1.feed_forward.router.bias"
    assert a[bias].dtype == torch.float32 and a[bias].abs().sum() > 0  # six steps of balancing, saved
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_gives_the_uninterrupted_moe_run(tmp_path, text_file):
    def cmd(folder):
        return [sys.executable, "-m", "mixprec", *tiny_args(
            folder, text_file, *MOE, "--training.steps", "8", "--checkpoint.interval", "4",
            "--checkpoint.keep_latest_k", "0", "--precision.preset", "fp8-rowwise", "--metrics.log_freq", "1")]

    records = lambda folder: [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    full, run = tmp_path / "full", tmp_path / "killed"
    done = subprocess.run(cmd(full), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = run / "checkpoint" / "step-4.pt"
    kill_9_after(cmd(run), saved)
    assert saved.exists() and records(run)[-1]["step"] < 8
    again = subprocess.run(cmd(run), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    keys = ("step", "loss", "grad_norm", "router_load", "expert_bias_min", "expert_bias_max", "val_loss")
    assert [[r.get(k) for k in keys] for r in records(run)] == [[r.get(k) for k in keys] for r in records(full)]


def _refused_by_deterministic_cuda(func, args, kwargs) -> bool:
    """Whether CUDA's kernel of this op raises under torch.use_deterministic_algorithms(True) (torch's list:
    histc, bincount with weights, put_, median with indices, floating-point cumsum, scatter_reduce's prod)."""
    name, kwargs = func.overloadpacket.__name__, kwargs or {}
    floating = any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args[:1])
    return (name in ("histc", "put_", "put") or (name == "bincount" and (len(args) > 1 or "weights" in kwargs))
            or (name == "median" and len(args) > 1) or (name == "cumsum" and floating)
            or (name.startswith("scatter_reduce") and "prod" in args))


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-blockwise", "fp8-rowwise", "mxfp8", "nvfp4"])
def test_an_moe_step_runs_no_op_deterministic_cuda_refuses(preset):
    """Users chasing bit-for-bit runs set torch.use_deterministic_algorithms(True) (TorchTitan's
    debug.deterministic); CUDA's histc raises there, and the dispatch counted the experts' rows with it. The
    model's ops and the experts' passes (opened: the operator's insides), checked against torch's list."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mixprec.narrow.experts import ops as experts

    class Refused(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _refused_by_deterministic_cuda(func, args, kwargs):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    model, policy = built(preset)
    tokens = torch.randint(0, 256, (2, 16))
    with policy.autocast(), Refused() as mode:
        model(tokens, tokens).backward()
    layer = model.layers[0].feed_forward.experts.mixprec_experts
    if layer.narrow:
        g, w = layer.gemms[0], model.layers[0].feed_forward.experts.gate_up_proj.detach()  # (8, 64, 64)
        x = torch.randn(40, 64).bfloat16()
        offs = torch.tensor([5, 5, 12, 20, 20, 31, 39, 40], dtype=torch.int32)
        with Refused():
            experts.forward(x, w, offs, g)
            experts.backward(x, w, offs, torch.randn(40, 64).bfloat16(), g)
    assert mode.seen == [], mode.seen
    assert _refused_by_deterministic_cuda(torch.ops.aten.histc.default, (torch.zeros(3),), {})  # the check can fail


@pytest.mark.parametrize("preset", ["fp8-rowwise", "mxfp4"])
def test_compiled_moe_blocks_share_one_graph_and_each_keeps_its_salts(preset, monkeypatch):
    """Each block compiled on its own (as the trainer compiles them): one graph serves every MoE block (the
    experts operators' key is the plan's, not the layer's), and each layer's backward still gets its own
    stochastic-rounding salts (a tensor argument)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from mixprec.narrow.experts import ops

    torch._dynamo.reset()
    model, policy = built(preset, n_layers=3)
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.layers:
        block.forward = torch.compile(block.forward, backend=counter)
    seen, backward = [], ops.backward

    def recording(x, weight, offs, dy, g, salts=None):
        seen.append(None if salts is None else tuple(salts.tolist()))
        return backward(x, weight, offs, dy, g, salts)

    monkeypatch.setattr(ops, "backward", recording)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with policy.autocast():
        model(tokens, tokens).backward()
    torch._dynamo.reset()
    assert counter.frame_count == 1
    layers = [block.feed_forward.experts.mixprec_experts for block in model.layers]
    want = [None] * 6 if preset == "fp8-rowwise" else [g.salts + (0,) for layer in layers for g in layer.gemms]
    assert sorted(seen, key=str) == sorted(want, key=str) and (preset == "fp8-rowwise" or len(set(seen)) == 6)
