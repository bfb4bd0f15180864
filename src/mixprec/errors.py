"""Errors for users: bad config, CLI, data or checkpoint.

The CLI prints a UserError as one line and exits with code 2; anything else is a
bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user; the message names what is wrong and what is accepted."""


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
# line, exit 2); a bug in mixprec, or the machine running out of memory, is not, and keeps its
# traceback (exit 1). These say which an exception raised while reading or restoring one is.

def out_of_memory(e: BaseException) -> bool:
    """An allocator's failure: CUDA's OutOfMemoryError, or the CPU allocator's message."""
    import torch

    text = str(e)
    return (isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text
            or "not enough memory" in text)


def unreadable(e: BaseException) -> bool:
    """torch.load's (or DCP's reader's) errors for a file that is not a checkpoint: not a zip
    or pickle, cut short, refused by weights_only, or not readable."""
    import pickle
    import zipfile

    return not out_of_memory(e) and isinstance(
        e, (pickle.UnpicklingError, EOFError, OSError, zipfile.BadZipFile, UnicodeDecodeError, ValueError, RuntimeError))


def does_not_fit(e: BaseException) -> bool:
    """A restore's errors that mean the checkpoint was written by another run: a key it lacks
    (KeyError), torch.optim's parameter groups of another size (ValueError), or
    load_state_dict's missing, unexpected or differently shaped tensors."""
    if out_of_memory(e):
        return False
    return isinstance(e, (KeyError, ValueError)) or (
        isinstance(e, RuntimeError) and str(e).startswith("Error(s) in loading state_dict"))


def dcp_failures(e: BaseException) -> list[BaseException]:
    """The exceptions each rank raised inside a DCP CheckpointException (a BaseException that
    gathers them); any other exception is its own one failure."""
    if not hasattr(e, "failures"):
        return [e]
    return [failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()]
