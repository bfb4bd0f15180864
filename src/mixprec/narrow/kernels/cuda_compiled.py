"""Functions of tensors that CUDA runs compiled by Inductor, one compiled copy per variant of their arguments,
and eagerly elsewhere (the CPU's numbers are the eager ones; tests compile them with Inductor's CPU backend
against the eager run). The narrow formats' casts and the grouped GEMMs' epilogues go through here: eagerly,
each op of a cast is a pass over the tensor in FP32; compiled, Inductor fuses them into a kernel or two that
read the input once.

    cuda_compiled.compiled(fn, device_type)(*args)    # fn compiled on CUDA, fn itself elsewhere
"""

from __future__ import annotations

import functools
import logging
import types

import torch

logger = logging.getLogger(__name__)

_COMPILED: dict = {}  # (fn, its arguments' variant) -> fn compiled for that variant alone
_SAID_EAGER: list = []  # the eager casts of 0 or 1 rows, said once a process


def _variant(a):
    """What Dynamo guards on in an argument, besides sizes: a tensor's dtype, rank and requires_grad, a
    missing tensor, a tuple's parts, any other value itself."""
    if isinstance(a, torch.Tensor):
        return "tensor", a.dtype, a.dim(), a.requires_grad
    if isinstance(a, tuple):
        return tuple(_variant(p) for p in a)
    return a


def _counted(name: str):
    """Inductor, saying each compile of `name` past its first: a recompile (a guard failed) costs seconds
    on the step that meets it, and past Dynamo's recompile limit the function runs eagerly."""
    inductor = torch._dynamo.lookup_backend("inductor")
    compiles = [0]

    def backend(gm, example_inputs):
        compiles[0] += 1
        if compiles[0] > 1:
            logger.warning("compiled functions: %s compiled again (%d times; past %d it runs eagerly)", name,
                           compiles[0], torch._dynamo.config.recompile_limit)
        return inductor(gm, example_inputs)
    return backend


def sized(*names: str):
    """Marks fn's integer arguments `names` as sizes that follow the rows (a layout's length, a count of
    tiles): Dynamo takes them symbolic (dynamic shapes), so a new value is no new variant, and a layer whose
    row count moves from step to step (an expert-parallel rank's) compiles once, not once a step."""
    def mark(fn):
        fn.sizes = names
        return fn
    return mark


def compiled_variant(fn, *args):
    """fn(*args) compiled (dynamic shapes), one compiled copy of fn per variant of its arguments: Dynamo
    keeps at most 8 graphs per function (its recompile limit) and runs it eagerly past them, and a
    recipe's casts (input, weight, gradient; dense and grouped; rounding keys and tensor amaxes present
    or not) are more variants than that. A copy is fn with its own code object, which Dynamo caches apart.
    A tensor of 0 or 1 rows (an expert-parallel rank that received none or one) runs eagerly: Dynamo
    specialises sizes 0 and 1, so compiling for it would be another graph, compiled mid-run while the other
    ranks wait, and the variant's first graph is then the one for every row count (>= 2)."""
    rows = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()), 2)
    if rows < 2:
        if not _SAID_EAGER:
            _SAID_EAGER.append(True)
            logger.info("compiled functions: a tensor of %d rows runs eagerly (compiled, sizes 0 and 1 would each "
                        "be a graph of their own)", rows)
        return fn(*args)
    sizes, names = getattr(fn, "sizes", ()), fn.__code__.co_varnames[:fn.__code__.co_argcount]
    key = (fn, tuple("size" if name in sizes else _variant(a) for name, a in zip(names, args)))
    if key not in _COMPILED:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_variant{len(_COMPILED)}")
        copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        _COMPILED[key] = torch.compile(copy, dynamic=True, backend=_counted(code.co_name))
    return _COMPILED[key](*args)


def compiled(fn, device_type: str):
    """fn compiled for `device_type` on CUDA, per variant of its arguments (`compiled_variant`); fn itself elsewhere."""
    if device_type != "cuda":
        return fn
    return functools.partial(compiled_variant, fn)
