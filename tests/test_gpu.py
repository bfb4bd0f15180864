"""The important paths on CUDA (skipped without a GPU). Each keeps its CPU test:
tests/train/test_trainer.py, test_parallelize.py, tests/precision/test_fp16.py,
tests/analysis/test_audit.py, tests/models/test_loss.py. A test whose logic is the same on
both devices is one test parametrized over them instead (DEVICES in
tests/stability/test_recovery.py, tests/narrow/test_all_gather.py): CI runs its assertions."""

import json
import math

import pytest
import torch

from conftest import run_train, tiny_args
from mixprec.cli import main
from mixprec.models.loss import chunked_cross_entropy
from mixprec.precision.presets import PRESETS

pytestmark = pytest.mark.gpu
CUDA = ("--training.device", "cuda")


def losses(records):
    return [r["loss"] for r in records]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_to_a_finite_loss(tmp_path, text_file, preset):
    extra = ("--training.eps", "1e-4") if preset == "fp16-true" else ()  # 1e-8 is 0 in float16
    records = run_train(tmp_path / preset, text_file, *CUDA, "--precision.preset", preset, *extra)
    assert all(math.isfinite(r["loss"]) for r in records)
    summary = json.loads((tmp_path / preset / "summary.json").read_text())
    assert summary["device"].startswith("cuda") and math.isfinite(summary["final_val_loss"])
    assert all("mfu" in r for r in records)  # a number on a GPU in the peak table, else null: never a crash


def test_bf16_mixed_audit_passes_on_cuda(tmp_path, text_file, capsys):
    args = tiny_args(tmp_path / "unused", text_file, *CUDA, "--precision.preset", "bf16-mixed")
    args[0] = "audit"
    assert main([*args, "--json"]) == 0
    stages = {r["stage"]: r["observed"] for r in json.loads(capsys.readouterr().out)["stages"]}
    assert stages["matmul output"] == ["bfloat16"] and stages["reduced gradients"] == ["float32"]


def test_tf32_is_what_the_audit_sees(tmp_path, text_file, capsys):
    args = tiny_args(tmp_path / "unused", text_file, *CUDA, "--precision.preset", "fp32", "--precision.tf32")
    args[0] = "audit"
    try:
        assert main([*args, "--json"]) == 0
        stages = {r["stage"]: r["observed"] for r in json.loads(capsys.readouterr().out)["stages"]}
        assert stages["float32 matmuls"] == ["tfloat32"]
    finally:
        torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed", "bf16-true"])
def test_compile_on_and_off_give_the_same_losses(tmp_path, text_file, preset):
    eager = run_train(tmp_path / "eager", text_file, *CUDA, "--precision.preset", preset)
    compiled = run_train(tmp_path / "compiled", text_file, *CUDA, "--precision.preset", preset, "--compile.enable",
                         "--activation_checkpoint.mode", "selective", "--model.loss", "chunked")
    assert [r["skipped"] for r in compiled] == [r["skipped"] for r in eager]
    for a, b in zip(losses(eager), losses(compiled)):
        assert abs(a - b) / a < 2e-2  # bf16 rounding in other places after fusion


def test_checkpoint_resume_is_exact_on_cuda(tmp_path, text_file):
    flags = (*CUDA, "--precision.preset", "bf16-mixed", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0")
    full = run_train(tmp_path / "run", text_file, *flags)
    (tmp_path / "run" / "checkpoint" / "step-6.pt").unlink()
    resumed = run_train(tmp_path / "run", text_file, *flags)
    assert losses(resumed) == losses(full)


def test_chunked_loss_on_cuda_matches_the_plain_loss():
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(2048, 256, device="cuda", generator=gen).requires_grad_()
    w = (torch.randn(32000, 256, device="cuda", generator=gen) * 0.05).requires_grad_()
    t = torch.randint(0, 32000, (2048,), device="cuda", generator=gen)
    grads = []
    for fn in (lambda: torch.nn.functional.cross_entropy((h @ w.t()).float(), t),
               lambda: chunked_cross_entropy(h, w, t, 512)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn()
        (loss * 1024).backward()
        grads.append((loss.item(), h.grad.clone(), w.grad.clone()))
        h.grad = w.grad = None
    (l0, h0, w0), (l1, h1, w1) = grads
    assert l1 == pytest.approx(l0, rel=1e-4)
    assert (h1 - h0).norm() / h0.norm() < 1e-2 and (w1 - w0).norm() / w0.norm() < 1e-2


@pytest.mark.parametrize("preset", ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise"])
def test_fp8_recipes_use_torchs_kernels_and_pass_the_audit_on_cuda(tmp_path, text_file, capsys, preset):
    # the debug flavor's dims are not multiples of 128: block-wise may be emulated there, not the others
    args = tiny_args(tmp_path / "unused", text_file, *CUDA, "--precision.preset", preset)
    args[0] = "audit"
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"]
    if preset != "fp8-blockwise":  # each GEMM named by its kernel (tests/narrow/test_gemm.py: the CPU twin)
        kernel = "torch._scaled_mm row-wise, or with unit scales" if preset == "fp8-rowwise" else "torch._scaled_mm"
        assert any(f"forward: {kernel}" in n and f"weight gradient: {kernel}" in n for n in report["notes"])


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4", "mxfp4"])
def test_microscaled_recipes_pass_the_audit_on_cuda(tmp_path, text_file, capsys, preset):
    args = tiny_args(tmp_path / "unused", text_file, *CUDA, "--precision.preset", preset)
    args[0] = "audit"
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "mxfp4"])
def test_the_microscaled_emulation_on_cuda_has_the_cpus_bits(recipe):
    # tests/narrow/test_microscaling.py holds the CPU's casts to torchao's; the same casts on CUDA
    from mixprec.narrow.formats.mx import _key
    from mixprec.narrow.gemm.mx import mx_mm
    from mixprec.narrow.formats.recipe import RECIPES

    r = RECIPES[recipe]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=g) * 3, torch.randn(384, 512, generator=g)
    key = _key(a, 7, 1)
    for gradient in (False, True):
        cpu, gpu = r.quantize(a, gradient=gradient, key=key), r.quantize(a.cuda(), gradient=gradient, key=key.cuda())
        assert torch.equal(cpu.data.view(torch.uint8), gpu.data.view(torch.uint8).cpu())
        assert torch.equal(cpu.scale.view(torch.uint8), gpu.scale.view(torch.uint8).cpu())
    # the GEMM: exact products, FP32 sums in the device's order (the CPU's FP32 GEMM, CUDA's
    # bfloat16 GEMM with an FP32 output on the same values)
    out_cpu = mx_mm(r.quantize(a), r.quantize(b), torch.float32)
    out_gpu = mx_mm(r.quantize(a.cuda()), r.quantize(b.cuda()), torch.float32).cpu()
    torch.testing.assert_close(out_gpu, out_cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_the_microscaled_emulation_runs_in_bfloat16_on_cuda_within_fp32_summation(recipe):
    from mixprec.narrow.formats.mx import gemm_route
    from mixprec.narrow.gemm.mx import mx_mm
    from mixprec.narrow.formats.recipe import RECIPES

    assert gemm_route("cuda") is None  # torch >= 2.8 has mm.dtype on CUDA
    r = RECIPES[recipe]
    g = torch.Generator().manual_seed(1)
    qa, qb = (r.quantize(torch.randn(shape, generator=g).cuda()) for shape in ((1024, 2048), (512, 2048)))
    got = mx_mm(qa, qb, torch.float32).double()
    want = qa.dequantize().double() @ qb.dequantize().double().t()
    assert float((got - want).norm() / want.norm()) < 1e-6  # FP32 summation over K = 2048


@pytest.mark.parametrize("preset", ["fp8-tensorwise", "fp8-rowwise"])
def test_compiled_fp8_tracks_eager_on_cuda(tmp_path, text_file, preset):
    eager = run_train(tmp_path / "eager", text_file, *CUDA, "--precision.preset", preset)
    compiled = run_train(tmp_path / "compiled", text_file, *CUDA, "--precision.preset", preset, "--compile.enable")
    for a, b in zip(losses(eager), losses(compiled)):
        assert abs(a - b) / a < 2e-2


def test_a_snapshot_of_cuda_tensors_sees_the_state_at_capture():
    from mixprec.stability import clone_state

    t = torch.randn(1 << 22, device="cuda")
    before = t.cpu()
    snapshot = clone_state({"state": [t]})
    t.mul_(2)  # queued after the non-blocking copy on the same stream
    torch.cuda.synchronize()
    assert snapshot["state"][0].is_pinned() and torch.equal(snapshot["state"][0], before)


def test_stochastic_rounding_gives_the_cpus_bits_on_cuda_eager_and_compiled():
    # CPU test: tests/optim/test_updates.py (counter-based bits: the same on every device)
    from mixprec.rounding import rounding_key, stochastic_round_bf16

    x = torch.randn(4096, 33) * 10
    key = torch.tensor(rounding_key(0, 0, 3, 1), dtype=torch.int32)
    on_cpu = stochastic_round_bf16(x, key)
    compiled = torch.compile(stochastic_round_bf16, dynamic=True)
    for out in (stochastic_round_bf16(x.cuda(), key), compiled(x.cuda(), key)):
        assert torch.equal(out.cpu().view(torch.int16), on_cpu.view(torch.int16))


def test_nearest_rounding_on_cuda_is_torchs_cast_eager_and_compiled():
    # CPU test: tests/optim/test_updates.py (Veltkamp's split there; the bits here)
    from mixprec.rounding import nearest_bf16

    mantissas = torch.arange(1 << 23, dtype=torch.int32)
    x = torch.cat([((e << 23) | mantissas).view(torch.float32) for e in (1, 127, 250)]).cuda()
    x = torch.cat([x, -x, torch.tensor([float("inf"), -float("inf")], device="cuda")])
    for fn in (nearest_bf16, torch.compile(nearest_bf16, dynamic=True)):
        assert torch.equal(fn(x), x.to(torch.bfloat16).float())


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_bf16_updates_fused_adamw_on_cuda_tracks_the_cpu(method):
    from mixprec.optim.updates import BF16Updates

    def run(device):
        torch.manual_seed(0)
        p = torch.nn.Parameter((torch.randn(256, 64) + 1).to(torch.bfloat16).to(device))
        opt = torch.optim.AdamW([p], lr=1e-3)
        updates = BF16Updates(opt, method, seed=0)
        assert updates.fused
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16).to(device)
            updates.step()
        return p.detach().float().cpu()

    cpu, cuda = run("cpu"), run("cuda")
    assert (cpu != cuda).float().mean() < 0.02  # FMA and order may move a rare last bit
    assert ((cpu - cuda).abs() <= 2**-6 * cpu.abs()).all()


@pytest.mark.parametrize("preset", ["fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4"])
def test_moe_experts_in_each_recipe_on_cuda_track_the_cpu(preset):
    """A tiny Qwen3-MoE block's experts on CUDA (row-wise: all three GEMMs on torch's grouped
    kernel; block-wise: torch's kernel per expert, padded to 128-token tiles) against the same block on
    the CPU's emulation: the same recipe, other summation orders."""
    transformers = pytest.importorskip("transformers")
    from mixprec.precision import Policy

    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(
            "qwen3_moe", hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=128, num_experts=8,
            num_experts_per_tok=2)
        model = transformers.AutoModelForCausalLM.from_config(config).to(device)
        policy = Policy.from_preset(preset)
        policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        block = model.model.layers[0].mlp
        x = torch.randn(4, 300, 256, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
        with policy.autocast(device):
            out = block(x)
        out.float().square().sum().backward()
        results.append([t.detach().float().cpu() for t in (out, x.grad, block.experts.gate_up_proj.grad)])
    for cpu, cuda in zip(*results):
        assert float((cpu - cuda).norm() / cpu.norm()) < 2e-2


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp32", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4"])
def test_the_moe_flavor_trains_on_cuda_eager_and_compiled(tmp_path, text_file, preset):
    # CPU twins: tests/models/test_moe.py (every preset) and tests/train/test_compiled_presets.py (compiled)
    flags = (*CUDA, "--model.flavor", "moe-debug", "--precision.preset", preset, "--training.steps", "3",
             "--metrics.log_freq", "1", "--training.eval_interval", "0", "--stability.enable", "false")
    eager = run_train(tmp_path / "eager", text_file, *flags)
    compiled = run_train(tmp_path / "compiled", text_file, *flags, "--compile.enable")
    for e, c in zip(eager, compiled):
        assert math.isfinite(e["loss"]) and e["router_load"] >= 1.0
        assert abs(c["loss"] - e["loss"]) / e["loss"] < 1e-2
