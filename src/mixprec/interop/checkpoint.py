"""mixprec's checkpoints on disk: written atomically, listed, and read by one reader
(`read_checkpoint`), for a resume and for the weights alone (`interop.load`, export, generate).

One process: a single file, written to `step-N.pt.tmp`, flushed, renamed to
`step-N.pt`. torchrun runs: a folder `step-N` written by torch.distributed.checkpoint
(each rank its shards; `extras.pt` holds the rest), written as `step-N.tmp` and renamed
once every rank is done. A crash mid-save leaves only a `.tmp`, which is never loaded.
A folder saved again at its step (after a rewind) is set aside as `step-N.old` until the new
one is in, and a folder being removed is renamed `step-N.del` first: a process killed at any
point leaves every listed checkpoint whole, and `recover` (at the start of a run) puts back
or removes what it left.
A folder checkpoint loads into any number of ranks, one included (DCP reshards); a
single file loads into a torchrun run too, each rank keeping its shard.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from mixprec.errors import UserError, dcp_failures, does_not_fit, unreadable

logger = logging.getLogger(__name__)
_NAME = re.compile(r"^step-(\d+)(\.pt)?$")


class CheckpointManager:
    def __init__(self, folder: Path, keep_latest_k: int):
        self.folder, self.keep_latest_k = folder, keep_latest_k

    def steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _NAME.match(p.name)))

    def path(self, step: int) -> Path:
        sharded = self.folder / f"step-{step}"
        return sharded if sharded.is_dir() else self.folder / f"step-{step}.pt"

    def _remove(self, step: int) -> None:
        path = self.path(step)
        if path.is_dir():  # out of the listing at once: a kill mid-removal leaves no half folder listed
            gone = path.with_name(path.name + ".del")
            os.replace(path, gone)
            shutil.rmtree(gone)
        else:
            path.unlink()

    def recover(self) -> None:
        """What a killed save or removal left, finished or undone (rank 0, before anything is
        listed or saved): a folder set aside while its step was saved again (`step-N.old`) goes
        back where the new one never arrived, else it is removed; half-removed folders
        (`step-N.del`) and unfinished saves (`*.tmp`) are removed. Each logged."""
        if not self.folder.is_dir():
            return
        for path in sorted(self.folder.iterdir()):
            name = path.name
            if name.endswith(".old") and _NAME.match(name.removesuffix(".old")):
                final = path.with_name(name.removesuffix(".old"))
                if final.exists():
                    shutil.rmtree(path)
                    logger.info("checkpoint: removed %s (replaced by the save that was killed after it)", name)
                else:
                    os.replace(path, final)
                    logger.warning("checkpoint: %s put back as %s (a save of its step was killed before "
                                   "replacing it)", name, final.name)
            elif name.endswith((".del", ".tmp")) and _NAME.match(name.rsplit(".", 1)[0]):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                logger.info("checkpoint: removed %s (left by a save or removal that was killed)", name)

    def drop_after(self, step: int) -> None:
        """Remove the checkpoints past `step`: after a rewind they belong to an abandoned run."""
        for later in [s for s in self.steps() if s > step]:
            self._remove(later)
            logger.info("checkpoint: removed step %d (after the rewind to step %d)", later, step)

    def _prune(self) -> None:
        if self.keep_latest_k:
            for old in self.steps()[:-self.keep_latest_k]:
                self._remove(old)

    def save_sharded(self, step: int, model, optimizer, extras: dict, rank: int) -> Path:
        """Every rank calls this: DCP writes each rank's shards, rank 0 the extras."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tmp, final = self.folder / f"step-{step}.tmp", self.folder / f"step-{step}"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
        if rank == 0:
            _write(extras, tmp / "extras.pt")
            self._publish(tmp, final)
            self._prune()
            logger.info("checkpoint: saved step %d to %s", step, final)
        dist.barrier()
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        """The finished folder `tmp` in as `final`. A folder already there (this step saved
        before a rewind) is set aside and removed only once the new one is in."""
        aside = final.with_name(final.name + ".old")
        if final.exists():
            os.replace(final, aside)
        os.replace(tmp, final)
        _sync(self.folder)
        if aside.exists():
            shutil.rmtree(aside)

    def save(self, step: int, state: dict) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        _write(state, tmp)
        os.replace(tmp, final)  # a file replaces a file in one step
        _sync(self.folder)
        self._prune()
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
        state = read_checkpoint(path, f"checkpoint {path}", "accepted: a checkpoint written by mixprec train; "
                                "remove it or set checkpoint.load_step")
        required = EXTRAS_KEYS if path.is_dir() else (*EXTRAS_KEYS, "model", "optimizer")
        missing = [k for k in required if k not in state]
        if missing:
            raise UserError(f"checkpoint {path} lacks {', '.join(missing)}; accepted: a checkpoint written by mixprec "
                            "train; remove it or set checkpoint.load_step")
        logger.info("checkpoint: loading step %d from %s", step, path)
        state["source"] = str(path)  # the file (or folder) it came from, for messages
        if path.is_dir():
            state["dcp"] = str(path)
        return state


def _write(obj, path: Path) -> None:
    """torch.save to `path`, on the disk before it returns (a rename that follows publishes whole bytes)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _sync(folder: Path) -> None:
    """The folder's entries (a rename into it) on the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


EXTRAS_KEYS = ("meta", "step", "scheduler", "data", "policy", "rng", "trainer")  # what every checkpoint holds


def read_checkpoint(path: Path, where: str, accepted: str, *, mmap: bool = False) -> dict:
    """What a checkpoint holds besides DCP's shards: a single file's whole state, or a step-N
    folder's extras.pt. mmap: tensors paged in as they are touched. Anything that is not a
    mixprec checkpoint is one line: `where` names it, `accepted` ends it."""
    path = Path(path)
    try:
        state = torch.load(path / "extras.pt" if path.is_dir() else path, map_location="cpu", weights_only=True,
                           mmap=mmap and not path.is_dir())
    except FileNotFoundError:
        raise UserError(f"{where}: no such file or folder; {accepted}") from None
    except Exception as e:  # torch.load raises many types for files that are not its own
        if not unreadable(e):
            raise
        raise UserError(f"{where} is corrupt or not a mixprec checkpoint ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:100]}); {accepted}") from None
    if not isinstance(state, dict) or state.get("format") != 1 or "meta" not in state:
        raise UserError(f"{where} is not a mixprec checkpoint (format 1); {accepted}")
    return state


@contextlib.contextmanager
def restoring(path: str, *, from_user: bool = True, saved: dict | None = None, own=None):
    """Turn what a checkpoint that does not fit this run raises into one clear line; any other
    error (a defect, out of memory, a lost rank) keeps its traceback. from_user False: a rewind
    restoring the run's own snapshot, where every error is a defect. A KeyError is the
    checkpoint's only where `saved` (the checkpoint) lacks an entry that `own()` (the state
    this run would save) has: the same KeyError from mixprec's own code is a defect."""
    try:
        yield
    except Exception as e:
        if not from_user:
            raise
        lacks = missing_entries(own(), saved) if isinstance(e, KeyError) and own is not None else []
        if not (lacks or does_not_fit(e)):
            raise
        reason = f"it lacks {', '.join(lacks[:3])}" if lacks else " ".join(str(e).split()) or type(e).__name__
        raise UserError(f"checkpoint {path} does not fit this run ({reason[:300]}); accepted: a checkpoint of "
                        "this config; remove it, set checkpoint.load_step, or use another job.dump_folder") from None


def missing_entries(own, saved, prefix: str = "") -> list[str]:
    """The dotted names of the dict entries `own` has and `saved` lacks, nested dicts followed."""
    if not isinstance(own, dict):
        return []
    if not isinstance(saved, dict):
        return [prefix.rstrip(".") or "its state"]
    lacks = []
    for key, value in own.items():
        if key not in saved:
            lacks.append(f"{prefix}{key}")
        else:
            lacks += missing_entries(value, saved[key], f"{prefix}{key}.")
    return lacks


def load_sharded(path: str, model, optimizer) -> None:
    """Model and optimizer state from a DCP folder, resharded to this run's layout; read
    without running any code the folder holds (mixprec.interop.dcp_read)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from mixprec.interop import dcp_read

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        dcp_read.load(state, path)
    except (CheckpointException, Exception) as e:  # DCP gathers each rank's errors into a CheckpointException
        failures = dcp_failures(e)
        if not all(unreadable(f) or does_not_fit(f) for f in failures):
            raise
        raise UserError(f"checkpoint {path} is corrupt or does not match this model ({type(failures[0]).__name__}: "
                        f"{' '.join(str(failures[0]).split())[:200]}); remove it or set checkpoint.load_step") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@contextlib.contextmanager
def keep_optimizer_kernels(optimizer):
    """Loading a state dict copies the saved param groups, the kernel choice included
    (fused, foreach); a checkpoint from another layout would bring one this run's
    parameters cannot use (the fused kernel takes no DTensors). Keep this run's."""
    kernels = [{k: g[k] for k in _KERNEL_KEYS if k in g} for g in optimizer.param_groups]
    yield
    for group, chosen in zip(optimizer.param_groups, kernels):
        group.update(chosen)


_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def load_full_into_sharded(model, optimizer, model_sd: dict, optim_sd: dict) -> None:
    """A one-process checkpoint (full tensors; optimizer state keyed by position, as
    torch.optim saves it) into a model with DTensor parameters (FSDP, tensor parallel):
    DCP's set_state_dict cuts each full tensor down to this rank's shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {p: n for n, p in model.named_parameters()}
    saved = [i for g in optim_sd["param_groups"] for i in g["params"]]
    ours = [names[p] for g in optimizer.param_groups for p in g["params"]]
    if len(saved) != len(ours):
        raise UserError(f"checkpoint optimizer state has {len(saved)} parameters, this model {len(ours)}; "
                        "remove it or set checkpoint.load_step")
    fqn = dict(zip(saved, ours))  # both optimizers list the parameters in the same order
    optim_sd = {"state": {fqn[i]: s for i, s in optim_sd["state"].items()},
                "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in optim_sd["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True))


def check_compatible(state: dict, meta: dict, path: Path) -> None:
    """The checkpoint was made for the same model and tokenizer as this run."""
    saved = state["meta"] if isinstance(state["meta"], dict) else {}
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs config {v!r}" for k, v in meta.items() if saved.get(k) != v]
    if diffs:
        raise UserError(
            f"checkpoint {path} does not match this config ({'; '.join(diffs)}); "
            "accepted: the config it was made with, or another job.dump_folder"
        )
