"""Does a change move any number? Train every preset for a few debug-flavor steps from the
same seed in two trees -- commit REF and the working tree -- on this machine, and compare
metrics.jsonl (loss, grad norm, loss scale, skipped) and the final checkpoint's tensors.

    python benchmarks/same_numbers.py REF                  # every preset, one process each
    python benchmarks/same_numbers.py REF --fsdp bf16-mixed,fp16-mixed   # also two gloo ranks
    python benchmarks/same_numbers.py REF --extra "--model.hf_config runs/moe/config --data.tokenizer byte"

Prints one line per run: "bit-identical", or the first field that differs with the largest
relative difference. Exit code 1 when anything differs. The trees run one after the other
(never two torch processes at once on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
RECORD_KEYS = ("loss", "grad_norm", "loss_scale", "skipped", "val_loss")


def export(ref: str, into: Path) -> Path:
    """The tree of commit `ref`, as git has it (no working-tree changes)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(HERE), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def train_args(tree: Path, folder: Path, preset: str, steps: int, extra=()) -> list[str]:
    return ["train", "--config", str(tree / "configs" / "debug.toml"), *extra, "--precision.preset", preset,
            "--training.steps", str(steps), "--training.device", "cpu", "--training.eval_interval", "0",
            "--training.warmup_steps", "2", "--training.eps", "1e-4" if preset == "fp16-true" else "1e-8",
            "--checkpoint.interval", str(steps), "--job.dump_folder", str(folder), "--metrics.plot", "false",
            "--metrics.progress_bar", "false", "--stability.enable", "false"]


def run_tree(tree: Path, out: Path, presets: list[str], fsdp: list[str], steps: int, extra=()) -> None:
    """Every preset of `presets` in one process (this script's --worker mode, importing the
    tree's own mixprec), then each of `fsdp` under torchrun on two gloo ranks."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
           "PYTHONPATH": str(tree / "src")}
    if presets:
        subprocess.run([sys.executable, __file__, "--worker", str(tree), str(out), str(steps), json.dumps(extra),
                        *presets],
                       check=True, env=env, cwd=tree)
    for preset in fsdp:
        args = train_args(tree, out / f"fsdp-{preset}", preset, steps, extra)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "mixprec", *args, "--training.local_batch_size", "4",
                        "--parallelism.data_parallel_shard_degree", "2"],
                       check=True, env=env, cwd=tree, capture_output=True)


def worker(tree: str, out: str, steps: str, extra: str, presets: list[str]) -> None:
    import logging

    from mixprec.cli import main

    logging.disable(logging.WARNING)
    for preset in presets:
        code = main(train_args(Path(tree), Path(out) / preset, preset, int(steps), json.loads(extra)))
        print(f"  {Path(tree).name}: {preset} exit {code}", flush=True)


def _final_state(folder: Path) -> dict:
    """The last checkpoint's tensors by name: model.*, optimizer.* (a DCP folder is read whole)."""
    import torch

    ckpts = sorted((folder / "checkpoint").glob("step-*"), key=lambda p: int(p.name.split("-")[1].split(".")[0]))
    path = ckpts[-1]
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        flat = path.parent / "flat.pt"
        dcp_to_torch_save(path, flat)
        state = torch.load(flat, weights_only=False)
    else:
        state = torch.load(path, weights_only=False)
    tensors = {}

    def walk(prefix, value):
        if torch.is_tensor(value):
            tensors[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)

    walk("model", state["model"])
    walk("optimizer", state["optimizer"])
    return tensors


def _rel(a: float, b: float) -> float:
    if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        return 0.0
    if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def compare(old: Path, new: Path) -> str:
    import torch

    a = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (new / "metrics.jsonl").read_text().splitlines()]
    if len(a) != len(b):
        return f"DIFFERENT: {len(a)} vs {len(b)} steps"
    worst = (0.0, "")
    for ra, rb in zip(a, b):
        for key in RECORD_KEYS:
            r = _rel(ra.get(key), rb.get(key))
            if r > worst[0]:
                worst = (r, f"step {ra['step']} {key}: {ra.get(key)} vs {rb.get(key)}")
    sa, sb = _final_state(old), _final_state(new)
    if sa.keys() != sb.keys():
        return f"DIFFERENT checkpoint keys: only old {sorted(sa.keys() - sb.keys())[:3]}, " \
               f"only new {sorted(sb.keys() - sa.keys())[:3]}"
    for key in sa:
        x, y = sa[key], sb[key]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"DIFFERENT {key}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        if not torch.equal(x, y) and not (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                                          and torch.equal(x.nan_to_num(), y.nan_to_num())):
            d = (x.double() - y.double()).abs().max().item() / max(x.double().abs().max().item(), 1e-30)
            if d > worst[0]:
                worst = (d, f"checkpoint {key}")
    if worst[0] == 0:
        return f"bit-identical ({len(a)} steps, {len(sa)} checkpoint tensors)"
    return f"DIFFERENT: largest relative difference {worst[0]:.3g} at {worst[1]}"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:6], sys.argv[6:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="the commit to compare the working tree against")
    parser.add_argument("--presets", default="", help="comma-separated presets (default: every preset)")
    parser.add_argument("--fsdp", default="", help="comma-separated presets to run on two gloo ranks too")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--extra", default="", help='more train arguments, e.g. "--model.flavor moe-debug"')
    args = parser.parse_args()
    sys.path.insert(0, str(HERE / "src"))
    from mixprec.precision.presets import PRESETS

    presets = args.presets.split(",") if args.presets else list(PRESETS)
    fsdp = [p for p in args.fsdp.split(",") if p]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        old_tree = export(args.ref, tmp / "old")
        for name, tree in (("old", old_tree), ("new", HERE)):
            print(f"{name}: {tree}", flush=True)
            run_tree(tree, tmp / f"{name}-runs", presets, fsdp, args.steps, shlex.split(args.extra))
        different = 0
        for run in presets + [f"fsdp-{p}" for p in fsdp]:
            if not (tmp / "old-runs" / run / "metrics.jsonl").is_file():  # a preset REF does not have
                print(f"{run:<22} new: {args.ref} has no such preset")
                continue
            verdict = compare(tmp / "old-runs" / run, tmp / "new-runs" / run)
            different += not verdict.startswith("bit-identical")
            print(f"{run:<22} {verdict}")
    print("same numbers" if not different else f"{different} run(s) differ")
    return 1 if different else 0


if __name__ == "__main__":
    raise SystemExit(main())
