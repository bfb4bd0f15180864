"""Bytes through the collectives, counted where they are issued: a TorchDispatchMode that
sees torch.distributed's c10d operators (whatever Python entry point FSDP2 calls in this
torch release) and adds up the tensors they move.

    with CommBytes() as comm:
        step()
    comm.bytes["all_gather"]      # the gathered (unsharded) bytes this rank received, its own shard included
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# c10d operator name fragment -> the kind it counts as; the first tensor argument is the output
_KINDS = (("allgather", "all_gather"), ("reduce_scatter", "reduce_scatter"), ("allreduce", "all_reduce"),
          ("alltoall", "all_to_all"))


class CommBytes(TorchDispatchMode):
    """Per kind of collective: bytes of its output (all-gather: the unsharded buffer; reduce-scatter:
    the full input is counted instead, what each rank contributes; all-to-all: what this rank
    received, its own part included) and the number of calls."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()
        self.log: list[tuple[str, int]] = []  # (kind, bytes) of each call, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name() if hasattr(func, "name") else str(func)
        if name.startswith("_c10d_functional::all_to_all_single"):  # functional: its result is what came in
            out = func(*args, **(kwargs or {}))
            self._count("all_to_all", out.numel() * out.element_size())
            return out
        if name.startswith("c10d::"):
            op = name.split("::")[1]
            kind = next((k for frag, k in _KINDS if frag in op), None)
            if kind is not None:
                tensors = _tensors(args[1] if kind == "reduce_scatter" else args[0])
                self._count(kind, sum(t.numel() * t.element_size() for t in tensors))
        return func(*args, **(kwargs or {}))

    def _count(self, kind: str, size: int) -> None:
        self.bytes[kind] += size
        self.calls[kind] += 1
        self.log.append((kind, size))


def _tensors(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    out = []
    for a in arg if isinstance(arg, (list, tuple)) else ():
        out += _tensors(a)
    return out
