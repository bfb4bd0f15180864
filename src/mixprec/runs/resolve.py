"""What a path names for export and generate: a run folder (its latest checkpoint), a
checkpoint (step-N.pt or a DCP step-N folder), or a Hugging Face model folder; the
tokenizer.json a run trained with, where it has one; and the model a checkpoint holds,
built on the meta device (its ties are what export stores once)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mixprec.config import load_config
from mixprec.data.shards import is_prepared
from mixprec.data.tokenizer import tokenizer_path
from mixprec.errors import UserError
from mixprec.interop.checkpoint import CheckpointManager
from mixprec.interop.hf_folder import is_hf_folder
from mixprec.interop.load import empty_parameters
from mixprec.models.llama import Llama, ModelArgs

logger = logging.getLogger(__name__)

RUN_CONFIG = "config.toml"


def _run_config(folder: Path):
    return load_config(str(folder / RUN_CONFIG)) if (folder / RUN_CONFIG).is_file() else None


def resolve(path: str | Path) -> tuple[str, Path, Path | None]:
    """(kind, path, run folder): kind "hf" (a Hugging Face folder) or "checkpoint" (the path of one,
    a run folder's latest), with the run folder the checkpoint belongs to where there is one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{path}: no such file or folder; accepted: a run folder, a checkpoint "
                        "(step-N.pt or a step-N folder) or a Hugging Face model folder")
    if p.is_dir() and is_hf_folder(p):
        return "hf", p, None
    if p.is_dir() and (p / RUN_CONFIG).is_file():
        folder = _run_config(p).checkpoint.folder
        checkpoints = CheckpointManager(p / folder, 0)
        if not checkpoints.steps():
            raise UserError(f"run folder {p} has no checkpoint in {folder}/; accepted: a run that saved one "
                            "(checkpoint.enable true)")
        return "checkpoint", checkpoints.path(checkpoints.steps()[-1]), p
    run = p.parent.parent if (p.parent.parent / RUN_CONFIG).is_file() else None
    if p.is_file() or (p / "extras.pt").is_file():
        return "checkpoint", p, run
    raise UserError(f"{path} is neither a run folder (config.toml), a checkpoint nor a Hugging "
                    "Face folder (config.json); accepted: one of those")


def tokenizer_file(run: Path | None) -> Path | None:
    """The tokenizer.json the run in `run` trained with: a prepared data folder's, the BPE trained
    into the run folder, or the file data.tokenizer names; None for UTF-8 bytes (or no run)."""
    config = _run_config(run) if run is not None else None
    if config is None:
        return None
    data = config.data
    if is_prepared(data.source):
        file = Path(data.source).expanduser() / "tokenizer.json"
    elif data.tokenizer == "bpe":
        file = run / "tokenizer.json"
    elif data.tokenizer != "byte":
        file = tokenizer_path(data.tokenizer)
    else:
        return None
    return file if file.is_file() else None


def empty_model(meta: dict) -> torch.nn.Module:
    """The model a checkpoint's (or a folder's) fields describe, its parameters on the meta
    device: a transformers model where `meta` holds its config (needs mixprec[hf]), else
    mixprec's Llama."""
    if "hf_config" in meta:
        from mixprec.models.hf import HFCausalLM, hf_config_from_dict

        with empty_parameters():
            return HFCausalLM(hf_config_from_dict(meta["hf_config"], "folder"))
    with torch.device("meta"):
        return Llama(ModelArgs.from_architecture(meta))
