"""Where the FP8 operands' memory layouts come from in a compiled training step.

torch's scaled GEMM reads its first operand row-major and its second column-major, so the
weight-gradient GEMM (dy^T @ x) needs dy^T and x in the other order from the forward's. Eager,
`mixprec.narrow.gemm.fp8.kernel_mm` makes those copies as separate byte transposes. Compiled,
Inductor decides: it can write each layout from the cast kernel that reads the
high-precision tensor, or copy one FP8 tensor into another. This script compiles one
forward and backward of the model under each FP8 preset and lists the generated kernels
that read FP8 and write FP8 (a separate transpose), from Inductor's own code (its C++
kernels on the CPU, its Triton kernels on CUDA).

    python benchmarks/fp8_compiled_layouts.py [--flavor debug] [--presets fp8-tensorwise,fp8-rowwise]
"""

from __future__ import annotations

import argparse
import ast
import re

import torch
from torch._inductor.utils import run_and_get_code

import mixprec

CPP_FP8 = "Float8_"
TRITON_FP8 = "*fp8"


def kernels(code: str) -> list[tuple[str, set[str], set[str]]]:
    """(name, input types, output types) of each generated kernel."""
    found = []
    for name, args in re.findall(r"^(\w+) = async_compile\.cpp_pybinding\(\[([^\]]*)\]", code, re.M):
        types = [a.strip().strip("'\"") for a in args.split(",")]
        found.append((name, {t for t in types if t.startswith("const ")}, {t for t in types if not t.startswith("const ")}))
    for name, signature in re.findall(r"^(\w+) = async_compile\.triton\('\w+',.*?'signature': (\{[^}]*\})", code,
                                      re.M | re.S):
        sig = ast.literal_eval(signature)
        found.append((name, {t for k, t in sig.items() if k.startswith(("in_ptr", "in_out_ptr"))},
                      {t for k, t in sig.items() if k.startswith(("out_ptr", "in_out_ptr"))}))
    return found


def is_fp8(t: str) -> bool:
    return CPP_FP8 in t or t.startswith(TRITON_FP8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debug")
    p.add_argument("--presets", default="fp8-tensorwise,fp8-delayed,fp8-rowwise,fp8-blockwise")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    print(f"device {args.device}, torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()}, "
          f"flavor {args.flavor}")
    for preset in args.presets.split(","):
        torch._dynamo.reset()
        policy = mixprec.Policy.from_preset(preset)
        model = mixprec.build_model(mixprec.model_args(args.flavor, vocab_size=256), device=args.device,
                                    storage_dtype=policy.storage_dtype, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = policy.setup(model, optimizer)
        compiled = torch.compile(model)
        x = torch.randint(0, 256, (2, args.tokens + 1), device=args.device)

        def step():
            with policy.autocast():
                loss = compiled(x[:, :-1], x[:, 1:])
            loss.backward()

        _, codes = run_and_get_code(step)
        code = "\n".join(codes)
        found = kernels(code)
        copies = [name for name, ins, outs in found if any(map(is_fp8, ins)) and any(map(is_fp8, outs))]
        casts = [name for name, ins, outs in found if any(map(is_fp8, outs)) and not any(map(is_fp8, ins))]
        print(f"{preset}: {len(found)} kernels, {code.count('_scaled_mm(')} scaled GEMM calls, {len(casts)} kernels "
              f"write FP8 from wider values, {len(copies)} copy FP8 into FP8" + (f": {', '.join(copies)}" if copies else ""))


if __name__ == "__main__":
    main()
