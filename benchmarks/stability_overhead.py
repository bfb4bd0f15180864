"""What the stability guard costs a clean run: its per-step check and its snapshots,
against the training step itself, measured side by side in one process.

Two trainers of the same config, one with the guard and one without, take their steps
in turns (so both see the same machine load). Reported: the guard's own time (its
after_step, snapshots included) as a share of the guarded trainer's step time, and the
median step times of the two trainers.

    python benchmarks/stability_overhead.py [--flavor debug] [--steps 200] [--snapshot-interval 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from mixprec.config import load_config
from mixprec.train.trainer import Trainer


def trainer(folder: str, flavor: str, steps: int, guard: bool, snapshot_interval: int, device: str) -> Trainer:
    overrides = {"model.flavor": flavor, "training.steps": str(steps), "training.device": device,
                 "checkpoint.enable": "false", "job.dump_folder": folder, "stability.enable": str(guard).lower(),
                 "stability.snapshot_interval": str(snapshot_interval)}
    return Trainer(load_config(None, overrides))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--snapshot-interval", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        on = trainer(f"{tmp}/on", args.flavor, args.steps, True, args.snapshot_interval, args.device)
        off = trainer(f"{tmp}/off", args.flavor, args.steps, False, args.snapshot_interval, args.device)
        on.guard.start(0)
        step_on, step_off, guard_time, snapshot_time = [], [], [], 0.0
        take = on.guard._take

        def timed_take(step):  # the snapshot's share of the guard's time
            nonlocal snapshot_time
            t = time.perf_counter()
            take(step)
            snapshot_time += time.perf_counter() - t
        on.guard._take = timed_take
        for step in range(1, args.steps + 1):
            for t, times in ((off, step_off), (on, step_on)):
                t0 = time.perf_counter()
                loss, result = t.train_step()
                loss = loss.item()  # the read the loop makes at its read steps, here every step
                result.read()
                times.append(time.perf_counter() - t0)
                t.step = step
            t0 = time.perf_counter()
            assert on.guard.after_step(step, loss, result, on._rerun()) == step
            guard_time.append(time.perf_counter() - t0)
            if step % 50 == 0:
                print(f"step {step}/{args.steps}", flush=True)
    total_step = sum(step_on)
    print(f"\n{args.flavor} flavor, {args.steps} steps, snapshot every {args.snapshot_interval} steps, {args.device}")
    print(f"median step: guarded {statistics.median(step_on) * 1e3:.1f} ms, unguarded "
          f"{statistics.median(step_off) * 1e3:.1f} ms (ratio {statistics.median(step_on) / statistics.median(step_off):.3f})")
    print(f"guard: {sum(guard_time) * 1e3:.1f} ms in all = {100 * sum(guard_time) / total_step:.3f}% of step time "
          f"(health checks {100 * (sum(guard_time) - snapshot_time) / total_step:.3f}%, "
          f"snapshots {100 * snapshot_time / total_step:.3f}%; median check {statistics.median(guard_time) * 1e6:.0f} us)")
    if incidents := on.guard.incidents:
        print(f"incidents on this clean run: {len(incidents)} (false positives)")


if __name__ == "__main__":
    main()
