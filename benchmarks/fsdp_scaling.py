"""Two FSDP2 ranks against one process on the same machine, same global batch.

One process uses every core (torch's default threads); under torchrun each rank gets
cores / ranks threads. Prints aggregate tokens/s of both and the ratio.

    python benchmarks/fsdp_scaling.py --steps 12 --preset bf16-mixed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="small")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--preset", default="bf16-mixed")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--reshard-after-forward", default="default", choices=["default", "always", "never"])
    p.add_argument("--out", default="outputs/bench_fsdp")
    args = p.parse_args()
    common = ["train", "--model.flavor", args.flavor, "--training.steps", str(args.steps), "--precision.preset",
              args.preset, "--checkpoint.enable", "false", "--metrics.progress_bar", "false", "--metrics.plot",
              "false", "--training.eval_interval", "0", "--training.eval_batches", "1"]
    cores = os.cpu_count()
    # one process keeps torch's default threads; each rank gets its share of the cores
    ranks_env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // args.ranks))}
    runs = {
        "1 process": (os.environ, [sys.executable, "-m", "mixprec", *common, "--job.dump_folder", f"{args.out}/single",
                      "--training.local_batch_size", str(args.global_batch)]),
        f"{args.ranks} FSDP2 ranks": (ranks_env, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc-per-node", str(args.ranks), "-m", "mixprec", *common,
                                      "--job.dump_folder", f"{args.out}/fsdp",
                                      "--parallelism.fsdp_reshard_after_forward", args.reshard_after_forward,
                                      "--training.local_batch_size", str(args.global_batch // args.ranks)]),
    }
    speeds = {}
    for name, (env, cmd) in runs.items():
        print(f"--- {name}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True, env=env)
        folder = Path(cmd[cmd.index("--job.dump_folder") + 1])
        speeds[name] = json.loads((folder / "summary.json").read_text())["tokens_per_sec"]
    single, multi = speeds.values()
    print(f"\n{args.flavor}, {args.preset}, global batch {args.global_batch} x 256 tokens, {cores} cores, "
          f"reshard_after_forward {args.reshard_after_forward}")
    for name, v in speeds.items():
        print(f"{name:<16} {v:8.0f} tokens/s")
    print(f"ratio {multi / single:.2f}x")


if __name__ == "__main__":
    main()
