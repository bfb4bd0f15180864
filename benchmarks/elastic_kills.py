"""Kill a rank at random moments of torchrun jobs with --max-restarts 1 and check each job
finishes with the uninterrupted run's numbers: the kill table of the restart issue.

    python benchmarks/elastic_kills.py --kills 10 --out runs/kills

Each job trains the debug flavor on two gloo ranks (FSDP2, fp32, 12 steps, a checkpoint every
4); one rank of the first attempt (0 or 1, at random) gets SIGKILL in turn during start-up (at
a random time in its first 3 s), after a random step, or inside the step-8 save (rank 1 pauses
there, rank 0 waits in it). The rendezvous alternates static / c10d. Where the kill landed is
read from the run folder at that moment. One job at a
time; prints a table and exits 1 if any job failed or differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))
sys.path.insert(0, str(HERE / "tests" / "distributed"))

from test_elastic import STEPS, _command, _env, _records  # noqa: E402


def corpus(out: Path) -> Path:
    import argparse as a, difflib, inspect, json as j, pathlib, textwrap  # noqa: E401

    path = out / "corpus.txt"
    path.write_text("\n".join(inspect.getsource(m) for m in (a, difflib, j.decoder, pathlib, textwrap)))
    return path


def where(folder: Path) -> str:
    ckpt = folder / "checkpoint"
    if ckpt.is_dir() and any(p.suffix == ".tmp" for p in ckpt.iterdir()):
        return "save"
    if not (folder / "metrics.jsonl").is_file() or not (folder / "metrics.jsonl").read_text().strip():
        return "start-up"
    return f"step {len(_records(folder)) + 1}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--out", default="runs/kills")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = corpus(out)
    t0 = time.perf_counter()
    ref = subprocess.run(_command(out / "whole", source, "static", restarts=0), env=_env(), capture_output=True,
                         text=True)
    length = time.perf_counter() - t0
    if ref.returncode:
        sys.exit(ref.stderr[-2000:])
    keys = ("step", "loss", "grad_norm", "val_loss")
    expected = [[r.get(k) for k in keys] for r in _records(out / "whole")]
    rng, rows, bad = random.Random(args.seed), [], 0
    for i in range(args.kills):
        rdzv, rank, moment = ("static", "c10d")[i % 2], rng.randrange(2), ("start-up", "step", "save")[i % 3]
        folder = out / f"job{i}"
        extra = {"MIXPREC_TEST_DELAY_RANK1": "2"}
        if moment == "save":  # rank 1 of the first attempt pauses on entering the step-8 save
            extra["MIXPREC_TEST_SLOW_SAVE"] = "8:60"
        t0 = time.perf_counter()
        proc = subprocess.Popen(_command(folder, source, rdzv), env=_env(**extra), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        pid_file = folder / "pids" / f"attempt0-rank{rank}"
        at, target = rng.uniform(0.5, 3.0), rng.randrange(1, STEPS - 1)  # drawn for every job: a fixed sequence
        if moment == "start-up":  # a random moment before the first step
            until = lambda: time.perf_counter() - t0 > at  # noqa: E731
        elif moment == "step":  # after a random step's record
            until = lambda: (folder / "metrics.jsonl").is_file() and len(_records(folder)) >= target  # noqa: E731
        else:
            until = lambda: (folder / "pids" / "saving").is_file()  # noqa: E731
        while not (pid_file.is_file() and until()) and proc.poll() is None:
            time.sleep(0.005)
        delay = time.perf_counter() - t0
        moment = "after the end" if proc.poll() is not None else where(folder)
        if proc.poll() is None:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        try:
            log, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, code = "", "hung"
        else:
            code = proc.returncode
        same = code == 0 and [[r.get(k) for k in keys] for r in _records(folder)] == expected
        resumed = next((line.split("restart 1 of 1: ")[1] for line in log.splitlines()
                        if "torchrun restart 1 of 1" in line), "-")
        bad += not same
        rows.append((i, rdzv, rank, f"{delay:.1f}", moment, code, resumed, "yes" if same else "NO",
                     f"{time.perf_counter() - t0:.0f}"))
        print(rows[-1], file=sys.stderr, flush=True)
    print(f"uninterrupted run: {length:.1f} s")
    print("| job | rendezvous | rank killed | at (s) | during | exit | restart log | bit-identical | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
