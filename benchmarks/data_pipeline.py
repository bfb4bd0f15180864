"""Corpora larger than memory: `mixprec prepare`'s rate, the loader's throughput, and what a
training run on a big prepared corpus costs in memory and start-up against a small one.

    python benchmarks/data_pipeline.py --corpus-mb 2048 --work runs/data_bench
    python benchmarks/data_pipeline.py --corpus-mb 64 --small-mb 8 --bpe-mb 16     # a quick look

The corpus is real text made big: the lines of this Python's standard-library sources,
shuffled and repeated into 32 files (of 64 MB for 2 GB; made once, kept in WORK). Each measurement runs
alone, one after the other; the training runs are separate processes whose peak RSS is read
from the kernel (wait4). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILE_MB = 64


def make_corpus(folder: Path, megabytes: float, seed: int = 0) -> Path:
    """`megabytes` of shuffled standard-library lines, in 32 files (at most FILE_MB each)."""
    if (folder / "done").is_file():
        return folder
    from mixprec.data.corpus import load_corpus

    folder.mkdir(parents=True, exist_ok=True)
    lines = load_corpus("stdlib", 0.05).train.splitlines(keepends=True)
    rng, left, index = random.Random(seed), int(megabytes * 1e6), 0
    while left > 0:
        rng.shuffle(lines)
        size = min(left, int(min(FILE_MB * 1e6, megabytes * 1e6 / 32)) + 1)
        text = "".join(lines).encode()[:size]
        text = text[:text.rfind(b"\n") + 1]
        (folder / f"part-{index:04d}.txt").write_bytes(text)
        left, index = left - len(text), index + 1
    (folder / "done").write_text("")
    return folder


def _descendants(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(c) for c in children] + [d for c in children for d in _descendants(int(c))]


def timed(cmd: list[str], env=None) -> tuple[float, float, str]:
    """(seconds, peak RSS in MiB of the largest of the child and its own children, stdout +
    stderr), alone. Peaks are each process's VmHWM, polled: a child's ru_maxrss starts at this
    process's RSS at the fork."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        peaks: dict[int, int] = {}
        while proc.poll() is None:
            for pid in [proc.pid, *_descendants(proc.pid)]:
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    peaks[pid] = max(peaks.get(pid, 0), int(status.split("VmHWM:")[1].split()[0]))
                except (OSError, IndexError, ValueError):
                    pass
            time.sleep(0.01)
        seconds = time.perf_counter() - t0
        log.seek(0)
        out = log.read()
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out[-2000:]}")
    return seconds, max(peaks.values(), default=0) / 1024, out


def prepare(source: Path, out: Path, *extra: str) -> tuple[float, float, str]:
    if (out / "index.json").is_file():
        import shutil

        shutil.rmtree(out)
    return timed([sys.executable, "-m", "mixprec", "prepare", str(source), "--out", str(out), *extra])


def where_bpe_time_goes(tokenizer: Path, source: Path, megabytes: float = 16) -> dict:
    """One process: reading and decoding vs encoding vs writing, seconds for `megabytes`."""
    import numpy as np
    from tokenizers import Tokenizer

    from mixprec.data.tokenizer import text_pieces

    tok = Tokenizer.from_file(str(tokenizer))
    t0 = time.perf_counter()
    text = ""
    for path in sorted(source.glob("part-*.txt")):
        text += path.read_bytes().decode()
        if len(text) >= megabytes * 1e6:
            break
    t1 = time.perf_counter()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ids = [i for e in tok.encode_batch_fast(text_pieces(text), add_special_tokens=False) for i in e.ids]
    t2 = time.perf_counter()
    array = np.asarray(ids, dtype=np.uint16)
    t3 = time.perf_counter()
    array.tofile(os.devnull)
    t4 = time.perf_counter()
    return {"read_decode": t1 - t0, "encode": t2 - t1, "to_array": t3 - t2, "write": t4 - t3, "mb": len(text) / 1e6}


def loader_rate(folder: Path, batch: int = 8, seq_len: int = 2048, batches: int = 2000) -> float:
    """Tokens a second the loader hands out from the page cache."""
    from mixprec.data.loader import TrainLoader
    from mixprec.data.shards import open_prepared

    data = open_prepared(folder)
    loader = TrainLoader(data.train, seq_len, batch, seed=0)
    for _ in range(50):
        loader.next_batch()
    t0 = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    return batches * batch * seq_len / (time.perf_counter() - t0)


def train(folder: Path, run: Path, steps: int) -> tuple[float, float, str]:
    import shutil

    shutil.rmtree(run, ignore_errors=True)
    return timed([sys.executable, "-m", "mixprec", "train", "--data.source", str(folder), "--model.flavor", "debug",
                  "--training.device", "cpu", "--training.steps", str(steps), "--training.eval_interval", "0",
                  "--checkpoint.enable", "false", "--metrics.plot", "false", "--metrics.progress_bar", "false",
                  "--job.dump_folder", str(run)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-mb", type=float, default=2048)
    parser.add_argument("--small-mb", type=float, default=20)
    parser.add_argument("--bpe-mb", type=float, default=256, help="MB of the corpus prepared with a BPE tokenizer.json")
    parser.add_argument("--work", default="runs/data_bench")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    import torch

    work = Path(args.work)
    print(f"machine: {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    big = make_corpus(work / f"corpus-{args.corpus_mb:g}", args.corpus_mb)
    small = make_corpus(work / f"corpus-{args.small_mb:g}", args.small_mb, seed=1)
    bpe_src = make_corpus(work / f"corpus-{args.bpe_mb:g}", args.bpe_mb, seed=2)
    text_mb = {p: sum(f.stat().st_size for f in p.glob("part-*.txt")) / 1e6 for p in (big, small, bpe_src)}
    rows = []

    s, rss, _ = prepare(big, work / "big")
    rows.append(("prepare, byte tokenizer", f"{text_mb[big]:.0f} MB in {s:.1f} s: {text_mb[big] / s:.0f} MB/s "
                 f"(peak RSS {rss:.0f} MiB, the largest process)"))
    s_small, _, _ = prepare(small, work / "small")
    s, rss, out = prepare(bpe_src, work / "bpe", "--tokenizer", "bpe")
    index = json.loads((work / "bpe" / "index.json").read_text())
    tokens = index["tokens"]["train"] + index["tokens"]["val"]
    rows.append(("prepare, trained BPE (4096)", f"{text_mb[bpe_src]:.0f} MB in {s:.1f} s: {text_mb[bpe_src] / s:.1f} "
                 f"MB/s, {tokens / s / 1e6:.2f}M tokens/s, BPE training included (peak RSS {rss:.0f} MiB)"))
    s, rss, out = prepare(bpe_src, work / "bpe-file", "--tokenizer", str(work / "bpe" / "tokenizer.json"))
    rows.append(("prepare, that tokenizer.json", f"{text_mb[bpe_src]:.0f} MB in {s:.1f} s: {text_mb[bpe_src] / s:.1f} "
                 f"MB/s, {tokens / s / 1e6:.2f}M tokens/s (peak RSS {rss:.0f} MiB)"))
    split = where_bpe_time_goes(work / "bpe" / "tokenizer.json", bpe_src)
    mb = split.pop("mb")
    total = sum(split.values())
    rows.append(("  where one process's time goes", ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in split.items())
                 + f" ({mb / total:.1f} MB/s on one core, {mb:.0f} MB)"))
    rate = loader_rate(work / "big")
    rows.append(("loader, 8 x 2048 from the page cache", f"{rate / 1e6:.1f}M tokens/s"))
    first, _, log = train(work / "big", work / "run-first", 1)
    checked = next((line.split("checked in ")[1].split(" s")[0] for line in log.splitlines() if "checked in" in line),
                   "?")
    rows.append(("time to the first step, 2 GB shards", f"{first:.1f} s for a 1-step run, end to end (checksums "
                 f"{checked} s)"))
    s_big, rss_big, _ = train(work / "big", work / "run-big", args.steps)
    s_small, rss_small, _ = train(work / "small", work / "run-small", args.steps)
    _, rss_text, _ = train(small, work / "run-text", args.steps)
    rows.append((f"peak RSS, {args.steps} steps", f"{text_mb[big]:.0f} MB corpus {rss_big:.0f} MiB, {text_mb[small]:.0f} "
                 f"MB corpus {rss_small:.0f} MiB: {rss_big / rss_small:.3f}x (the {text_mb[small]:.0f} MB as text, "
                 f"tokenized at start: {rss_text:.0f} MiB)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
