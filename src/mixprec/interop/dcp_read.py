"""Reading a torch.distributed.checkpoint (DCP) folder without running its code.

DCP's own reader unpickles the folder's `.metadata` with plain pickle, and its default load
planner reads every non-tensor entry (the optimizer's param_groups, for one) with
`torch.load(weights_only=False)`: a folder from elsewhere whose entries hold an object with a
`__reduce__` would run code on resume. Here the metadata's unpickler accepts DCP's own
metadata classes only, and each entry is read with `weights_only=True` (tensors, numbers,
strings and containers). What either refuses surfaces as a pickle.UnpicklingError, which
the caller reports as a checkpoint it cannot read.

    dcp_read.load(state, path)   # = dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP = "torch.distributed.checkpoint."
_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
          ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that finds only what DCP's metadata is made of: its dataclasses and
    enums, torch.Size, torch's dtypes and layouts, and the checkpoint's path."""

    def find_class(self, module: str, name: str):
        if (module, name) in _NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(_DCP):
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not part of DCP's metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is read by _MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        locate = getattr(self, "_get_metadata_path", None)  # torch >= 2.7; before: .metadata in the folder
        path = locate(rank) if locate is not None else self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reading non-tensor entries with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load(state: dict, path: str | pathlib.Path, reader: SafeReader | None = None) -> None:
    """dcp.load of `state` from the folder `path` (through `reader` where the caller read its
    metadata already), in place, running none of its code."""
    import torch.distributed.checkpoint as dcp

    if reader is None:
        reader = SafeReader(str(path))
        # read here first: a refused metadata raises its own error, where DCP's planning would wrap it
        # (torch 2.11 as "metadata is None", the reason lost)
        reader.read_metadata()
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
