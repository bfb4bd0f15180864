"""A Hugging Face model folder: `config.json` and the weights, one `model.safetensors` or
shards `model-0000i-of-0000n.safetensors` named by `model.safetensors.index.json`.

    folder = HFFolder("path/to/llama")        # one clear line for anything missing or malformed
    folder.config["model_type"], folder.names()
    folder.read("model.norm.weight", rows=slice(0, 64))
    write_folder(out, tensors, config, dtype=torch.bfloat16, max_shard_bytes=5 << 30)

Only safetensors are read: a folder with only `pytorch_model.bin` (pickle) is refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from mixprec.errors import UserError
from mixprec.interop.safetensors_io import SafetensorsFile, write_file

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror}); accepted: {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not JSON ({e}); accepted: {what}") from None


def is_hf_folder(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


class HFFolder:
    def __init__(self, path: str | Path, key: str = "checkpoint.initial_load"):
        self.path = Path(path).expanduser()
        if not self.path.is_dir() or not (self.path / "config.json").is_file():
            raise UserError(f"{key} {path}: no config.json there; accepted: a Hugging Face model folder "
                            "(config.json and model.safetensors, or shards and model.safetensors.index.json)")
        self.config = _json(self.path / "config.json", "a Hugging Face config.json")
        if not isinstance(self.config, dict) or not self.config.get("model_type"):
            raise UserError(f"{key}: {self.path / 'config.json'} has no model_type; accepted: a Hugging Face "
                            "config.json (model_type llama, qwen2, gpt2, ...)")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}  # tensor name -> file name
        if (self.path / INDEX).is_file():
            index = _json(self.path / INDEX, "a Hugging Face model.safetensors.index.json")
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"{key}: {self.path / INDEX} has no weight_map; accepted: an index that names "
                                "the file of each tensor")
            for name, file in weight_map.items():
                if str(file) not in self.files:
                    self.files[str(file)] = self._open(str(file), key)
                if name not in self.files[str(file)].entries:
                    raise UserError(f"{key}: {INDEX} puts {name!r} in {file}, which does not hold it; accepted: "
                                    "an index that matches its files")
                self.where[name] = str(file)
        elif (self.path / SINGLE).is_file():
            self.files[SINGLE] = self._open(SINGLE, key)
            self.where = dict.fromkeys(self.files[SINGLE].entries, SINGLE)
        else:
            pickled = [p.name for p in self.path.glob("*.bin")]
            found = f" (found {', '.join(pickled[:3])}: pickle files, never loaded)" if pickled else ""
            raise UserError(f"{key} {self.path}: no {SINGLE} or {INDEX}{found}; accepted: safetensors weights")

    def _open(self, file: str, key: str) -> SafetensorsFile:
        path = self.path / file
        if not path.is_file():
            raise UserError(f"{key}: {path} is named by {INDEX} but missing; accepted: a folder with every shard")
        return SafetensorsFile(path)

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.where[name]].shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.files[self.where[name]].dtype(name)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        return self.files[self.where[name]].read(name, rows)


def check_out(out: str | Path) -> Path:
    """OUT may be new or an empty folder; anything else is refused before work starts."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder; accepted: a new path or an empty folder "
                        "(nothing is overwritten)")
    parent = out.resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"{out}: cannot write in {parent}; accepted: a path in a writable folder")
    return out


def write_folder(out: str | Path, tensors: dict[str, torch.Tensor], config: dict, *, dtype: torch.dtype,
                 max_shard_bytes: int, extra_files: dict[str, str] | None = None, float32=frozenset(),
                 as_is=frozenset()) -> dict:
    """Write a Hugging Face folder: config.json, the tensors in `dtype` (floating ones, but those named in
    `float32`, and those in `as_is` as they are: a narrow format's elements and scales; others as they are),
    one file up to `max_shard_bytes`, shards and an index above it, and `extra_files`
    (name -> its text, e.g. tokenizer.json). Written to OUT.tmp, then renamed: a failure
    leaves OUT as it was. Returns {"files", "bytes"}."""
    out = check_out(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    cast = {n: t.to(torch.float32 if n in float32 else dtype) if t.is_floating_point() and n not in as_is else t
            for n, t in tensors.items()}
    shards, size = [[]], 0  # names per shard, in order; a shard closes before it would pass the limit
    for name, t in cast.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    total = 0
    for file, members in zip(names, shards):
        total += write_file(tmp / file, {n: cast[n] for n in members}, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in cast.values())},
                 "weight_map": {n: f for f, members in zip(names, shards) for n in members}}
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(tmp, out)
    return {"files": names, "bytes": total}
