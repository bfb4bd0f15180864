"""Per-step metrics (metrics.jsonl, optional TensorBoard), throughput and memory
measurements, and the plots drawn from them (loss curve, loss scale, stability)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from mixprec.errors import UserError
from mixprec.reporting import pyplot

# Dense peak TFLOP/s by GPU name and what the matmuls compute in (vendor data sheets).
# The data sheets' headline figures assume 2:4 sparsity: an H100 SXM's 1979 is BF16 with
# sparsity (or FP8 dense), its dense BF16 is 989. tfloat32: FP32 matmuls run as TF32
# (precision.tf32); float32: true FP32 on the CUDA cores. More specific names first.
_GPU_PEAK_TFLOPS = {
    "H100 PCIe": {"bfloat16": 756, "float16": 756, "tfloat32": 378, "float32": 51, "float8": 1513},
    "H100 NVL": {"bfloat16": 835, "float16": 835, "tfloat32": 418, "float32": 60, "float8": 1671},
    "H100": {"bfloat16": 989, "float16": 989, "tfloat32": 494, "float32": 67, "float8": 1979},  # SXM
    "H200": {"bfloat16": 989, "float16": 989, "tfloat32": 494, "float32": 67, "float8": 1979},
    "A100": {"bfloat16": 312, "float16": 312, "tfloat32": 156, "float32": 19.5},
}


def gpu_peak_flops(device_name: str, matmul_dtype: str) -> float | None:
    """The data-sheet peak for a GPU name (torch.cuda.get_device_name) and what its
    matmuls compute in (Policy.matmul_dtype); None for a GPU or dtype not in the table."""
    for key, peaks in _GPU_PEAK_TFLOPS.items():
        if key in device_name:
            return peaks[matmul_dtype] * 1e12 if matmul_dtype in peaks else None
    return None


def peak_flops(device: torch.device, policy) -> float | None:
    """Peak matmul FLOP/s for MFU under `policy` (a set-up mixprec.Policy). GPUs: the data
    sheet for what the matmuls compute in (None when unknown: no MFU). CPUs have no useful
    data sheet number: the best of ten n x n matmuls in the dtype the GEMM kernels really
    run in (FP32 where the policy emulates), measured here: n = 1024 (about 0.2 s), or 256
    where one such product already takes over 10 ms (a scalar kernel, as float16 on a CPU
    without native float16 GEMMs, where ten 1024 products took 27 s)."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), policy.matmul_dtype)
    dtype = torch.float32 if policy.emulate_matmul else policy.param_dtype
    # its own generator: drawing from the global one would shift a resumed run's random stream
    a = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).to(dtype)
    if _best_seconds(a[:256, :256], 1) > 0.01:
        a = a[:256, :256].contiguous()
    return 2 * a.shape[0] ** 3 / _best_seconds(a, 11)


def _best_seconds(a: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return best


class MetricsLogger:
    """Appends one JSON object per step to metrics.jsonl (and TensorBoard when enabled)."""

    def __init__(self, folder: Path, resume_step: int, tensorboard: bool):
        self.path = folder / "metrics.jsonl"
        self._file = None
        self.truncate(resume_step)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("metrics.enable_tensorboard needs tensorboard: pip install tensorboard") from None
            self._tb = SummaryWriter(str(folder / "tb"))

    def truncate(self, step: int) -> None:
        """Drop the records past `step` (a resume or a rewind recomputes them) and a line
        torn by a kill in mid-write."""
        if self._file is not None:
            self._file.close()
        kept = [line for line in _read_lines(self.path)
                if (record := _parse(line)) is not None and record.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)
        self._file = open(self.path, "a")

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _read_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def read_metrics(path: Path) -> list[dict]:
    """The records of metrics.jsonl, without a torn line."""
    return [r for line in _read_lines(path) if (r := _parse(line)) is not None]


def plot_loss_scale(metrics_path: Path, out: Path) -> Path | None:
    """The loss scale over steps with the overflowed (skipped) steps marked; None when
    the run had no loss scaling."""
    records = [r for r in read_metrics(metrics_path) if r.get("loss_scale") is not None]
    if not records:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.step([r["step"] for r in records], [r["loss_scale"] for r in records], where="post", label="loss scale")
    skipped = [(r["step"], r["loss_scale"]) for r in records if r["skipped"]]
    if skipped:
        ax.plot(*zip(*skipped), "rv", label=f"overflow ({len(skipped)})")
    ax.set_yscale("log", base=2)
    return _save(plt, fig, ax, out, "loss scale (after update)")


def _save(plt, fig, ax, out: Path, ylabel: str) -> Path:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_loss_curve(metrics_path: Path, out: Path, title: str) -> Path:
    """Training and validation loss over steps, from metrics.jsonl."""
    plt = pyplot()
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_title(title)
    return _save(plt, fig, ax, out, "cross-entropy (nats/token)")


def plot_stability(metrics: list[dict], incidents: list[dict], out: Path, title: str) -> Path:
    """stability.png: loss and gradient norm over the steps that survived, with every
    incident (mixprec.stability's incident log) marked where it happened and each rewind
    shaded back to the step it went to."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for ax, key, label in ((axes[0], "loss", "training loss"), (axes[1], "grad_norm", "gradient norm")):
        points = [(r["step"], r[key]) for r in metrics if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), linewidth=1, label=label)
        marks = [(i["step"], i[key]) for i in incidents if isinstance(i.get(key), (int, float))]
        for i in incidents:  # non-finite values are drawn at the top of the panel
            if not isinstance(i.get(key), (int, float)):
                marks.append((i["step"], max((v for _, v in points), default=1.0)))
        if marks:
            ax.plot(*zip(*marks), "rx", markersize=9, label=f"incident ({len(incidents)})")
        for i in incidents:
            if i.get("rewound_to") is not None:
                ax.axvspan(i["rewound_to"], i["step"], color="orange", alpha=0.15)
        if points and max(v for _, v in points + marks) > 20 * max(min(v for _, v in points), 1e-12):
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    rewinds = sum(i.get("rewound_to") is not None for i in incidents)
    axes[0].set_title(f"{title}: {len(incidents)} incidents, {rewinds} rewinds (shaded: steps rewound)")
    axes[1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
