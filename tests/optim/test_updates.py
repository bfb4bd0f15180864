import math

import pytest
import torch

from mixprec.optim.fused_adamw import unsupported
from mixprec.rounding import MIX, nearest_bf16, nearest_bf16_bits, random_bits16, rounding_key, stochastic_round_bf16
from mixprec.optim.updates import COMPENSATION, BF16Updates

BF16 = torch.bfloat16


def key(step: int) -> torch.Tensor:
    """The key of tensor 0 at `step`, as BF16Updates makes it."""
    return torch.tensor(rounding_key(0, 0, step, 0), dtype=torch.int32)


def sgd_on_tiny_updates(method: str | None, steps: int = 500, dtype=BF16, **kwargs):
    """lr 1, gradient -2^-10 each step on weights at 1: every update is 2^-10, under half a
    bfloat16 step at 1 (2^-8), so round-to-nearest drops it (1 + 2^-10 == 1)."""
    p = torch.nn.Parameter(torch.ones(4096, dtype=dtype))
    opt = torch.optim.SGD([p], lr=1.0, foreach=True)
    if method:
        BF16Updates(opt, method, seed=3, compile=False, **kwargs)
    for _ in range(steps):
        p.grad = torch.full_like(p, -2**-10)
        opt.step()
    return p, opt


def test_kahan_carries_the_updates_plain_bfloat16_drops():
    exact = 1 + 500 * 2**-10  # what float32 weights reach
    ref, _ = sgd_on_tiny_updates(None, dtype=torch.float32)
    assert ref.eq(exact).all()
    plain, _ = sgd_on_tiny_updates(None)
    assert plain.eq(1).all()  # stalled: not one update survived
    p, opt = sgd_on_tiny_updates("kahan")
    comp = opt.state[p][COMPENSATION]
    assert p.dtype == comp.dtype == BF16
    assert (p.float() + comp.float()).eq(ref).all()  # weight + compensation: the float32 weight, exactly
    assert p.float().eq(ref.to(BF16).float()).all()  # the weight: the float32 weight rounded to nearest


class SubclassedAdamW(torch.optim.AdamW):
    """Not torch.optim.AdamW itself: BF16Updates takes its generic path."""


def adamw_run(method: str | None, dtype, steps=300, cls=torch.optim.AdamW, **opt_kwargs):
    """Many small AdamW steps (lr 1e-4 on weights ~1) from the same gradients."""
    torch.manual_seed(0)
    w0 = (torch.randn(64, 48) + 1).to(BF16)  # the same starting weights
    p = torch.nn.Parameter(w0.to(dtype))
    opt = cls([p], lr=1e-4, weight_decay=0.1, **opt_kwargs)
    if method:
        BF16Updates(opt, method, seed=0, compile=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = (torch.randn(p.shape, generator=gen) + 0.5).to(BF16).to(dtype)  # the same bfloat16 gradients
        opt.step()
    return p.float(), opt


@pytest.mark.parametrize("cls, kernel", [
    (torch.optim.AdamW, {}),  # mixprec's fused kernel
    (SubclassedAdamW, {"foreach": True}), (SubclassedAdamW, {"fused": True}), (SubclassedAdamW, {"foreach": False}),
])
def test_kahan_adamw_tracks_float32_master_weights_where_bfloat16_stalls(cls, kernel):
    start = adamw_run(None, torch.float32, steps=0)[0]
    ref, _ = adamw_run(None, torch.float32, foreach=True)  # an FP32 master copy, stepped in FP32
    moved = (ref - start).abs().mean()
    plain, _ = adamw_run(None, BF16, **kernel)
    kahan, opt = adamw_run("kahan", BF16, cls=cls, **kernel)
    effective = kahan + opt.state[opt.param_groups[0]["params"][0]][COMPENSATION].float()
    assert (plain - ref).abs().mean() > moved / 2  # plain bfloat16 lost most of the movement
    # Kahan keeps it: the weight + compensation follows the FP32 weight (the moments are
    # bfloat16, so not exactly), and the weight is that value rounded to nearest
    assert (effective - ref).abs().mean() < moved / 50  # measured: 0.4% of the movement
    up, down = (torch.nextafter(kahan.to(BF16), torch.tensor(v, dtype=BF16)).float() for v in (torch.inf, -torch.inf))
    assert ((effective - kahan).abs() <= torch.maximum(up - kahan, kahan - down) / 2).all()
    assert {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"} == {BF16}


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_the_fused_adamw_kernel_computes_torch_adamws_update(method):
    fused, opt = adamw_run(method, BF16, steps=50)
    generic, generic_opt = adamw_run(method, BF16, steps=50, cls=SubclassedAdamW, foreach=True)
    assert unsupported(opt) is None and unsupported(generic_opt) == "SubclassedAdamW is not torch.optim.AdamW"
    # the same arithmetic up to FMA and order: weights equal but for a rare last-bit rounding
    assert (fused != generic).float().mean() < 0.01
    assert ((fused - generic).abs() <= 2**-7 * fused.abs()).all()
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = (o.state[o.param_groups[0]["params"][0]][key].float() for o in (opt, generic_opt))
        assert torch.allclose(a, b, rtol=2**-7, atol=1e-12)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    torch.manual_seed(0)
    x = torch.randn(2000) * torch.logspace(-3, 3, 2000)
    nearest = x.to(BF16)
    toward_minus_inf = torch.where(nearest.float() <= x, nearest, torch.nextafter(nearest, torch.tensor(-torch.inf, dtype=BF16)))
    low = toward_minus_inf.float()
    high = torch.nextafter(toward_minus_inf, torch.tensor(torch.inf, dtype=BF16)).float()
    draws = torch.stack([stochastic_round_bf16(x, key(k)).float() for k in range(400)])
    assert ((draws == low) | (draws == high)).all()
    # P(up) = (x - low) / (high - low): each element's mean over 400 draws is x within
    # 5 standard errors, and the errors average out across elements
    p_up = (x - low) / (high - low)
    stderr = (high - low) * (p_up * (1 - p_up) / 400).sqrt()
    exact = p_up == 0
    assert (draws[:, exact] == x[exact]).all()
    z = (draws.mean(0) - x)[~exact] / stderr[~exact]
    assert z.abs().max() < 5 and abs(z.mean()) < 5 / math.sqrt(len(z))
    assert (draws.mean(0) - x).abs().mean() < (nearest.float() - x).abs().mean() / 4  # nearest's bias is larger


def test_stochastic_rounding_keeps_non_finite_values_and_exact_ones():
    x = torch.tensor([math.nan, math.inf, -math.inf, 1.0, -2.5, 0.0, -0.0])
    out = stochastic_round_bf16(x, key(7)).float()
    assert out[0].isnan() and out[1] == math.inf and out[2] == -math.inf
    assert out[3:].tolist() == [1.0, -2.5, 0.0, -0.0]


def test_stochastic_updates_carry_small_updates_on_average_and_reproduce_with_a_seed():
    p, _ = sgd_on_tiny_updates("stochastic", steps=300)
    exact = 1 + 300 * 2**-10
    # each weight is a random walk on the bfloat16 grid whose mean is the exact value
    assert abs(p.float().mean().item() - exact) < 0.01
    assert p.float().std() > 0  # the weights took different roundings
    again, _ = sgd_on_tiny_updates("stochastic", steps=300)
    assert torch.equal(p, again)
    q = torch.nn.Parameter(torch.ones(4096, dtype=BF16))
    opt = torch.optim.SGD([q], lr=1.0)
    BF16Updates(opt, "stochastic", seed=4, compile=False)
    for _ in range(300):
        q.grad = torch.full_like(q, -2**-10)
        opt.step()
    assert not torch.equal(p, q)


def test_stochastic_rounding_directions_are_independent_across_elements():
    # 2^20 copies of one value 0.3 of a bfloat16 step above 1: each rounds up with P = 0.3;
    # neighbours' directions, and those of elements 2^16 apart, must be uncorrelated (the
    # standard error of these correlations is 2^-10; a Weyl sequence of 16-bit keys gave
    # -0.43 at offset 1 and exactly 1 at 2^16)
    n = 1 << 20
    up = (stochastic_round_bf16(torch.full((n,), 1 + 0.3 * 2**-7), key(3)).float() > 1).float()
    assert abs(up.mean().item() - 0.3) < 5 * math.sqrt(0.21 / n)
    d = up - up.mean()
    for offset in (1, 2, 3, 256, 1 << 16, (1 << 16) + 1):
        corr = (d[:-offset] * d[offset:]).mean() / d.var()
        assert abs(corr) < 0.006, (offset, corr)


def test_random_bits_equal_the_hash_computed_without_overflow():
    # the int32 hash wraps its products modulo 2^32; in int64 with masks no product passes
    # 2^63 (x < 2^32, multipliers < 2^31): the same bits, eager and compiled
    compiled = torch.compile(random_bits16, dynamic=True)
    for k in (0, -1, rounding_key(0, 0, 5, 2), rounding_key(1, 0, 5, 2)):
        h = torch.arange(70_000, dtype=torch.int64) ^ (k & 0xFFFFFFFF)
        h = ((h ^ (h >> 16)) * MIX[0]) & 0xFFFFFFFF
        h = ((h ^ (h >> 15)) * MIX[1]) & 0xFFFFFFFF
        expected = (h >> 16).to(torch.int32)
        k32 = torch.tensor(k, dtype=torch.int32)
        assert torch.equal(random_bits16(70_000, k32, "cpu"), expected)
        assert torch.equal(compiled(70_000, k32, "cpu"), expected)


def test_compiled_rounding_gives_the_eager_bits():
    fn = torch.compile(stochastic_round_bf16, dynamic=True)
    x = torch.randn(3, 1000) * 50
    for k in (0, 12345, 2**31 - 1):
        assert torch.equal(fn(x, key(k)).view(torch.int16), stochastic_round_bf16(x, key(k)).view(torch.int16))


def every_float32_of_binades(*exponents: int) -> torch.Tensor:
    mantissas = torch.arange(1 << 23, dtype=torch.int32)
    bits = torch.cat([(e << 23) | mantissas for e in exponents])
    x = bits.view(torch.float32)
    return torch.cat([x, -x])


def test_nearest_rounding_is_torchs_cast_eager_and_compiled():
    # every float32 in [2^-126, 2^-125), [1, 2) and [2^100, 2^101), both signs: ties to even included
    x = every_float32_of_binades(1, 127, 227)
    assert torch.equal(nearest_bf16(x), x.to(BF16).float())
    # the bits form, which non-CPU devices run (tests/test_gpu.py runs it on CUDA)
    assert torch.equal(nearest_bf16_bits(x), x.to(BF16).float())
    y = torch.randn(1 << 16) * 1e3
    assert torch.equal(torch.compile(nearest_bf16, dynamic=True)(y), y.to(BF16).float())
    # the documented range: a subnormal within one bfloat16 subnormal step; beyond 2^112 NaN
    tiny = torch.tensor([1e-39, -3e-40])
    assert torch.all((nearest_bf16(tiny) - tiny.to(BF16).float()).abs() <= 2.0**-133)
    assert torch.isnan(nearest_bf16(torch.tensor([2.0**113]))).all()


def test_kahan_runs_eagerly_where_compiled_code_may_fuse_the_rounding(caplog):
    # Veltkamp's split needs unfused FP32 operations: with contraction on, the kernel is
    # not compiled (logged; an explicit compile=True is refused) and the result stays exact
    from torch._inductor import config

    with config.patch({"cpp.enable_floating_point_contract_flag": "fast"}):
        p = torch.nn.Parameter(torch.ones(64, dtype=BF16))
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0)
        updates = BF16Updates(opt, "kahan")
        p.grad = -torch.ones_like(p)
        opt.step()
        assert "runs eagerly" in caplog.text and "ffp-contract=fast" in caplog.text
        assert all(k is v for (k, *_), v in updates._kernels.items())  # the plain function, not a compiled one
        assert opt.state[p][COMPENSATION].abs().min() > 0
        q = torch.nn.Parameter(torch.ones(4, dtype=BF16))
        strict = torch.optim.AdamW([q], lr=1e-4)
        BF16Updates(strict, "kahan", compile=True)
        q.grad = torch.ones_like(q)
        with pytest.raises(RuntimeError, match="ffp-contract=fast"):
            strict.step()


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_compiled_kahan_keeps_the_compensation_in_every_dtype(dtype):
    # bfloat16 is rounded by nearest_bf16; float16 by a cast, compiled with emulate_precision_casts
    p = torch.nn.Parameter(torch.ones(4096, dtype=dtype))
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0)
    BF16Updates(opt, "kahan", compile=True)
    for _ in range(3):
        p.grad = -torch.ones_like(p)
        opt.step()
    w = p.float() + opt.state[p][COMPENSATION].float()
    assert torch.equal(p, torch.ones_like(p))  # 3e-4 is under half a step at 1 in both dtypes
    assert torch.allclose(w, torch.full_like(w, 1 + 3e-4), rtol=0, atol=2e-6)


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_compiled_fused_adamw_gives_the_eager_bits(method):
    # Inductor keeps a bfloat16 round trip in FP32 unless told to round: the compensation
    # w - bf16(w) was 0 when compiled, and bf16-kahan trained as bf16-true
    eager = model_and_opt(method)
    compiled = model_and_opt(method, compile=True)
    train(*eager, 3)
    train(*compiled, 3)
    for a, b in zip(eager[0].parameters(), compiled[0].parameters()):
        assert torch.equal(a, b)
        # states: the same up to FMA and order (a last-bit difference in a moment or compensation)
        assert all(torch.allclose(x.float(), y.float(), rtol=2**-7, atol=1e-9)
                   for x, y in zip(eager[1].state[a].values(), compiled[1].state[b].values()))
    if method == "kahan":
        assert all(s[COMPENSATION].abs().sum() > 0 for s in compiled[1].state.values())


def model_and_opt(method, chunk_numel=2**26, cls=torch.optim.AdamW, compile=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(BF16)
    opt = cls(model.parameters(), lr=1e-2, foreach=True)
    updates = BF16Updates(opt, method, seed=1, compile=compile, chunk_numel=chunk_numel)
    return model, opt, updates


def train(model, opt, updates, steps, start=0):
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g).to(BF16), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        updates.step()
        opt.zero_grad()


@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_chunked_steps_equal_one_step(method):
    # the generic path (Adam); keys depend on the step and the parameter, not the chunk
    one = model_and_opt(method, cls=torch.optim.Adam)
    chunked = model_and_opt(method, chunk_numel=40, cls=torch.optim.Adam)  # 512 + 32 + 128 + 4: four chunks
    train(*one, 5)
    train(*chunked, 5)
    for a, b in zip(one[0].parameters(), chunked[0].parameters()):
        assert a.dtype == BF16 and torch.equal(a, b)
        assert all(torch.equal(x, y) for x, y in zip(one[1].state[a].values(), chunked[1].state[b].values()))
    assert one[2].steps == chunked[2].steps == 5
    assert all(len(g["params"]) == len(h["params"]) for g, h in zip(one[1].param_groups, chunked[1].param_groups))


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])  # the fused and the generic path
@pytest.mark.parametrize("method", ["kahan", "stochastic"])
def test_state_dicts_resume_bit_for_bit(method, cls):
    full = model_and_opt(method, cls=cls)
    train(*full, 6)
    cut = model_and_opt(method, cls=cls)
    train(*cut, 3)
    saved = ({k: v.clone() for k, v in cut[0].state_dict().items()}, cut[1].state_dict(), cut[2].state_dict())
    resumed = model_and_opt(method, cls=cls)
    resumed[0].load_state_dict(saved[0])
    resumed[1].load_state_dict(saved[1])
    resumed[2].load_state_dict(saved[2])
    if method == "kahan":
        assert all(s[COMPENSATION].dtype == BF16 and s[COMPENSATION].abs().sum() > 0 for s in resumed[1].state.values())
    train(*resumed, 3, start=3)
    for a, b in zip(full[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)


def test_bad_arguments_say_what_is_accepted():
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="accepted kahan, stochastic"):
        BF16Updates(torch.optim.SGD([p], lr=1), "nearest")
    with pytest.raises(ValueError, match="stochastic rounding is to bfloat16"):
        BF16Updates(torch.optim.SGD([p], lr=1), "stochastic")


# ---- through the policy -------------------------------------------------------------------
def test_policy_presets_in_a_users_loop():
    import mixprec

    for preset, method in (("bf16-kahan", "kahan"), ("bf16-sr", "stochastic")):
        policy = mixprec.Policy.from_preset(preset, update_seed=5)
        model = mixprec.build_model(mixprec.model_args("debug", vocab_size=256), device="cpu",
                                    storage_dtype=policy.storage_dtype, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        model, optimizer = policy.setup(model, optimizer)
        for step in range(3):
            x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(step))
            with policy.autocast():
                loss = model(x[:, :-1], x[:, 1:])
            policy.backward(loss)
            assert policy.step(optimizer, max_norm=1.0)
        assert {p.dtype for p in model.parameters()} == {BF16}
        assert policy.describe()["weight updates"].startswith({"kahan": "Kahan", "stochastic": "stochastically"}[method])
        assert policy.state_dict()["updates"] == {"method": method, "seed": 5, "steps": 3}
        assert all((COMPENSATION in s) == (method == "kahan") for s in optimizer.state.values())


def test_policy_refuses_updates_where_they_mean_nothing():
    from mixprec import Policy, UserError

    assert Policy(param_dtype=BF16, storage_dtype=BF16, update="kahan").name == "bf16-kahan"
    with pytest.raises(UserError, match="need a low-precision model without master weights.*accepted: bf16-kahan"):
        Policy(param_dtype=BF16, storage_dtype=torch.float32, update="kahan")
    with pytest.raises(UserError, match="need a bfloat16 model"):
        Policy(param_dtype=torch.float16, storage_dtype=torch.float16, update="stochastic")
    with pytest.raises(ValueError, match="pass it to Policy.setup"):
        Policy.from_preset("bf16-sr").setup(torch.nn.Linear(2, 2))
