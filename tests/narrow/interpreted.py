"""Running a cases file of Triton kernels in Triton's interpreter on the CPU, in a process of its own:
TRITON_INTERPRET is read when Triton is imported, and a process that compiled for a GPU must not run
interpreted."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def run_interpreted(cases: str, passed: int, timeout: int = 900) -> None:
    """pytest on tests/narrow/`cases` with TRITON_INTERPRET=1: every case passes, `passed` of them."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__).with_name(cases))], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(rf"\b{passed} passed", proc.stdout), proc.stdout[-1000:]
