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

import contextlib
import traceback

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SCALAR = aten._local_scalar_dense.default
_COPIES = {aten._to_copy.default, aten.copy_.default}


def _cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class _Reads:
    """The record both counters keep: (label, op, where) per read. `label` (set by the caller
    as it goes, e.g. the step number) is recorded with each read, with the innermost mixprec
    or test frame that issued it."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[object, str, str]] = []
        self.label: object = None
        self._saved: dict = {}

    def _record(self, op: str) -> None:
        frames = [f for f in traceback.extract_stack() if ("mixprec" in f.filename or "/tests/" in f.filename)
                  and not f.filename.endswith("host_reads.py")]
        where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
        self.events.append((self.label, op, where))

    def _patch(self, names: tuple[str, ...], counts) -> None:
        """Count the Tensor methods `names` where `counts(name, tensor)` says so. Tracing
        (dynamo's fake tensors) reads nothing."""
        self._saved = {name: getattr(torch.Tensor, name) for name in names}

        def counted(name, method):
            def read(t, *args, **kwargs):
                if not (torch.compiler.is_compiling() or is_fake(t)) and counts(name, t):
                    self._record(name.strip("_"))
                return method(t, *args, **kwargs)
            return read

        for name, method in self._saved.items():
            setattr(torch.Tensor, name, counted(name, method))

    def _unpatch(self) -> None:
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)

    def by_label(self) -> dict:
        counts: dict = {}
        for label, _, _ in self.events:
            counts[label] = counts.get(label, 0) + 1
        return counts


class HostReads(_Reads, TorchDispatchMode):
    """Counts reads of a value to the host: a scalar read on any device (on a CPU run, the
    reads a GPU run would make), a copy whose source is not on the CPU and whose destination
    is, and `Tensor.tolist` of a CPU tensor (it reads the memory without dispatching an op;
    a device tensor's tolist dispatches the copy counted above)."""

    def __enter__(self):
        self._patch(("tolist",), lambda name, t: _cpu(t.device))
        return super().__enter__()

    def __exit__(self, *exc):
        self._unpatch()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = None
        if func is _SCALAR:
            read = "item"
        elif func in _COPIES:
            src = args[1] if func is aten.copy_.default else args[0]
            to_cpu = _cpu(args[0].device) if func is aten.copy_.default else _cpu(kwargs.get("device"))
            if to_cpu and isinstance(src, torch.Tensor) and not _cpu(src.device) and src.device.type != "meta":
                read = "copy to cpu"
        if read is None:
            return func(*args, **kwargs)
        self._record(read)
        with _counted_read():
            return func(*args, **kwargs)


@contextlib.contextmanager
def _counted_read():
    """A counted read waits for the device by nature: under torch.cuda.set_sync_debug_mode("error")
    (the GPU test's, for every synchronising call the counter does not see) it is let through."""
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


class PythonReads(_Reads):
    """The same reads at the Tensor methods that make them, no dispatch mode (see the module's
    note): `.cpu()` of a CPU tensor moves nothing and is not counted."""

    def __enter__(self):
        self._patch(("item", "tolist", "__bool__", "__float__", "__int__", "cpu"),
                    lambda name, t: name != "cpu" or not _cpu(t.device))
        return self

    def __exit__(self, *exc):
        self._unpatch()
        return False
