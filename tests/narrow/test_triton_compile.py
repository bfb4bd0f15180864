"""Every Triton kernel of the package compiled for a GPU on this CPU: Triton's code generator,
its MLIR passes and its bundled ptxas need no GPU. The interpreter tests (TRITON_INTERPRET=1)
run a kernel as plain Python and cannot see what fails to compile: a name the code generator
cannot resolve, an op it has no lowering for. Each kernel's module lists the signatures and
constexpr combinations its casts launch it with (COMPILE_CASES); a kernel without one fails
here, so a new kernel cannot go untested."""

import importlib
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
    assert "mixprec.narrow.blockwise_cast_kernel" in kernel_modules()
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
