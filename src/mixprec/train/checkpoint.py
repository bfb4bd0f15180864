"""Checkpoints as single files, written atomically.

A checkpoint is written to `step-N.pt.tmp`, flushed to disk, then renamed to
`step-N.pt`: a crash mid-save leaves only a `.tmp` file, which is never loaded.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from pathlib import Path

import torch

from mixprec.errors import UserError

logger = logging.getLogger(__name__)
_NAME = re.compile(r"^step-(\d+)\.pt$")


class CheckpointManager:
    def __init__(self, folder: Path, keep_latest_k: int):
        self.folder, self.keep_latest_k = folder, keep_latest_k

    def steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _NAME.match(p.name)))

    def path(self, step: int) -> Path:
        return self.folder / f"step-{step}.pt"

    def save(self, step: int, state: dict) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        if self.keep_latest_k:
            for old in self.steps()[:-self.keep_latest_k]:
                self.path(old).unlink()
        logger.info("checkpoint: saved step %d to %s", step, final)
        return final

    def load(self, step: int = -1) -> dict | None:
        """The checkpoint of `step` (-1: the latest; None when there is none)."""
        steps = self.steps()
        if step == -1:
            if not steps:
                return None
            step = steps[-1]
        elif step not in steps:
            raise UserError(
                f"checkpoint.load_step {step}: no checkpoint at that step in {self.folder}; "
                f"accepted: {', '.join(map(str, steps)) or 'none saved yet'} or -1 (latest)"
            )
        path = self.path(step)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError, OSError) as e:
            raise UserError(
                f"checkpoint {path} is corrupt or not a mixprec checkpoint ({type(e).__name__}); "
                "accepted: a file written by mixprec train; remove it or set checkpoint.load_step"
            ) from None
        if not isinstance(state, dict) or "format" not in state or state["format"] != 1:
            raise UserError(f"checkpoint {path} is not a mixprec checkpoint (format 1); remove it or set checkpoint.load_step")
        logger.info("checkpoint: loading step %d from %s", step, path)
        return state


def check_compatible(state: dict, meta: dict, path: Path) -> None:
    """The checkpoint was made for the same model and tokenizer as this run."""
    diffs = [f"{k}: checkpoint {state['meta'].get(k)!r} vs config {v!r}"
             for k, v in meta.items() if state["meta"].get(k) != v]
    if diffs:
        raise UserError(
            f"checkpoint {path} does not match this config ({'; '.join(diffs)}); "
            "accepted: the config it was made with, or another job.dump_folder"
        )
