"""Each FP8 recipe's three GEMMs (forward, input gradient, weight gradient) at a flavor's
layer shapes: torch's kernel against mixprec's emulation (relative error and SQNR, on the
same FP8 operands), the emulation against a float64 GEMM of the dequantised operands, and
TFLOP/s of the kernel and of the BF16 GEMM of the same shape.

The operands are cast as the FP8 Linear casts them (mixprec.narrow.linear.fp8), from random
activations, weights and output gradients. For block-wise scales it also tries the four
(a, b) scale-stride layouts on the kernel and reports which ones torch accepts and agree
with the emulation: the layout mixprec passes must be one of them.

The microscaled recipes' emulated GEMMs (--mx-recipes) are timed the same way: on CUDA the
route training takes (operands dequantised to bfloat16, a bfloat16 GEMM with an FP32 output)
and the FP32 route, against the BF16 GEMM of the same shape, with each route's error against
float64. --layers times one Linear's whole step, forward and backward with its casts, compiled,
per FP8 recipe against the bfloat16 Linear under autocast: under torch.compile the transposed
FP8 copies the weight-gradient GEMM reads are written by the cast kernels themselves (no
separate byte transpose), so this is the figure the training step sees.

    python benchmarks/fp8_gemm_probe.py --device cuda --flavors 1B,8B [--tokens 8192]
    python benchmarks/fp8_gemm_probe.py --device cuda --flavors 1B --recipes "" --layers --mx-recipes mxfp8,nvfp4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mixprec.narrow import E4M3, RECIPES, convert_to_fp8, emulated_mm, kernel_mm, quantize, sqnr
from mixprec.narrow.gemm.fp8 import layout
from mixprec.narrow.formats.mx import _key, gemm_route
from mixprec.narrow.gemm.mx import mx_mm
from mixprec.models.llama import FLAVORS, ModelArgs


def layer_shapes(flavor: str) -> dict[str, tuple[int, int]]:
    """Linear name -> (in_features K, out_features N) of one transformer block."""
    args = ModelArgs(**{k: v for k, v in FLAVORS[flavor].items() if k in ModelArgs.__dataclass_fields__})
    kv = args.dim // args.n_heads * (args.n_kv_heads or args.n_heads)
    return {"wq": (args.dim, args.dim), "wk": (args.dim, kv), "w1": (args.dim, args.ffn_dim), "w2": (args.ffn_dim, args.dim)}


def operands(recipe, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """(name, a, b, out dtype) of the three GEMMs, cast as _FP8Matmul casts them."""
    t, pow2 = recipe.tiles, recipe.power_of_2_scales
    xq, _ = quantize(x, E4M3, t.x, power_of_2=pow2)
    wq, _ = quantize(w, E4M3, t.w, power_of_2=pow2)
    gq, _ = quantize(dy, recipe.grad_dtype, t.g, power_of_2=pow2)
    wq_d = quantize(w, E4M3, t.w_dgrad, power_of_2=pow2)[0] if t.w_dgrad else wq
    gq_w = quantize(dy, recipe.grad_dtype, t.g_wgrad, power_of_2=pow2)[0] if t.g_wgrad else gq
    xq_w = quantize(xq.dequantize(), E4M3, t.x_wgrad, power_of_2=pow2)[0] if t.x_wgrad else xq
    return (("forward", xq, wq.t(), torch.bfloat16), ("input gradient", gq, wq_d, torch.bfloat16),
            ("weight gradient", gq_w.t(), xq_w, torch.float32))


def mx_operands(recipe, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """(name, a, b, out dtype) of a microscaled Linear's three GEMMs, a @ b^T, cast as _MXMatmul
    casts them (without the Hadamard transform: it changes no GEMM's cost)."""
    key = _key(dy, 0, 0)
    wq = recipe.quantize(w, square=recipe.weight_2d)
    wq_t = wq.t() if recipe.weight_2d else recipe.quantize(w.t())
    return (("forward", recipe.quantize(x), wq, torch.bfloat16),
            ("input gradient", recipe.quantize(dy, gradient=True, key=key), wq_t, torch.bfloat16),
            ("weight gradient", recipe.quantize(dy.t(), gradient=True, key=key), recipe.quantize(x.t()),
             torch.float32))


def mx_rows(flavor: str, layer: str, name: str, x, w, dy, timed: bool) -> list[dict]:
    recipe, rows = RECIPES[name], []
    for gemm, a, b, out_dtype in mx_operands(recipe, x, w, dy):
        (m_, k_), n_ = a.shape, b.shape[0]
        ref = a.dequantize().double() @ b.dequantize().double().t()
        got = mx_mm(a, b, torch.float32).double()
        row = {"flavor": flavor, "layer": layer, "recipe": name, "gemm": gemm, "shape": [m_, k_, n_],
               "route": "bfloat16" if gemm_route(x.device.type) is None else "float32",
               "emulation_vs_f64": float((got - ref).norm() / ref.norm())}
        if timed:
            flops = 2 * m_ * k_ * n_
            fp32 = lambda: (a.dequantize(False) @ b.dequantize(False).t()).to(out_dtype)  # noqa: E731
            a16, b16 = a.dequantize().bfloat16(), b.dequantize().bfloat16().t()
            for key, fn in (("emulated", lambda: mx_mm(a, b, out_dtype)), ("fp32_route", fp32),
                            ("bf16", lambda: a16 @ b16)):
                row[f"{key}_tflops"] = flops / median_ms(fn) / 1e9
        rows.append(row)
        tf = lambda key: format(row[key], ".0f") if key in row else "-"  # noqa: E731
        ratio = f"{row['emulated_tflops'] / row['bf16_tflops']:.2f}" if timed else "-"
        print(f"{flavor:<6}{layer:<6}{name:<11}{gemm:<16}{'route ' + row['route']:<22}{'-':>10}{'-':>9}"
              f"{row['emulation_vs_f64']:>10.1e}{tf('emulated_tflops'):>10}{tf('bf16_tflops'):>10}{ratio:>7}", flush=True)
        if timed:
            print(f"    the FP32 route: {row['fp32_route_tflops']:.0f} TFLOP/s")
    return rows


def layer_rows(flavor: str, layer: str, k: int, n: int, tokens: int, recipes, dev) -> list[dict]:
    """One Linear's compiled forward and backward, casts included: each recipe against bfloat16."""
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, k, device=dev, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(tokens, n, device=dev, generator=gen).bfloat16() * 1e-3

    def step_ms(module, autocast: bool) -> float:
        torch._dynamo.reset()  # each layer compiled afresh: no recompile limit across the probe's many modules
        fn = torch.compile(module)

        def step():
            x.grad = None
            with torch.autocast(dev.type, torch.bfloat16, enabled=autocast):
                out = fn(x)
            out.backward(dy)
        return median_ms(step)

    def linear():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=dev))

    flops = 3 * 2 * tokens * k * n
    base = step_ms(linear(), True)
    rows = [{"flavor": flavor, "layer": layer, "recipe": "bf16-mixed", "step_tflops": flops / base / 1e9}]
    for name in recipes:
        model = linear()
        convert_to_fp8(model, RECIPES[name], compute_dtype=torch.bfloat16, modules=["0"])
        ms = step_ms(model, True)
        rows.append({"flavor": flavor, "layer": layer, "recipe": name, "step_tflops": flops / ms / 1e9,
                     "vs_bf16": base / ms})
    print(f"{flavor} {layer} ({k} -> {n}), one Linear's compiled forward + backward, TFLOP/s: "
          + ", ".join(f"{r['recipe']} {r['step_tflops']:.0f}" + (f" ({r['vs_bf16']:.2f}x)" if "vs_bf16" in r else "")
                      for r in rows), flush=True)
    return rows


def median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    if not torch.cuda.is_available():  # the CPU: wall time (the code path's check, not a figure)
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def stride_study(a, b, out_dtype) -> list[str]:
    """Which (a scale, b scale) memory orders torch's block-wise kernel accepts and gets right:
    row- or column-major, of the scales as the operand holds them or transposed (T)."""
    import torch.nn.functional as F

    from mixprec.narrow.gemm.fp8 import kernel_scales

    types = kernel_scales(a, b, blockwise=True)[2]
    want = emulated_mm(a, b, torch.float32)
    orders = {"row": lambda s: s.float().contiguous(), "col": lambda s: s.float().t().contiguous().t(),
              "T row": lambda s: s.float().t().contiguous(), "T col": lambda s: s.float().contiguous().t()}
    found = []
    for oa, fa in orders.items():
        for ob, fb in orders.items():
            try:
                got = F.scaled_mm(a.data.contiguous(), b.data.t().contiguous().t(), fa(a.scale_inv),
                                  types[0], fb(b.scale_inv), types[1],
                                  output_dtype=out_dtype).float()
            except Exception:  # noqa: BLE001
                found.append(f"a {oa}/b {ob}: refused")
                continue
            err = float((got - want).norm() / want.norm())
            found.append(f"a {oa}/b {ob}: accepted, rel err {err:.2e}")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--flavors", default="1B,8B")
    p.add_argument("--tokens", type=int, default=8192, help="M: sequences x tokens per step (4 x 2048)")
    p.add_argument("--recipes", default="tensorwise,rowwise,blockwise")
    p.add_argument("--mx-recipes", default="", help="microscaled recipes to time, e.g. mxfp8,nvfp4,mxfp4")
    p.add_argument("--layers", action="store_true", help="also time one compiled Linear per FP8 recipe")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    dev = torch.device(args.device)
    timed = dev.type == "cuda"
    rows = []
    print(f"device {torch.cuda.get_device_name(dev) if timed else 'cpu'}, torch {torch.__version__}, M = {args.tokens}")
    print(f"{'flavor':<6}{'layer':<6}{'recipe':<11}{'gemm':<16}{'layout':<22}{'kern/emu':>10}{'SQNR dB':>9}"
          f"{'emu/f64':>10}{'kern TF/s':>10}{'bf16 TF/s':>10}{'ratio':>7}")
    for flavor in args.flavors.split(","):
        for layer, (k, n) in layer_shapes(flavor).items():
            gen = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(args.tokens, k, device=dev, generator=gen)
            w = torch.randn(n, k, device=dev, generator=gen) * k ** -0.5
            dy = torch.randn(args.tokens, n, device=dev, generator=gen) * 1e-3
            for name in filter(None, args.mx_recipes.split(",")):
                rows += mx_rows(flavor, layer, name, x, w, dy, timed)
            if args.layers:  # timed on CUDA; elsewhere the same code, its figures meaningless
                rows += layer_rows(flavor, layer, k, n, args.tokens, list(filter(None, args.recipes.split(","))), dev)
            for name in filter(None, args.recipes.split(",")):
                recipe = RECIPES[name]
                for gemm, a, b, out_dtype in operands(recipe, x, w, dy):
                    m_, k_, n_ = a.data.shape[0], a.data.shape[1], b.data.shape[1]
                    flops = 2 * m_ * k_ * n_
                    emu = emulated_mm(a, b, torch.float32)
                    ref = a.dequantize().double() @ b.dequantize().double()
                    row = {"flavor": flavor, "layer": layer, "recipe": name, "gemm": gemm,
                           "shape": [m_, k_, n_], "layout": f"{layout(a, 'a')} x {layout(b, 'b')}",
                           "emulation_vs_f64": float((emu.double() - ref).norm() / ref.norm())}
                    if "blockwise" in row["layout"] and timed:
                        row["stride_study"] = stride_study(a, b, out_dtype)
                    try:
                        got = kernel_mm(a, b, out_dtype).float()
                        row["kernel_vs_emulation"] = float((got - emu).norm() / emu.norm())
                        row["sqnr_db"] = sqnr(emu, got)
                        row["kernel_vs_f64"] = float((got.double() - ref).norm() / ref.norm())
                    except Exception as e:  # noqa: BLE001
                        row["kernel_error"] = str(e).splitlines()[0][:200]
                    if timed and "kernel_error" not in row:
                        row["kernel_ms"] = median_ms(lambda: kernel_mm(a, b, out_dtype))
                        a16, b16 = a.dequantize().bfloat16(), b.dequantize().bfloat16()
                        row["bf16_ms"] = median_ms(lambda: a16 @ b16)
                        row["kernel_tflops"] = flops / row["kernel_ms"] / 1e9
                        row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
                        # the same GEMM on operands already in the kernel's layout (a row-, b column-major):
                        # how much of kernel_ms is the layout copies kernel_mm makes
                        ap = a._replace(data=a.data.contiguous())
                        bp = b._replace(data=b.data.t().contiguous().t())
                        row["prepared_tflops"] = flops / median_ms(lambda: kernel_mm(ap, bp, out_dtype)) / 1e9
                        if out_dtype == torch.float32:  # and how much is writing FP32
                            ms = median_ms(lambda: kernel_mm(ap, bp, torch.bfloat16))
                            row["prepared_bf16_out_tflops"] = flops / ms / 1e9

                    rows.append(row)
                    fmt = lambda key, f: format(row[key], f) if key in row else "-"  # noqa: E731
                    ratio = (f"{row['bf16_ms'] / row['kernel_ms']:.2f}" if "kernel_ms" in row else "-")
                    print(f"{flavor:<6}{layer:<6}{name:<11}{gemm:<16}{row['layout']:<22}"
                          f"{fmt('kernel_vs_emulation', '.1e'):>10}{fmt('sqnr_db', '.1f'):>9}"
                          f"{row['emulation_vs_f64']:>10.1e}{fmt('kernel_tflops', '.0f'):>10}"
                          f"{fmt('bf16_tflops', '.0f'):>10}{ratio:>7}", flush=True)
                    if "kernel_error" in row:
                        print("    kernel refused:", row["kernel_error"])
                    if "prepared_tflops" in row:
                        extra = (f", writing bfloat16 {row['prepared_bf16_out_tflops']:.0f}"
                                 if "prepared_bf16_out_tflops" in row else "")
                        print(f"    operands already in the kernel's layout: {row['prepared_tflops']:.0f} TFLOP/s{extra}")
                    accepted = [line for line in row.get("stride_study", []) if "accepted" in line]
                    if "stride_study" in row:
                        print("    scale orders torch accepts:", "; ".join(accepted) or "none")
        if args.json:  # after each flavor: a run cut by its time limit keeps what it reached
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
