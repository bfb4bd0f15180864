"""mixprec.narrow.experts.blockwise: the grouped block-wise kernels against the grouped emulation in
Triton's interpreter on the CPU (tests/narrow/experts_blockwise_cases.py, in a process of its own:
TRITON_INTERPRET is read when Triton is imported), where the route applies, and the audit's view."""

import pytest
import torch
from interpreted import run_interpreted

from mixprec.narrow.experts import routes
from mixprec.narrow.formats.recipe import RECIPES
from mixprec.narrow.linear.fp8 import Plan


@pytest.mark.slow
def test_the_kernels_equal_the_grouped_emulation_in_tritons_interpreter():
    run_interpreted("experts_blockwise_cases.py", 5)


def test_the_route_is_cuda_only_and_said():
    assert routes.blockwise_route("cpu") == "mixprec's grouped block-wise kernels run on CUDA GPUs only"
    r = RECIPES["blockwise"]
    said = routes.describe(Plan(r, r.tiles, torch.bfloat16, (False,) * 3))
    assert "torch has no grouped block-wise scaled GEMM, and mixprec's kernels are not used: mixprec's grouped " \
           "block-wise kernels run on CUDA GPUs only" in said
