"""Expert parallelism's dispatch in FP8 against the activations' dtype: the bytes of a training
step's all-to-alls (counted from outside the model by mixprec's comm-bytes counter), and the
losses of moe-debug trained on two gloo ranks, several seeds, each seed once per dispatch.

    python benchmarks/expert_dispatch.py --bytes --flavor moe-small
    python benchmarks/expert_dispatch.py --accuracy --seeds 0,1,2 --steps 300 [--preset fp8-rowwise]

Bytes: one bf16-mixed step of the flavor on two ranks (ep 2), the all-to-alls by call: per MoE
layer the counts, the dispatch and the combine in forward; the combine's and the dispatch's
backward in backward. Accuracy: the mean training loss of the last quarter of the steps and the
final validation loss, fp8 against base on the same seed and data order (paired).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _bytes_rank(rank: int, world: int, store: str, flavor: str, out: str) -> None:
    import torch.distributed as dist

    from mixprec import Policy, build_model, model_args
    from mixprec.distributed.comm_bytes import CommBytes
    from mixprec.distributed.expert_parallel import apply_expert_parallel
    from mixprec.distributed.fsdp import apply_fsdp
    from mixprec.distributed.parallel import ParallelDims

    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for dispatch in ("base", "fp8"):
        policy = Policy.from_preset("bf16-mixed")
        model = build_model(model_args(flavor, 256), device="cpu", storage_dtype=torch.float32, seed=0)
        policy.prepare_model(model, "cpu")
        mesh = ParallelDims(1, world, 1, world, world).mesh("cpu")
        apply_expert_parallel(model, mesh, dispatch)
        apply_fsdp(model, ParallelDims.dp_mesh(mesh), policy, experts_mesh=mesh["dp_mod_ep"])
        x = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(rank))
        with CommBytes() as comm:
            loss = model(x[:, :-1], x[:, 1:])
            forward = [size for kind, size in comm.log if kind == "all_to_all"]
            loss.backward()
        layers = len(forward) // 3
        results[dispatch] = {"counts": sum(forward[0::3]), "dispatch": sum(forward[1::3]),
                             "combine": sum(forward[2::3]), "step": comm.bytes["all_to_all"], "layers": layers}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def measure_bytes(flavor: str) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bytes.json"
        mp.spawn(_bytes_rank, args=(2, f"file://{tmp}/store", flavor, str(out)), nprocs=2)
        return json.loads(out.read_text())


def train(folder: Path, seed: int, dispatch: str, steps: int, corpus: str, preset: str) -> list[dict]:
    args = ["train", "--model.flavor", "moe-debug", "--data.source", corpus, "--job.dump_folder", str(folder),
            "--training.steps", str(steps), "--training.seq_len", "64", "--training.local_batch_size", "4",
            "--training.warmup_steps", str(steps // 10), "--training.eval_interval", str(steps),
            "--training.eval_batches", "8", "--training.seed", str(seed), "--precision.preset", preset,
            "--checkpoint.enable", "false", "--metrics.progress_bar", "false", "--metrics.plot", "false",
            "--metrics.log_freq", "1", "--training.device", "cpu", "--parallelism.expert_parallel_degree", "2",
            "--parallelism.expert_dispatch", dispatch]
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                    "mixprec", *args], check=True, env=env, capture_output=True, text=True)
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def corpus_file(folder: Path) -> str:
    import argparse as a
    import difflib
    import inspect
    import json as j
    import pathlib
    import textwrap

    path = folder / "corpus.txt"
    path.write_text("\n".join(inspect.getsource(m) for m in (a, difflib, j.decoder, pathlib, textwrap)))
    return str(path)


def accuracy(seeds: list[int], steps: int, preset: str) -> None:
    print(f"moe-debug, {preset}, ep 2 on two gloo ranks, {steps} steps; loss = mean training loss of the last "
          f"{steps // 4} steps; val = final validation loss")
    print(f"{'seed':>4} {'base loss':>10} {'fp8 loss':>10} {'gap %':>7} {'base val':>9} {'fp8 val':>9} {'gap %':>7}")
    gaps, val_gaps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = corpus_file(Path(tmp))
        for seed in seeds:
            runs = {d: train(Path(tmp) / f"{d}-{seed}", seed, d, steps, corpus, preset) for d in ("base", "fp8")}
            tail = {d: [r["loss"] for r in rs if "loss" in r][-(steps // 4):] for d, rs in runs.items()}
            loss = {d: sum(v) / len(v) for d, v in tail.items()}
            val = {d: [r["val_loss"] for r in rs if "val_loss" in r][-1] for d, rs in runs.items()}
            gaps.append(100 * (loss["fp8"] / loss["base"] - 1))
            val_gaps.append(100 * (val["fp8"] / val["base"] - 1))
            print(f"{seed:>4} {loss['base']:>10.4f} {loss['fp8']:>10.4f} {gaps[-1]:>+7.3f} {val['base']:>9.4f} "
                  f"{val['fp8']:>9.4f} {val_gaps[-1]:>+7.3f}", flush=True)
    n = len(gaps)

    def summary(values):
        mean = sum(values) / n
        sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else 0.0
        return mean, sd / n ** 0.5

    (m, se), (vm, vse) = summary(gaps), summary(val_gaps)
    print(f"mean gap fp8 - base: training {m:+.3f}% (standard error {se:.3f}%), validation {vm:+.3f}% "
          f"(standard error {vse:.3f}%)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", action="store_true", help="the all-to-all bytes of one step, base vs fp8")
    p.add_argument("--flavor", default="moe-small", help="for --bytes")
    p.add_argument("--accuracy", action="store_true", help="moe-debug losses, base vs fp8 dispatch")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--preset", default="bf16-mixed", help="for --accuracy")
    a = p.parse_args()
    if a.bytes:
        r = measure_bytes(a.flavor)
        print(f"{a.flavor}, bf16-mixed, one step on two gloo ranks (ep 2), rank 0's all-to-all bytes "
              f"({r['base']['layers']} MoE layers):")
        print(f"{'':<22}{'base':>12}{'fp8':>12}{'fp8/base':>10}")
        for key in ("counts", "dispatch", "combine", "step"):
            print(f"{key:<22}{r['base'][key]:>12,}{r['fp8'][key]:>12,}{r['fp8'][key] / r['base'][key]:>10.3f}")
    if a.accuracy:
        accuracy([int(s) for s in a.seeds.split(",")], a.steps, a.preset)


if __name__ == "__main__":
    main()
