"""torchrun's entry point for the restart tests: `mixprec train`, with what a test needs to
lose the race on purpose and to kill a rank at a chosen moment.

- MIXPREC_TEST_DELAY_RANK1: seconds rank 1 of a restarted attempt waits before starting, so
  rank 0 reaches the process group first (the order that read a dead rank's address).
- MIXPREC_TEST_SLOW_SAVE=STEP:SECONDS: rank 1 of the first attempt sleeps on entering the
  sharded save of step STEP, while rank 0 waits inside it, so a test can kill it while that
  checkpoint is being written (its step-STEP.tmp folder exists, incomplete).
- MIXPREC_TEST_SLOW_DISPATCH=CALL:SECONDS: rank 1 of the first attempt sleeps on entering its
  CALL-th expert-parallel dispatch, while rank 0 waits inside that dispatch's all-to-all.
Each rank writes its pid to DUMP/pids/attempt<N>-rank<R>.
"""

import os
import sys
import time
from pathlib import Path

rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
folder = Path(sys.argv[sys.argv.index("--job.dump_folder") + 1])
(folder / "pids").mkdir(parents=True, exist_ok=True)
(folder / "pids" / f"attempt{attempt}-rank{rank}").write_text(str(os.getpid()))
if rank == 1 and attempt > 0:
    time.sleep(float(os.environ.get("MIXPREC_TEST_DELAY_RANK1", "0")))
slow = os.environ.get("MIXPREC_TEST_SLOW_SAVE", "")
if slow and rank == 1 and attempt == 0:
    import torch.distributed.checkpoint as dcp

    step, seconds = slow.split(":")
    save = dcp.save

    def slow_save(*args, **kwargs):
        if str(kwargs.get("checkpoint_id", "")).endswith(f"step-{step}.tmp"):
            (folder / "pids" / "saving").write_text(str(kwargs["checkpoint_id"]))
            time.sleep(float(seconds))  # rank 0 is inside the save, waiting for this rank's part
        return save(*args, **kwargs)

    dcp.save = slow_save

dispatch = os.environ.get("MIXPREC_TEST_SLOW_DISPATCH", "")
if dispatch and rank == 1 and attempt == 0:
    from mixprec.distributed.expert_parallel import ExpertParallel

    call, seconds = (int(v) for v in dispatch.split(":"))
    send, calls = ExpertParallel.send, []

    def slow_send(self, *args):
        calls.append(1)
        if len(calls) == call:  # rank 0 waits inside this dispatch's all-to-all
            (folder / "pids" / "dispatching").write_text(str(call))
            time.sleep(seconds)
        return send(self, *args)

    ExpertParallel.send = slow_send

from mixprec.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
