"""Weights into a built model: from a Hugging Face folder (through the architecture's adapter)
or from a mixprec checkpoint (weights only), into full or sharded (DTensor) parameters.

    source = open_source(path, model)             # one clear line for a folder or file that does not fit
    load_weights(model, source, extra={"layers.0.attention.wq.weight": [master], ...})

Each rank reads only the rows of each tensor that its shard holds (for a DTensor parameter
its local shard's global offsets); the model is built on the meta device and sharded before
anything is materialised (`empty_parameters`, `materialize`), so no rank holds the whole model
unless it holds the whole model anyway.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import nn

from mixprec.dtypes import dtype_name
from mixprec.errors import UserError, dcp_failures, unreadable
from mixprec.interop.adapters import adapter_for
from mixprec.interop.checkpoint import read_checkpoint
from mixprec.interop.expert_files import Fused
from mixprec.interop.hf_folder import HFFolder, is_hf_folder
from mixprec.interop.interfaces import NameMap, WeightSource
from mixprec.interop.quantized import dequantized
from mixprec.models.ties import retie, tie_pairs, tied_names

logger = logging.getLogger(__name__)

_IGNORED = ("rotary_emb.inv_freq",)  # recomputed buffers older transformers saved


class OwnNames:
    """mixprec's own names: a mixprec checkpoint into the model that wrote it."""

    def hf_name(self, name: str) -> str:
        return name

    def read(self, name: str, read, rows: slice | None = None) -> torch.Tensor:
        return read(name, rows)


class CheckpointWeights:
    """The model tensors of a mixprec checkpoint, never its optimizer: a single file read with
    its tensors paged in as touched, or the `model.*` entries of a DCP folder of any world
    size (a WeightSource). `meta` is what the run recorded of the model."""

    def __init__(self, path: str | Path, key: str = "checkpoint.initial_load"):
        self.path = Path(path).expanduser()
        state = read_checkpoint(self.path, f"{key} {path}", "accepted: a Hugging Face model folder, a run folder, "
                                "or a mixprec checkpoint (a step-N.pt file or step-N folder written by mixprec train)",
                                mmap=True)
        self.meta, self.step = state["meta"], state.get("step")
        self.tensors = state["model"] if "model" in state else _dcp_model(self.path, key)
        if "hf_config" in self.meta:  # a transformers model's state_dict holds its decoder layers twice:
            # under `hf.` and under HFCausalLM's own name for them, `layers.`; the weights are the first
            self.tensors = {k: v for k, v in self.tensors.items() if not k.startswith("layers.")}

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        t = self.tensors[name]
        return t if rows is None else t[rows]


def _dcp_model(path: Path, key: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mixprec.interop import dcp_read

    try:
        reader = dcp_read.SafeReader(str(path))  # runs no code the folder holds
        entries = reader.read_metadata().state_dict_metadata
        model = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
                 for k, m in entries.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        dcp_read.load({"model": model}, path, reader)  # only these entries are read
    except (CheckpointException, Exception) as e:  # DCP gathers the reader's errors into a CheckpointException
        if not all(unreadable(f) for f in dcp_failures(e)):
            raise
        raise UserError(f"{key} {path}: its DCP shards cannot be read ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:100]}); accepted: a complete step-N folder") from None
    return model


def open_source(path: str | Path, model: nn.Module,
                key: str = "checkpoint.initial_load") -> tuple[WeightSource, NameMap]:
    """(the source, the map from the model's names to the source's)."""
    if is_hf_folder(path):
        adapter = adapter_for(model)
        source = dequantized(HFFolder(path, key), key)
        fused = Fused(source, {adapter.hf_name(n) for n in _targets(model)})
        if fused:
            logger.info("%s: the experts' per-expert weights merged into the fused tensors the model holds", key)
        return (fused if fused else source), adapter
    return CheckpointWeights(path, key), OwnNames()


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (each tensor once) and persistent buffers, by name."""
    targets = dict(model.named_parameters())
    for fqn, module in model.named_modules():
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in module._non_persistent_buffers_set:
                targets[f"{fqn}.{name}" if fqn else name] = b
    return targets


def check_fits(model: nn.Module, source: WeightSource, adapter: NameMap, key: str) -> None:
    """Every tensor the model needs is there in a shape and kind that fits, and nothing is left
    over: one line naming the first that does not. A tie is read once, under its first name."""
    targets = _targets(model)
    wanted = {adapter.hf_name(n): n for n in targets}
    have = set(source.names())
    spare = {adapter.hf_name(n) for n in tied_names(model)} | {n for n in have if n.endswith(_IGNORED)}
    missing = [n for n in wanted if n not in have]
    extra = sorted(have - set(wanted) - spare)
    where = getattr(source, "path", "")
    if missing:
        raise UserError(f"{key} {where}: {len(missing)} tensors missing, first {missing[0]!r}; accepted: weights for "
                        f"every parameter of this {type(model).__name__}")
    if extra:
        raise UserError(f"{key} {where}: {len(extra)} tensors this {type(model).__name__} has no place for, first "
                        f"{extra[0]!r}; accepted: a checkpoint of this architecture and size")
    for theirs, ours in wanted.items():
        target = targets[ours]
        if tuple(source.shape(theirs)) != tuple(target.shape):
            raise UserError(f"{key} {where}: {theirs!r} is {list(source.shape(theirs))}, the model's {ours!r} is "
                            f"{list(target.shape)}; accepted: a checkpoint of this architecture and size")
        if source.dtype(theirs).is_floating_point != target.dtype.is_floating_point:
            raise UserError(f"{key} {where}: {theirs!r} is {source.dtype(theirs)}, the model's {ours!r} is "
                            f"{target.dtype}; accepted: floating-point weights for floating-point parameters")


def _local(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank holds and the global index range of each of its dimensions."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_weights(model: nn.Module, source: WeightSource, adapter: NameMap,
                 extra: dict[str, list[torch.Tensor]] | None = None, key: str = "checkpoint.initial_load") -> None:
    """Copy each parameter (and persistent buffer) of `model` from `source`, this rank's rows
    only; `extra` names further tensors to receive the same values (FP32 master weights)."""
    check_fits(model, source, adapter, key)
    converted = set()
    for name, target in _targets(model).items():
        for t in [target, *(extra or {}).get(name, [])]:
            local, ranges = _local(t)
            if local.numel() == 0:
                continue
            value = adapter.read(name, source.read, ranges[0] if ranges else None)
            if ranges:
                for dim, r in enumerate(ranges[1:], start=1):
                    value = value.narrow(dim, r.start, r.stop - r.start)
            if value.dtype != local.dtype:
                converted.add((dtype_name(value.dtype), dtype_name(local.dtype)))
            local.copy_(value)
    for stored, into in sorted(converted):
        logger.info("%s: %s weights loaded into %s tensors", key, stored, into)


@contextlib.contextmanager
def empty_parameters():
    """Modules built inside get their parameters on the meta device and their buffers for real
    (RoPE tables and masks that a model computes once in __init__)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> None:
    """Storage on `device` for a model built by `empty_parameters` or on the meta device (after
    sharding: each rank allocates its shard only), buffers kept, ties restored. Buffers made on
    the meta device start at zero: the FP8 layers' delayed-scaling state, zeros at start."""
    buffers = {n: b.clone() if b.device.type != "meta" else None for n, b in model.named_buffers()}
    tied = tie_pairs(model)
    model.to_empty(device=device)
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        buffer = getattr(model.get_submodule(owner), attr)
        buffer.zero_() if value is None else buffer.copy_(value)
    retie(model, tied)
