"""Peak memory of loading a pretrained Hugging Face Llama folder through `mixprec train`'s
builder: one process against two FSDP2 ranks (gloo, CPU), each rank's peak resident memory
during `build(config)` over its resident memory before, against the model's bytes.

    python benchmarks/load_memory.py                      # ~150M parameters, FP32, shards of ~200 MB
    python benchmarks/load_memory.py --dim 512 --layers 4 # smaller

A rank of two should hold about half the model (its FSDP2 shard) plus what reading one tensor
needs; the bound the loader is held to is 0.6x the model plus one shard file. Peaks are read
from /proc/self/status (VmHWM, reset through /proc/self/clear_refs). The runs go one after
the other, never two timings at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def worker(hf: str, text: str, out: str) -> None:
    """One rank: build the run (model sharded, then loaded) and write its memory figures."""
    from mixprec.config import load_config
    from mixprec.distributed.parallel import exit_process_group, init_distributed
    from mixprec.train.build import build
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = load_config(None, {"checkpoint.initial_load": hf, "data.source": text, "job.dump_folder": out,
                                "precision.preset": "fp32", "training.device": "cpu", "training.seq_len": "64",
                                "parallelism.data_parallel_shard_degree": str(world), "checkpoint.enable": "false"})
    if world > 1:
        init_distributed(torch.device("cpu"))  # the group's own buffers before the baseline
    before = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    parts = build(config)
    peak = _rss("VmHWM")
    held = sum(p.to_local().numel() * 4 if hasattr(p, "to_local") else p.numel() * 4
               for p in parts.raw_model.parameters())
    rank = int(os.environ.get("RANK", "0"))
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"memory-{world}-{rank}.json").write_text(json.dumps({"peak": peak - before, "held": held}))
    if world > 1:
        exit_process_group(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=float, default=200)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    import torch

    from mixprec.interop.adapters import LlamaAdapter
    from mixprec.interop.hf_folder import write_folder
    from mixprec.models.llama import ModelArgs, build_model

    tmp = Path(tempfile.mkdtemp())
    margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, n_kv_heads=args.dim // 128,
                      vocab_size=args.vocab, max_seq_len=512)
    model = build_model(margs, device="cpu", storage_dtype=torch.float32, seed=0)
    adapter = LlamaAdapter(margs)
    tensors = {adapter.hf_name(n): adapter.to_hf(n, p.detach()) for n, p in model.named_parameters()}
    total = sum(t.numel() * 4 for t in tensors.values())
    files = write_folder(tmp / "hf", tensors, adapter.hf_config("float32"), dtype=torch.float32,
                         max_shard_bytes=int(args.shard_mb * 1e6))["files"]
    shard = max((tmp / "hf" / f).stat().st_size for f in files)
    del model, tensors
    (tmp / "text.txt").write_text(Path(__file__).read_text() * 20)
    print(f"model: {total / 2**20:.0f} MiB in FP32 ({total // 4 / 1e6:.0f}M parameters), {len(files)} files, "
          f"the largest {shard / 2**20:.0f} MiB; CPU {torch.backends.cpu.get_cpu_capability()}")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    here = str(Path(__file__).resolve())
    for world in (1, 2):
        run = str(tmp / f"run{world}")
        cmd = [sys.executable, here, "--worker", str(tmp / "hf"), str(tmp / "text.txt"), run]
        if world > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *cmd[1:]]
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        for rank in range(world):
            m = json.loads(Path(run, f"memory-{world}-{rank}.json").read_text())
            bound = 0.6 * total + shard
            verdict = f", bound 0.6x + one shard {bound / 2**20:.0f} MiB: {'within' if m['peak'] <= bound else 'OVER'}" \
                if world > 1 else ""
            print(f"world {world} rank {rank}: peak {m['peak'] / 2**20:.0f} MiB = {m['peak'] / total:.2f}x the model "
                  f"(holds {m['held'] / 2**20:.0f} MiB = {m['held'] / total:.2f}x){verdict}")


if __name__ == "__main__":
    main()
