"""Seconds and MB/s of `mixprec export` on a real checkpoint of the 1B flavor (1.24B
parameters, Llama-3 shapes, FP32 weights: ~5 GB), the AdamW moments in the same file (as
`mixprec train` writes it: ~15 GB) so that the figure includes not reading them.

    python benchmarks/export_speed.py                 # 1B; bfloat16 and float32 exports
    python benchmarks/export_speed.py --flavor small  # a quick look

The checkpoint is written to a temporary folder first (not timed), then each export runs
alone; the page cache is as the checkpoint's writing left it (warm), stated with the figure.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from mixprec.runs.export import export
from mixprec.models.llama import build_model, model_args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--no-optimizer", action="store_true", help="a checkpoint of the weights only")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    try:
        t0 = time.perf_counter()
        margs = model_args(args.flavor, 256)
        model = build_model(margs, device="cpu", storage_dtype=torch.float32, seed=0)
        weights, n_params = model.state_dict(), model.num_params()
        optimizer = {} if args.no_optimizer else {
            "state": {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                      for i, p in enumerate(model.parameters())}, "param_groups": []}
        state = {"format": 1, "meta": {**margs.architecture(), "tokenizer": "byte"}, "step": 1, "model": weights,
                 "optimizer": optimizer}
        (tmp / "checkpoint").mkdir()
        torch.save(state, tmp / "checkpoint" / "step-1.pt")
        size = (tmp / "checkpoint" / "step-1.pt").stat().st_size
        del model, weights, optimizer, state
        print(f"{args.flavor}: {n_params / 1e9:.2f}B parameters, checkpoint "
              f"{size / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s; CPU "
              f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
        for dtype in (torch.bfloat16, torch.float32):
            result = export(tmp / "checkpoint" / "step-1.pt", tmp / f"out-{dtype}", dtype=dtype)
            print(f"export {str(dtype).removeprefix('torch.'):>8}: {len(result['files'])} file(s), "
                  f"{result['bytes'] / 1e6:,.0f} MB in {result['seconds']:.1f} s = {result['bytes'] / 1e6 / result['seconds']:,.0f} MB/s "
                  "written")
            shutil.rmtree(tmp / f"out-{dtype}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
