"""mixprec.audit on a model mixprec did not build: a GPT-2-like module written here
(LayerNorm, fused QKV, PyTorch's SDPA, GELU MLP, an output head), in a user's own loop."""

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mixprec

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from any_model import measured_peak  # noqa: E402

VOCAB, DIM = 64, 32
PRESET_NAMES = ["fp32", "bf16-mixed", "bf16-true", "bf16-kahan", "bf16-sr", "fp16-mixed", "fp16-master", "bf16-master",
                "fp16-true", "fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, DIM // 2).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(16, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x, y):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.ln_f(h)).float().flatten(0, 1), y.flatten())


def batches(n=2):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (4, 17), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def setup(preset):
    torch.manual_seed(0)
    policy = mixprec.Policy.from_preset(preset)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = policy.setup(model, optimizer)
    return policy, model, optimizer


@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "bf16-kahan", "fp8-tensorwise"])
def test_the_audit_passes_a_users_own_model(preset):
    policy, model, optimizer = setup(preset)
    report = mixprec.audit(model, policy, optimizer, batches())
    stages = {r["stage"]: r["observed"] for r in report["stages"]}
    bad = {r["stage"] for r in report["stages"] if not r["ok"]}
    if policy.storage_dtype == torch.bfloat16:
        # bf16-true and bf16-kahan keep every weight in bfloat16: nn.LayerNorm then computes
        # in bfloat16 (mixprec's own RMSNorm upcasts), and the audit says so
        assert bad == {"norm"} and stages["norm"] == ["bfloat16"], mixprec.format_audit(report)
    else:
        assert report["ok"] and stages["norm"] == ["float32"], mixprec.format_audit(report)  # autocast upcasts
    linears = stages["Linear layers by compute (per module)"]
    if preset == "fp8-tensorwise":  # the head is the output projection: left out, whatever its name
        assert linears == ["1 bfloat16", "8 float8 tensorwise"]
    else:
        assert sum(int(n.split()[0]) for n in linears) == 9


def test_the_audit_fails_a_users_model_that_leaves_autocast():
    policy, model, optimizer = setup("bf16-mixed")
    inner = model.blocks[1].fc.forward

    def fp32_fc(x):  # a layer that quietly computes in float32 under bf16-mixed
        with torch.autocast("cpu", enabled=False):
            return inner(x.float())

    model.blocks[1].fc.forward = fp32_fc
    report = mixprec.audit(model, policy, optimizer, batches())
    assert not report["ok"]
    bad = {r["stage"] for r in report["stages"] if not r["ok"]}
    assert "compute parameters (matmul operands)" in bad
    assert any("blocks.1.fc" in note and "float32" in note for note in report["notes"])


def test_the_audit_needs_two_micro_batches():
    policy, model, optimizer = setup("bf16-mixed")
    with pytest.raises(ValueError, match="two or more micro-batches"):
        mixprec.audit(model, policy, optimizer, batches(1))


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=DIM, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-tensorwise"])
def test_a_transformers_gpt2_is_audited_and_its_conv1d_layers_are_named(preset, caplog):
    model = tiny_gpt2()
    policy = mixprec.Policy.from_preset(preset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level("INFO", logger="mixprec"):
        model, optimizer = policy.setup(model, optimizer)
    hf_batches = [{"input_ids": x, "labels": x} for x, _ in batches()]
    report = mixprec.audit(model, policy, optimizer, hf_batches)
    assert report["ok"], mixprec.format_audit(report)
    rows = dict(policy.layout.left_out())
    if preset == "fp8-tensorwise":  # GPT-2's projections are Conv1D, its head is tied to the embedding
        assert rows["transformer.h.0.attn.c_attn"].startswith("a Conv1D, not an nn.Linear")
        assert "lm_head" in rows and "output projection" in rows["lm_head"]
        assert "transformer.h.1.mlp.c_proj stays in bfloat16: a Conv1D, not an nn.Linear" in caplog.text
    else:
        assert rows == {}


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


# one preset of each memory layout (weights, gradients, masters, moments, compensation,
# loss scaler, FP8 casts): the transformers architectures take these 8, the own model all 13
LAYOUTS = ["fp32", "bf16-mixed", "bf16-true", "bf16-kahan", "fp16-mixed", "fp16-master", "fp8-rowwise", "fp8-blockwise"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["own", "gpt2", "llama", "qwen2"])
def test_planned_memory_of_a_users_model_within_2_percent_of_measured(arch):
    for preset in PRESET_NAMES if arch == "own" else LAYOUTS:
        planned_within_2_percent(arch, preset)


def planned_within_2_percent(arch, preset):
    build = {"own": TinyGPT, "gpt2": tiny_gpt2, "llama": tiny_llama, "qwen2": tiny_qwen2}[arch]
    x, y = batches(1)[0]
    batch = (x, y) if arch == "own" else {"input_ids": x, "labels": x}
    planned = mixprec.plan_memory(build, preset, batch)
    measured = measured_peak(build, preset, batch)
    assert abs(planned["peak_bytes"] / measured - 1) < 0.02, (preset, planned, measured)  # measured: 0.1% or better
    assert planned["by_kind"]["param"] > 0 and planned["by_kind"]["act"] > 0


def test_a_nan_in_a_transformers_decoder_module_is_located_and_costs_only_its_batch():
    from mixprec.stability import StabilityConfig, StabilityGuard
    from mixprec.stability.drills import _poison

    module = "model.layers.1.mlp.down_proj"
    torch.manual_seed(0)
    policy = mixprec.Policy.from_preset("bf16-mixed")
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = policy.setup(model, optimizer)
    guard = StabilityGuard.for_loop(model, optimizer, policy=policy,
                                    config=StabilityConfig(window=8, snapshot_interval=4))
    gen, step, poisoned = torch.Generator().manual_seed(0), 0, False
    while step < 10:
        x = torch.randint(0, VOCAB, (2, 17), generator=gen)
        handle = None
        if step + 1 == 7 and not poisoned:
            poisoned, handle = True, model.get_submodule(module).register_forward_hook(_poison)

        def forward():
            with policy.autocast():
                return model(input_ids=x, labels=x).loss

        loss = forward()
        policy.backward(loss)
        result = policy.step(optimizer, max_norm=1.0)
        step = guard.after_step(step + 1, loss.item(), result, rerun=[(forward, policy.backward)])
        if handle is not None:
            handle.remove()
    (incident,) = guard.incidents
    assert incident["finding"]["module"] == module and incident["finding"]["phase"] == "forward"
    # the step was skipped and nothing non-finite reached the state: no rewind (it used to go back to step 4)
    assert "rewound_to" not in incident and guard.rewinds == 0 and incident["action"].startswith("skipped")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def tiny_qwen2():
    # the third architecture: Qwen2's attention projections carry biases (an FP8 Linear adds
    # its bias after the scaled GEMM), beside RMSNorm, SwiGLU and grouped-query attention
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config)


ARCHITECTURES = {"own": TinyGPT, "gpt2": tiny_gpt2, "llama": tiny_llama, "qwen2": tiny_qwen2}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_preset_trains_a_users_model_within_1_percent_of_fp32(arch):
    from mixprec.precision.presets import PRESETS

    data = batches(8)

    def train(preset, eps=1e-8):
        torch.manual_seed(0)
        policy = mixprec.Policy.from_preset(preset)
        model = ARCHITECTURES[arch]()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=eps)
        model, optimizer = policy.setup(model, optimizer)
        losses = []
        for x, y in data:
            with policy.autocast():
                loss = model(x, y) if arch == "own" else model(input_ids=x, labels=x).loss
            policy.backward(loss)
            policy.step(optimizer, max_norm=1.0)
            losses.append(loss.item())
        return sum(losses[-3:]) / 3

    reference = train("fp32")
    for preset in PRESETS:
        if preset == "bf16-mixed-8bit":  # bf16-kahan-8bit steps the same 8-bit kernels (and compensates): the time
            continue
        if preset == "fp16-true":
            # float16 weights and AdamW moments without loss scaling, which the policy warns about
            # at setup: squared gradients flush to zero in the second moment (and eps 1e-8 is 0 in
            # float16: 1e-4 here). Measured 3% to 12% behind fp32 after 8 steps on these four
            # models: finite, and behind, as warned.
            final = train(preset, eps=1e-4)
            assert math.isfinite(final) and final >= train("fp32", eps=1e-4)
            continue
        final = train(preset)
        assert math.isfinite(final) and abs(final / reference - 1) < 0.01, (preset, final, reference)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed", "fp8-rowwise"])
def test_the_audit_passes_transformers_llama_and_qwen2(arch, preset):
    torch.manual_seed(0)
    policy = mixprec.Policy.from_preset(preset)
    model = ARCHITECTURES[arch]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = policy.setup(model, optimizer)
    report = mixprec.audit(model, policy, optimizer, [{"input_ids": x, "labels": x} for x, _ in batches()])
    assert report["ok"], mixprec.format_audit(report)
    if preset == "fp8-rowwise":  # the 14 block projections in FP8; lm_head, the output projection, left out
        assert {r["stage"]: r["observed"] for r in report["stages"]}["Linear layers by compute (per module)"] == [
            "1 bfloat16", "14 float8 rowwise"]


@pytest.mark.parametrize("arch", ["own", "gpt2", "llama", "qwen2"])
def test_every_preset_passes_the_audit_on_every_architecture(arch):
    for preset in PRESET_NAMES:
        torch.manual_seed(0)
        policy = mixprec.Policy.from_preset(preset)
        model = ARCHITECTURES[arch]()
        # setup puts mixprec's AdamW in place where the mode keeps other moments (fp8-blockwise's bfloat16)
        model, optimizer = policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        data = batches() if arch == "own" else [{"input_ids": x, "labels": x} for x, _ in batches()]
        report = mixprec.audit(model, policy, optimizer, data)
        bad = {r["stage"] for r in report["stages"] if not r["ok"]}
        if arch in ("own", "gpt2") and policy.storage_dtype != torch.float32:
            # bfloat16/float16 weights: nn.LayerNorm computes in them (RMSNorm upcasts), as flagged
            assert bad == {"norm"}, (preset, mixprec.format_audit(report))
        else:
            assert not bad, (preset, mixprec.format_audit(report))
