"""Weights in and out: the two interfaces, and what a new architecture implements.

A **WeightSource** is where weights come from: a Hugging Face folder (`HFFolder`), a
safetensors file (`SafetensorsFile`), a mixprec checkpoint (`CheckpointWeights`). The loader
asks it for names, shapes and dtypes before reading anything (one line for a source that does
not fit), then reads each tensor's rows for this rank only.

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
