"""fp32 vs bf16-mixed vs bf16-true on the same job, side by side.

Each mode trains in its own process (so peak memory is its own) with the same seed
and data; the script prints validation-loss, throughput and memory ratios against
fp32 and writes a plot of the loss curves.

    python benchmarks/precision_modes.py --steps 200 --out outputs/bench_modes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODES = ["fp32", "bf16-mixed", "bf16-true"]  # the default set; --modes picks others


def run(mode: str, folder: Path, args, extra: list[str]) -> dict:
    if args.reuse and (folder / "summary.json").exists():
        print(f"--- {mode}: reusing {folder / 'summary.json'}")
        return json.loads((folder / "summary.json").read_text())
    cmd = [sys.executable, "-m", "mixprec", "train", "--model.flavor", args.flavor,
           "--training.steps", str(args.steps), "--precision.preset", mode.split("+")[0],
           "--job.dump_folder", str(folder), "--checkpoint.enable", "false",
           "--metrics.progress_bar", "false", "--metrics.log_freq", "50",
           "--training.eval_interval", str(args.eval_interval), *extra]
    print(f"--- {mode}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    summary = json.loads((folder / "summary.json").read_text())
    summary["wall_s"] = time.perf_counter() - start
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="small")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--native-steps", type=int, default=2,
                   help="steps of bf16-mixed with the native BF16 kernel (emulation off); 0 skips")
    p.add_argument("--out", default="outputs/bench_modes")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated presets; the first is the baseline")
    p.add_argument("--reuse", action="store_true", help="reuse runs whose summary.json exists in --out")
    args = p.parse_args()
    out = Path(args.out)
    modes = args.modes.split(",")
    results = {mode: run(mode, out / mode, args, []) for mode in modes}
    if args.native_steps:
        native = argparse.Namespace(**{**vars(args), "steps": args.native_steps})
        results["bf16-mixed+native"] = run("bf16-mixed+native", out / "bf16-mixed-native", native,
                                           ["--precision.emulate_matmul", "false"])
    base = results[modes[0]]
    print(f"\n{'mode':<20}{'val loss':>10}{'rel diff':>10}{'overflow':>9}{'tok/s':>10}{'speed x':>9}"
          f"{'peak RSS MiB':>14}{'mem x':>7}{'param+opt MiB':>15}{'x':>6}")
    for mode, s in results.items():
        state = s["param_bytes"] + s["optimizer_state_bytes"]
        base_state = base["param_bytes"] + base["optimizer_state_bytes"]
        rel = (s["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
        print(f"{mode:<20}{s['final_val_loss']:>10.4f}{rel:>+10.2%}{s.get('overflow_rate', 0):>9.1%}"
              f"{s['tokens_per_sec']:>10.0f}"
              f"{s['tokens_per_sec'] / base['tokens_per_sec']:>9.2f}{s['peak_memory_bytes'] / 2**20:>14.0f}"
              f"{s['peak_memory_bytes'] / base['peak_memory_bytes']:>7.2f}{state / 2**20:>15.1f}"
              f"{state / base_state:>6.2f}")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(out, modes)


def plot(out: Path, modes: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in modes:
        records = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines()]
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=f"{mode} train", linewidth=0.8)
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        ax.plot(*zip(*val), "o--", label=f"{mode} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_ylim(top=4.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_by_mode.png", dpi=110)
    print(f"plot: {out / 'loss_by_mode.png'}")


if __name__ == "__main__":
    main()
