"""Validation loss of each preset over several `mixprec compare` runs that differ only in
training.seed, against a reference preset seed by seed: is a difference between two
modes larger than what the seed alone moves?

    mixprec compare --presets bf16-mixed,bf16-kahan --training.seed 1 --job.dump_folder runs/seed1
    ...
    python benchmarks/seed_spread.py runs/seed0 runs/seed1 runs/seed2 [--reference bf16-mixed] [--plot out.png]

Runs of the same seed are merged (each preset's seed is read from its own config.toml), so
one seed's presets may come from several compare runs; a preset given twice for one seed is
refused. FOLDER:PRESET,PRESET takes only those presets of a run. A run that stopped before
its compare.json (a preset failed) gives the presets that finished, said on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tomllib
from pathlib import Path


def read_runs(folders: list[str]) -> dict[int, dict[str, float]]:
    """{seed: {preset: final validation loss}} over the compare run folders."""
    by_seed: dict[int, dict[str, float]] = {}
    for spec in folders:
        folder, _, only = spec.partition(":")
        for row in _rows(Path(folder)):
            if only and row["preset"] not in only.split(","):
                continue
            config = tomllib.loads((Path(folder) / row["preset"] / "config.toml").read_text())
            seed = config["training"]["seed"]
            losses = by_seed.setdefault(seed, {})
            if row["preset"] in losses:
                sys.exit(f"{folder}: preset {row['preset']} at seed {seed} is in more than one run; give it once")
            losses[row["preset"]] = row["final_val_loss"]
    return dict(sorted(by_seed.items()))


def _rows(folder: Path) -> list[dict]:
    """A compare run's rows (preset, final_val_loss): its compare.json, or where the run stopped
    before writing it (a preset failed), the presets that finished (each folder's summary.json)."""
    if (folder / "compare.json").is_file():
        return json.loads((folder / "compare.json").read_text())["presets"]
    finished = [json.loads(f.read_text()) | {"preset": f.parent.name} for f in sorted(folder.glob("*/summary.json"))
                if (f.parent / "config.toml").is_file()]
    if not finished:
        sys.exit(f"{folder}: no compare.json and no finished preset (not a mixprec compare run folder)")
    print(f"{folder}: no compare.json; the presets that finished: {', '.join(r['preset'] for r in finished)}",
          file=sys.stderr)
    return finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="mixprec compare run folders (each holds compare.json), FOLDER:PRESET,... for some of a run's presets")
    parser.add_argument("--reference", default="bf16-mixed")
    parser.add_argument("--plot", help="also draw each preset's difference per seed and its mean into this PNG")
    args = parser.parse_args()
    by_seed = read_runs(args.folders)
    runs = list(by_seed.values())
    presets = [p for p in runs[0] if all(p in run for run in runs)]
    if args.reference not in presets:
        sys.exit(f"--reference {args.reference}: not in every seed; accepted: {', '.join(presets)}")
    print(f"{'preset':<16} " + " ".join(f"{'seed ' + str(s):>9}" for s in by_seed)
          + f" {'mean':>8}  vs {args.reference}: mean (per seed)")
    for p in presets:
        losses = [run[p] for run in runs]
        diffs = [run[p] / run[args.reference] - 1 for run in runs]
        print(f"{p:<16} " + " ".join(f"{x:9.4f}" for x in losses) + f" {statistics.mean(losses):8.4f}  "
              f"{statistics.mean(diffs):+.2%} (" + ", ".join(f"{d:+.2%}" for d in diffs) + ")")
    if args.plot:
        plot(by_seed, presets, args.reference, args.plot)


def plot(by_seed: dict[int, dict[str, float]], presets: list[str], reference: str, out: str) -> None:
    from mixprec.reporting import pyplot

    plt = pyplot()
    others = [p for p in presets if p != reference]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(others), 3.8))
    for i, p in enumerate(others):
        diffs = [100 * (run[p] / run[reference] - 1) for run in by_seed.values()]
        ax.bar(i, statistics.mean(diffs), color="0.85", edgecolor="0.4")
        for seed, d in zip(by_seed, diffs):
            ax.plot(i, d, "o", color=f"C{seed % 10}", label=f"seed {seed}" if i == 0 else None)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(others)), others, rotation=15, fontsize=8)
    ax.set_ylabel(f"final validation loss vs {reference} (%)")
    ax.set_title("bars: mean over seeds; dots: each seed", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
