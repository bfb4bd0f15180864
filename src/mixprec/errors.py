"""Errors for users: bad config, CLI, data or checkpoint.

The CLI prints a UserError as one line and exits with code 2; anything else is a
bug and keeps its traceback.
"""

from pathlib import Path


class UserError(Exception):
    """Bad input from the user; the message names what is wrong and what is accepted."""


def user_path(value: str, key: str) -> Path:
    """`value` with a leading ~ expanded; the home of a user this machine does not have is one line naming `key`."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        raise UserError(f"{key} {value!r} names the home folder of a user this machine does not have; accepted: a "
                        "path on this machine") from None


def check_value(ok: bool, field: str, value, accepted: str) -> None:
    """A config field's check: when not `ok`, one line naming the field, its bad value and what is accepted."""
    if not ok:
        raise UserError(f"{field}: bad value {value!r}; accepted: {accepted}")


class TrainingUnstable(Exception):
    """Training kept going non-finite or spiking after every rewind allowed; the CLI prints
    the message as one line and exits with code 3. The last good checkpoint stays on disk."""


class GroupLost(Exception):
    """Under torchrun, the process group could not form within parallelism.timeout_s, or lost
    a rank: the CLI prints the message as one line and exits with code 1, and torchrun
    restarts the group while restarts are left."""


# ---- reading checkpoints: the user's file, or a defect -----------------------------------------
# A checkpoint that is not one, or that does not fit this run, is the user's bad input (one
# line, exit 2); anything else keeps its traceback (exit 1): a bug in mixprec, the machine
# running out of memory, a lost rank, a device error. Which one an exception is, is decided by
# where it was raised (the innermost frame of its traceback: a reader of bytes, or torch's
# own state-dict checks) and by what it is, never by its Python type alone: a RuntimeError
# from torch.load's zip reader is a damaged file, one from a collective is a lost rank.

# where reading a checkpoint's bytes or metadata raises: torch.load, its unpicklers, zip, DCP's
# file reader and mixprec's guarded one, safetensors, JSON
_READERS = ("torch/serialization.py", "torch/_weights_only_unpickler.py", "/pickle.py", "/zipfile",
            "torch/distributed/checkpoint/filesystem.py", "mixprec/interop/dcp_read.py", "safetensors/",
            "/json/")
# where torch says a state does not fit its module or optimizer (the planner: DCP's "Missing key")
_FITTERS = ("torch/optim/optimizer.py", "torch/nn/modules/module.py", "torch/distributed/checkpoint/")


def out_of_memory(e: BaseException) -> bool:
    """An allocator's failure: CUDA's OutOfMemoryError, or the CPU allocator's message."""
    import torch

    text = str(e)
    return (isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text
            or "not enough memory" in text)


def not_the_files_fault(e: BaseException) -> bool:
    """Out of memory, a lost rank (torch.distributed's DistError family: DistBackendError,
    DistNetworkError, DistStoreError) or a device error (CUDA's, an accelerator's): whatever
    was being read, these surface as themselves."""
    import torch

    if out_of_memory(e):
        return True
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e)
    return type(e).__name__ == "AcceleratorError" or "CUDA error" in text or "NCCL" in text


def _frames(e: BaseException) -> list[str]:
    """The file of each frame of e's traceback, innermost last (a DCP failure from another
    rank carries them as `frames`: dcp_failures)."""
    import traceback

    summary = getattr(e, "frames", None)
    if summary is None:
        summary = traceback.extract_tb(e.__traceback__)
    return [f.filename.replace("\\", "/") for f in summary]


def _raised_in(e: BaseException, places) -> bool:
    frames = _frames(e)
    return bool(frames) and any(p in frames[-1] for p in places)


def unreadable(e: BaseException) -> bool:
    """A file that is not a checkpoint: reading its bytes or its metadata failed (not a zip or
    pickle, cut short, refused by weights_only, not readable), as raised by a reader."""
    import pickle
    import zipfile

    if not_the_files_fault(e):
        return False
    if isinstance(e, (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, UnicodeDecodeError)):
        return True  # only readers raise these
    if isinstance(e, AssertionError):  # DCP's loader restates its reader's failure to read the metadata
        return "metadata read failed" in str(e) and _raised_in(e, ("torch/distributed/checkpoint/",))
    return isinstance(e, (OSError, ValueError, RuntimeError)) and _raised_in(e, _READERS)


def does_not_fit(e: BaseException) -> bool:
    """torch's word that a state was written for another model or optimizer: load_state_dict's
    missing, unexpected or differently shaped tensors, torch.optim's parameter groups of another
    size, DCP's missing keys. (A key the checkpoint lacks where mixprec's own restore reads it is
    found by comparison: interop.checkpoint.restoring.)"""
    if not_the_files_fault(e):
        return False
    if isinstance(e, RuntimeError) and str(e).startswith("Error(s) in loading state_dict"):
        return True
    return isinstance(e, (KeyError, ValueError, RuntimeError)) and _raised_in(e, _FITTERS)


def dcp_failures(e: BaseException) -> list[BaseException]:
    """The exceptions each rank raised inside a DCP CheckpointException (a BaseException that
    gathers them, each with its traceback's frames, kept as `frames`: another rank's exception
    comes pickled, without its traceback); any other exception is its own one failure."""
    if not hasattr(e, "failures"):
        return [e]
    found = []
    for failure in e.failures.values():
        exc, frames = failure if isinstance(failure, tuple) else (failure, None)
        if frames is not None and not exc.__traceback__:
            exc.frames = frames
        found.append(exc)
    return found
