"""torchrun restarts (`--max-restarts N`): each attempt's process group in a store namespace of
its own, bounded waits, and a log of what a restart resumes from and what it lost.

torchrun's agent keeps one TCPStore for the whole job and hands it to every attempt's workers
(TORCHELASTIC_USE_AGENT_STORE). The process group's keys -- gloo's and NCCL's peer addresses
among them -- outlive the attempt that wrote them: a restarted rank 0 that reaches
`init_process_group` before the restarted rank 1 reads the dead rank 1's address and fails
("Connection refused"), or waits on keys nobody will write. Every key of an attempt is put
under `mixprec/<run id>/attempt-<restart count>` here, so an attempt only ever meets its own
ranks. The restart count comes from the agent of each node (TORCHELASTIC_RESTART_COUNT), the
same for every rank of a node; on several nodes every agent restarts its workers when a rank
is lost (their collectives fail), so the counts agree. Where they cannot (an agent that joined
late), the attempt does not form within the timeout and ends with one line, not a hang.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

from mixprec.errors import GroupLost

logger = logging.getLogger(__name__)


def attempt() -> tuple[int, int]:
    """(this attempt's restart count, the restarts allowed) under torchrun; (0, 0) otherwise."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))


def init_group(backend: str, timeout_s: float) -> None:
    """Join this attempt's process group: torch's env:// rendezvous (the agent's store or rank
    0's), its keys under this attempt's namespace, every wait bounded by `timeout_s`."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    count, _ = attempt()
    namespace = f"mixprec/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/attempt-{count}"
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        dist.init_process_group(backend, store=dist.PrefixStore(namespace, store), rank=rank, world_size=world,
                                timeout=timeout)
    except (RuntimeError, ValueError) as e:  # torch's store and backend errors are RuntimeErrors
        raise GroupLost(f"the process group of {os.environ.get('WORLD_SIZE')} ranks did not form within "
                        f"{timeout_s:g} s (torchrun attempt {count}): {first_line(e)}") from None


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def check_restartable(checkpoints: bool) -> None:
    """A job that torchrun may restart but that writes no checkpoint restarts from step 0."""
    count, allowed = attempt()
    if allowed and not checkpoints and count == 0:
        logger.warning("torchrun --max-restarts %d with checkpoint.enable false: a restart begins again at step 0; "
                       "accepted: checkpoint.enable true (checkpoint.interval sets what a restart loses)", allowed)


def log_restart(resumed_step: int | None, last_logged: int) -> None:
    """On a restarted attempt: which checkpoint it resumes from, and which steps the attempt
    before logged (`last_logged`, metrics.jsonl's last step) that it trains again."""
    count, allowed = attempt()
    start = resumed_step or 0
    lost = ("no logged step is lost" if last_logged <= start else f"step {last_logged} is trained again"
            if last_logged == start + 1 else f"steps {start + 1}-{last_logged} are trained again")
    where = f"resuming from step-{resumed_step}" if resumed_step else "no checkpoint: starting at step 0"
    logger.warning("torchrun restart %d of %d: %s; %s", count, allowed, where, lost)
