"""Counting the host's reads of device values: what makes a training step wait for the device.

A value reaches the host by `aten._local_scalar_dense` (what `.item()`, `bool(t)`,
`float(t)`, `int(t)` and `.tolist()`'s elements become) or by a copy of a tensor to the
CPU (`.cpu()`, `.to("cpu")`, `copy_` into a CPU tensor). On a GPU each one stops the host
until the device has finished everything queued before it. The counter sees every such op
the eager program issues (inside a compiled region, a read is a graph break and runs
eagerly, so it is seen too); on a CPU-only machine the same reads are counted, so a test
proves the device-side step where CI runs.

    with HostReads() as reads:
        ...
    reads.events   # [(label, op, where)], label: what `reads.label` was at the read

torch.compile does not compile while a dispatch mode is active (it runs the frames
eagerly), so for a compiled program `PythonReads` counts the same reads at the Python
methods that make them (`item`, `tolist`, `bool`, `float`, `int`, `cpu`), leaving
compilation alone; it does not see a read made inside a C++ kernel (the dispatch mode does).
"""

from __future__ import annotations

import traceback

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SCALAR = aten._local_scalar_dense.default
_COPIES = {aten._to_copy.default, aten.copy_.default}


def _cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class HostReads(TorchDispatchMode):
    """Counts reads of a value to the host (`Tensor.tolist` included: on a CPU tensor it reads
    the memory without dispatching an op, so it is counted where it is called). `label` (set by the caller as it goes, e.g. the
    step number) is recorded with each read, with the innermost mixprec or test frame that
    issued it. A copy counts when its source is not on the CPU and its destination is; a
    scalar read counts on any device (on a CPU run, the reads a GPU run would make)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[object, str, str]] = []
        self.label: object = None

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        mode = self

        def tolist(t):
            if _cpu(t.device):  # a device tensor's copy to the CPU is counted as the copy it dispatches
                mode._record("tolist")
            return mode._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SCALAR:
            self._record("item")
        elif func in _COPIES:
            src = args[1] if func is aten.copy_.default else args[0]
            to_cpu = _cpu(args[0].device) if func is aten.copy_.default else _cpu(kwargs.get("device"))
            if to_cpu and isinstance(src, torch.Tensor) and not _cpu(src.device) and src.device.type != "meta":
                self._record("copy to cpu")
        return func(*args, **kwargs)

    def _record(self, op: str) -> None:
        frames = [f for f in traceback.extract_stack() if ("mixprec" in f.filename or "/tests/" in f.filename)
                  and not f.filename.endswith("host_reads.py")]
        where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        self.events.append((self.label, op, where))

    def by_label(self) -> dict:
        counts: dict = {}
        for label, _, _ in self.events:
            counts[label] = counts.get(label, 0) + 1
        return counts


class PythonReads(HostReads):
    """HostReads at the Tensor methods instead of a dispatch mode (see the module's note)."""

    _METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in self._METHODS}
        mode = self

        def counted(name, method):
            def read(t, *args, **kwargs):
                # tracing (dynamo's fake tensors) reads nothing; .cpu() of a CPU tensor moves nothing
                if not (torch.compiler.is_compiling() or is_fake(t)) and (name != "cpu" or not _cpu(t.device)):
                    mode._record(name.strip("_"))
                return method(t, *args, **kwargs)
            return read

        for name, method in self._saved.items():
            setattr(torch.Tensor, name, counted(name, method))
        return self

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return False
