"""What every report reads off the process it runs in: the peak memory, the device's name,
and matplotlib loaded headless (an optional dependency, imported where a plot is drawn)."""

from __future__ import annotations

import resource

import torch

from mixprec.errors import UserError


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated by tensors. CPU: peak resident set size of the process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU with the instruction set torch's kernels use on it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.backends.cpu.get_cpu_capability()})"


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("metrics.plot needs matplotlib: pip install matplotlib (or set metrics.plot false)") from None
    return plt
