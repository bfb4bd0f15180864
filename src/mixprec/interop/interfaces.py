"""Weights in and out: the two interfaces, and what a new architecture implements.

A **WeightSource** is where weights come from: a Hugging Face folder (`HFFolder`), a
safetensors file (`SafetensorsFile`), a mixprec checkpoint (`CheckpointWeights`). The loader
asks it for names, shapes and dtypes before reading anything (one line for a source that does
not fit), then reads each tensor's rows for this rank only.

A **View** is a WeightSource over another whose tensors it reads differently: some names stand for tensors
made from others (a narrow format's elements and scales dequantized, per-expert weights merged), the parts
they are made of hidden, every other name passed through (mixprec.interop.quantized, expert_files).

A **StateDictAdapter** maps one architecture between mixprec's parameter names and layouts
and a Hugging Face folder's, both ways: the initial load reads through it, export writes
through it. A new architecture implements these four methods and is chosen by
`adapters.adapter_for(model)`; mixprec's Llama (`LlamaAdapter`) and any transformers model
(`HFAdapter`) are the two there are. Loading alone needs the first half (`NameMap`): a
mixprec checkpoint read into the model that wrote it maps names to themselves (`OwnNames`).

Ties are not an adapter's business: one rule (`mixprec.models.ties`) says which names share a
tensor, for the loader, export, FSDP2 and the model builder alike.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

Read = Callable[[str, "slice | None"], torch.Tensor]  # a WeightSource's read: (name, rows) -> tensor


@runtime_checkable
class WeightSource(Protocol):
    path: object  # where it is, for messages

    def names(self) -> list[str]:
        """Every tensor it holds, by its own names."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor, or only `rows` of its first dimension (a rank's shard), on the CPU."""


@runtime_checkable
class NameMap(Protocol):
    def hf_name(self, name: str) -> str:
        """The source's name for the model's parameter `name`; KeyError where it has none."""

    def read(self, name: str, read: Read, rows: slice | None = None) -> torch.Tensor:
        """Parameter `name` (or its `rows`) in the model's layout, from the source's `read`."""


@runtime_checkable
class StateDictAdapter(NameMap, Protocol):
    def to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The model's tensor `name` in the folder's layout (export)."""

    def hf_config(self, dtype: str) -> dict:
        """config.json of the model, with `dtype` as its torch_dtype (export)."""


class View:
    """A WeightSource over `source`: the names of `made` (name -> what it is made of) read by `_read` as the tensors
    they stand for (float32 unless `_dtype` says otherwise, shaped as the source's tensor of that name unless
    `_shape` says otherwise), the names in `hidden` not shown, every other name the source's own."""

    made: dict
    hidden: set

    def __init__(self, source):
        self.source, self.path, self.config = source, getattr(source, "path", ""), getattr(source, "config", None)

    def names(self) -> list[str]:
        shown = [n for n in self.source.names() if n not in self.hidden]
        seen = set(shown)
        return shown + [n for n in self.made if n not in seen]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape(name) if name in self.made else self.source.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._dtype(name) if name in self.made else self.source.dtype(name)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        return self._read(name, rows) if name in self.made else self.source.read(name, rows)

    def _shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def _dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def _read(self, name: str, rows: slice | None) -> torch.Tensor:
        raise NotImplementedError
