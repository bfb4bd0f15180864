"""The training state: what a checkpoint holds and a rewind puts back, in every layout.

    state = TrainingState(parts, checkpoints)
    state.save()                 # one file from one process, sharded DCP folders under torchrun
    state.resume(load_step)      # the latest (or a chosen) checkpoint, if there is one
    snap = state.snapshot()      # the stability guard's in-memory copy
    state.rewind_to(snap)        # ... and back to it (None: the latest checkpoint)

Layouts it reads: a single-file checkpoint (one process or DDP; also loaded into FSDP2 or
tensor-parallel shards), a DCP folder of a torchrun run, and an in-memory snapshot of
either. The counters of the loop (step, best validation loss, evaluations without
improvement) live here, so that whatever restores the state restores them too.
"""

from __future__ import annotations

import logging
import math

from mixprec.errors import TrainingUnstable, UserError
from mixprec.interop.checkpoint import (CheckpointManager, check_compatible, keep_optimizer_kernels,
                                        load_full_into_sharded, load_sharded, restoring)
from mixprec.optim.adamw import AdamW
from mixprec.optim.saved_state import for_dense_optimizer
from mixprec.optim.state_formats import SCALE
from mixprec.rng import rng_state, set_rng_state
from mixprec.stability.guard import clone_state

logger = logging.getLogger(__name__)

FORMAT = 1


def _fit(optimizer, saved: dict, convert: bool) -> dict:
    """A single file's optimizer state for `optimizer`: mixprec's AdamW checks its own formats as it loads
    (AdamW.load_state_dict), any other optimizer gets it fit for dense moments (saved_state)."""
    return saved if isinstance(optimizer, AdamW) else for_dense_optimizer(optimizer, saved, convert)


def _dense_from_dcp(path, optimizer) -> None:
    """A DCP folder of quantized moments refused for an optimizer of dense moments (DCP would copy the codes
    into its moments as numbers): its metadata names the block scales."""
    if isinstance(optimizer, AdamW):  # it checks its own formats (AdamW.load_state_dict)
        return
    from mixprec.interop.dcp_read import SafeReader

    if any(key.endswith("exp_avg" + SCALE) for key in SafeReader(path).read_metadata().state_dict_metadata):
        raise UserError(f"optimizer state: {path} holds quantized moments, this run's {type(optimizer).__name__} "
                        "keeps dense moments; accepted: the saved moments (precision.optimizer_states); a sharded "
                        "checkpoint's moments are not converted")


class TrainingState:
    def __init__(self, parts, checkpoints: CheckpointManager | None, first_checkpoint_step: int = 0):
        self.parts = parts  # mixprec.train.build.Parts: model, optimizer, scheduler, loader, policy, ...
        self.checkpoints = checkpoints
        self.first_checkpoint_step = first_checkpoint_step  # for the message when a rewind has none yet
        self.guard = None  # the stability guard, once built: its record is saved too
        self.step, self.best_val, self.bad_evals = 0, math.inf, 0

    def _extras(self) -> dict:
        """Everything but the model and optimizer state."""
        p = self.parts
        return {
            "format": FORMAT,
            "meta": p.meta,
            "step": self.step,
            "scheduler": p.scheduler.state_dict(),
            "data": p.loader.state_dict(),
            "policy": p.policy.state_dict(),
            "rng": rng_state(p.device),
            "trainer": {"best_val": self.best_val, "bad_evals": self.bad_evals},
            "stability": self.guard.state_dict() if self.guard is not None else None,
        }

    def save(self) -> None:
        """Sharded DCP folders from sharded runs; one file otherwise, written by rank 0 (under
        DDP every rank holds the whole state: the masters of fp16-master and bf16-master too,
        which DCP's state-dict helpers cannot name, being no parameter of the model)."""
        p = self.parts
        if p.dims.sharded:
            self.checkpoints.save_sharded(self.step, p.model, p.optimizer, self._extras(), p.rank)
            return
        if p.rank == 0:
            self.checkpoints.save(self.step, {**self._extras(), "model": p.policy.model_state_dict(p.raw_model),
                                              "optimizer": p.optimizer.state_dict()})
        if p.dims.world_size > 1:
            import torch.distributed as dist

            dist.barrier()  # no rank reads a checkpoint rank 0 has not finished

    def resume(self, load_step: int) -> bool:
        """Restore the chosen checkpoint (-1: the latest); False when there is none."""
        state = self.checkpoints.load(load_step) if self.checkpoints is not None else None
        if state is None:
            return False
        self.restore(state)
        return True

    def restore(self, state: dict, rewind: bool = False) -> None:
        """A checkpoint (or, rewind True, a good state to go back to: the guard keeps its own record)."""
        p = self.parts
        check_compatible(state, p.meta, state["source"])
        with restoring(state["source"], from_user=not rewind, saved=state, own=self._extras):
            p.policy.load_state_dict(state["policy"])  # first: it may re-apply a fallback
            with keep_optimizer_kernels(p.optimizer):
                self._load_model_and_optimizer(state)
            p.scheduler.load_state_dict(state["scheduler"])
            p.loader.load_state_dict(state["data"])
            set_rng_state(state["rng"], p.device)
            self.step = int(state["step"])
            self.best_val, self.bad_evals = state["trainer"]["best_val"], state["trainer"]["bad_evals"]
            if self.guard is not None and state.get("stability") and not rewind:
                self.guard.load_state_dict(state["stability"])
        if not rewind:
            logger.info("checkpoint: resumed at step %d", self.step)

    def _load_model_and_optimizer(self, state: dict) -> None:
        p = self.parts
        convert = p.config.checkpoint.convert_optimizer_states
        if "dcp" in state:  # a torchrun run's folder
            _dense_from_dcp(state["dcp"], p.optimizer)
            load_sharded(state["dcp"], p.model, p.optimizer)
        elif "sharded" in state:  # an in-memory snapshot of a torchrun run
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

            model_sd, optim_sd = state["sharded"]
            if optim_sd is None:  # taken before the first step
                p.optimizer.state.clear()
                set_model_state_dict(p.model, model_sd)
            else:
                set_state_dict(p.model, p.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        elif p.dims.sharded:  # a single file into shards
            load_full_into_sharded(p.model, p.optimizer, state["model"], _fit(p.optimizer, state["optimizer"], convert))
        else:  # one process, or DDP: every rank loads the whole file
            optim_sd = _fit(p.optimizer, state["optimizer"], convert)  # refused before anything loads
            p.policy.load_model_state_dict(p.raw_model, state["model"])
            p.optimizer.load_state_dict(optim_sd)

    def snapshot(self) -> dict:
        """Everything a rewind puts back, copied (to CPU memory, or sharded on the device)."""
        p = self.parts
        if p.dims.sharded:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

            # get_state_dict fills an empty optimizer state by a step with zero gradients (its
            # step count would differ from an unguarded run's): before the first step, none
            empty = not p.optimizer.state
            state = {"sharded": (get_model_state_dict(p.model), None) if empty
                     else get_state_dict(p.model, p.optimizer)}
        else:
            state = {"model": p.policy.model_state_dict(p.raw_model), "optimizer": p.optimizer.state_dict()}
        return clone_state({**self._extras(), **state, "source": "memory snapshot"})

    def rewind_to(self, snapshot: dict | None):
        """Put a good state back, but not the data position: the batches since then are
        not replayed. None: the latest checkpoint."""
        data = self.parts.loader.state_dict()
        if snapshot is None:
            snapshot = self.checkpoints.load() if self.checkpoints is not None else None
            if snapshot is None:
                raise TrainingUnstable(f"step {self.step}: no checkpoint to rewind to yet (stability.snapshot_interval "
                                       f"0 uses checkpoints, the first comes at step {self.first_checkpoint_step})")
        self.restore({**snapshot, "data": data}, rewind=True)
        return self.step, (snapshot.get("stability") or {}).get("monitor")
