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
