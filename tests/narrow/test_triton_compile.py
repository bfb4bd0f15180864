"""Every Triton kernel of the package compiled for a GPU on this CPU: Triton's code generator,
its MLIR passes and its bundled ptxas need no GPU. The interpreter tests (TRITON_INTERPRET=1)
run a kernel as plain Python and cannot see what fails to compile: a name the code generator
cannot resolve, an op it has no lowering for. Each kernel's module lists the signatures and
constexpr combinations its casts launch it with (COMPILE_CASES); a kernel without one fails
here, so a new kernel cannot go untested."""

import importlib
import os
import pkgutil
import re

import pytest

triton = pytest.importorskip("triton")

import mixprec  # noqa: E402

ARCHS = {90: "Hopper"}  # the kernels target no Blackwell-only instruction: sm_100 is not asked for


def kernel_modules():
    """mixprec's modules that import Triton at their top: where its kernels live."""
    found = []
    for info in pkgutil.walk_packages(mixprec.__path__, "mixprec."):
        spec = importlib.util.find_spec(info.name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        text = open(spec.origin).read()
        if "import triton" in text and "@triton.jit" in text:
            found.append(info.name)
    return found


def cases():
    out = []
    for name in kernel_modules():
        module = importlib.import_module(name)
        kernels = {k for k, v in vars(module).items() if isinstance(v, triton.runtime.jit.JITFunction)}
        covered = {kernel.fn.__name__ for kernel, _, _ in getattr(module, "COMPILE_CASES", [])}
        assert kernels <= covered, f"{name}: {sorted(kernels - covered)} have no COMPILE_CASES entry"
        for kernel, signature, constexprs in module.COMPILE_CASES:
            for arch in ARCHS:
                label = f"{kernel.fn.__name__}-sm{arch}-" + "-".join(
                    f"{k}{v}" for k, v in constexprs.items()) + "-" + "-".join(sorted(set(signature.values())))
                out.append(pytest.param(kernel, signature, constexprs, arch, id=label))
    return out


def test_the_package_has_kernels_and_every_one_has_compile_cases():
    assert "mixprec.narrow.kernels.blockwise_cast" in kernel_modules()
    assert len(cases()) >= 6


@pytest.mark.slow
@pytest.mark.parametrize("kernel, signature, constexprs, arch", cases())
def test_the_kernel_compiles_to_a_cubin(kernel, signature, constexprs, arch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32))
    assert len(compiled.asm["cubin"]) > 1000
    # addresses in 64 bits: a product of two values known only at launch (a program id, a loop index, a size,
    # a stride) in 32 bits wraps past 2^31 elements (an experts stack of 256 x 4096 x 7168 on one rank); a
    # tile's first index, a program id times a constant BLOCK, stays far below
    wrapping = [line.strip() for line in compiled.asm["ttir"].splitlines()
                if (m := re.search(r"arith\.muli (%\w+), (%\w+) : (tensor<\S*xi32>|i32)\b", line))
                and not any(operand.startswith("%c") for operand in m.group(1, 2))]
    assert not wrapping, wrapping


def launched_cases():
    out = []
    for name in kernel_modules():
        for kernel, signature, constexprs, divisible in getattr(importlib.import_module(name), "LAUNCHED_CASES", []):
            out.append(pytest.param(name, kernel, signature, constexprs, divisible, id=kernel.fn.__name__))
    return out


def test_the_grouped_gemm_kernels_have_launched_cases():
    assert {p.id for p in launched_cases()} >= {"m_grouped", "k_grouped"}


@pytest.mark.slow
@pytest.mark.parametrize("module, kernel, signature, constexprs, divisible", launched_cases())
def test_a_gemm_kernel_as_launched_spills_nothing_and_pipelines_wgmma(module, kernel, signature, constexprs,
                                                                      divisible):
    """A GEMM kernel compiled as its route launches it at a model's sizes (Triton's launch specialisations:
    pointers and sizes divisible by 16, a unit stride 1) with its launch options, for sm_90a: ptxas spills
    0 bytes, the products are Hopper's warp-group MMA (both operands K-major, none transposed through
    registers), and both operands' loads are pipelined (asynchronous copies into shared memory)."""
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    options = importlib.import_module(module).LAUNCH_OPTIONS
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report
    ttgir = compiled.asm["ttgir"]
    assert "ttng.warp_group_dot " in ttgir
    # each operand's tile copied asynchronously once per stage in flight (a pipelined load of each)
    assert ttgir.count("ttg.async_copy_global_to_local") >= 2 * (options["num_stages"] - 1), ttgir.count(
        "ttg.async_copy_global_to_local")
    if signature["out_ptr"] == "*bf16":
        assert re.search(r"cvt\.rn\.bf16(x2)?\.f32", compiled.asm["ptx"])  # the output rounded to nearest
