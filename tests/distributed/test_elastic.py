"""torchrun --max-restarts: a rank killed with SIGKILL, the group restarted, the run resumed
bit for bit, under the static and the c10d rendezvous."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_args

WORKER = Path(__file__).with_name("elastic_worker.py")
STEPS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(folder: Path, source: Path, rdzv: str, restarts: int = 1, extra: tuple = ()) -> list[str]:
    launch = ["--standalone"] if rdzv == "c10d" else ["--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                                                       "--master-port", str(_free_port())]
    args = tiny_args(folder, source, "--training.steps", str(STEPS), "--training.local_batch_size", "2",
                     "--training.eval_interval", "6", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
                     "--precision.preset", "fp32", "--parallelism.timeout_s", "30", *extra)
    return [sys.executable, "-m", "torch.distributed.run", *launch, "--nproc-per-node", "2", "--max-restarts",
            str(restarts), str(WORKER), *args]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "PYTHONPATH": str(Path(__file__).parent), **extra}


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, "the run ended before the moment to kill"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, text_file):
    """The runs read prepared shards: these tests are also the two-rank kill -9 resume on them."""
    from mixprec.data.prepare import run_prepare

    out = tmp_path_factory.mktemp("shards") / "shards"
    run_prepare(str(text_file), out, shard_mb=0.05, workers=1)
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shards):
    folder = tmp_path_factory.mktemp("whole") / "run"
    done = subprocess.run(_command(folder, shards, "static", restarts=0), env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _records(folder)


def _killed_run(folder: Path, source: Path, rdzv: str, moment: str) -> subprocess.CompletedProcess:
    """Rank 1 of the first attempt killed after the step-4 checkpoint (moment "after-checkpoint")
    or inside the step-8 save, step-4 complete ("during-save"); rank 1 of the restart starts 8 s
    late, so rank 0 reaches the process group first (and gives up on a stale address first)."""
    extra = {"MIXPREC_TEST_DELAY_RANK1": "8"}
    if moment == "during-save":
        extra["MIXPREC_TEST_SLOW_SAVE"] = "8:60"
    proc = subprocess.Popen(_command(folder, source, rdzv), env=_env(**extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if moment == "during-save":
            _wait_for(folder / "pids" / "saving", proc)  # the step-8 save: rank 0 is inside it
        else:
            _wait_for(folder / "checkpoint" / "step-4", proc)
        os.kill(int((folder / "pids" / "attempt0-rank1").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.parametrize("rdzv, moment", [("static", "after-checkpoint"), ("c10d", "after-checkpoint"),
                                          ("static", "during-save")])  # c10d during a save: the kill table
def test_a_killed_rank_restarts_and_the_run_resumes_bit_for_bit(tmp_path, shards, uninterrupted, rdzv, moment):
    folder = tmp_path / "run"
    done = _killed_run(folder, shards, rdzv, moment)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (folder / "pids" / "attempt1-rank1").exists()  # it did restart
    keys = ("step", "loss", "grad_norm", "val_loss")
    assert [[r.get(k) for k in keys] for r in _records(folder)] == [[r.get(k) for k in keys] for r in uninterrupted]
    log = done.stdout + done.stderr
    lost = "steps 5-8 are trained again" if moment == "during-save" else ""  # logged before the step-8 save
    assert "torchrun restart 1 of 1: resuming from step-4; " + lost in log, log[-3000:]
    assert not list((folder / "checkpoint").glob("*.tmp"))  # the torn step-8 save was never loaded, then redone


@pytest.mark.slow
def test_a_group_that_cannot_form_ends_in_one_line_within_the_timeout(tmp_path, text_file):
    """Rank 1 never starts (a second attempt's rank lost for good): rank 0 gives up after
    parallelism.timeout_s with one line, and torchrun exits non-zero."""
    args = tiny_args(tmp_path / "run", text_file, "--parallelism.timeout_s", "3")
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mixprec", *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and time.monotonic() - t0 < 60
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not form within 3 s" in lines[0], done.stderr


def test_max_restarts_without_checkpoints_warns_at_start(tmp_path, text_file, monkeypatch, capsys):
    from conftest import run_train

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    run_train(tmp_path / "run", text_file, "--checkpoint.enable", "false", "--training.steps", "1")
    warned = [line for line in capsys.readouterr().out.splitlines() if "--max-restarts" in line]
    assert len(warned) == 1 and "torchrun --max-restarts 3 with checkpoint.enable false: a restart begins again " \
        "at step 0" in warned[0]


EP = ("--model.flavor", "moe-debug", "--parallelism.expert_parallel_degree", "2")


@pytest.mark.slow
def test_a_rank_killed_inside_an_expert_parallel_dispatch_restarts_and_resumes_bit_for_bit(tmp_path, shards):
    """moe-debug with its experts on two ranks: rank 1 killed while rank 0 waits in a dispatch's all-to-all
    (step 6's first MoE layer, after the step-4 checkpoint); rank 0 ends within the collective timeout, torchrun
    restarts both, the run resumes from step-4 with the uninterrupted run's numbers."""
    whole = subprocess.run(_command(tmp_path / "whole", shards, "static", restarts=0, extra=EP), env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    folder = tmp_path / "run"
    # two MoE layers: each training step dispatches twice; call 11 is step 6's first
    proc = subprocess.Popen(_command(folder, shards, "static", extra=EP), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=_env(MIXPREC_TEST_SLOW_DISPATCH="11:60", MIXPREC_TEST_DELAY_RANK1="8"))
    try:
        _wait_for(folder / "pids" / "dispatching", proc)
        time.sleep(1)  # rank 0 inside the all-to-all
        os.kill(int((folder / "pids" / "attempt0-rank1").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, err[-4000:]
    assert (folder / "pids" / "attempt1-rank1").exists()
    keys = ("step", "loss", "grad_norm", "val_loss", "router_load")
    assert [[r.get(k) for k in keys] for r in _records(folder)] == \
        [[r.get(k) for k in keys] for r in _records(tmp_path / "whole")]
    assert "torchrun restart 1 of 1: resuming from step-4" in out + err
