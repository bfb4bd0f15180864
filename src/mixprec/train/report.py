"""What a run shows and leaves behind: the progress bar, the log line of a step, and
summary.json with the plots."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from mixprec.train.metrics import plot_loss_curve, plot_loss_scale, plot_stability, read_metrics

logger = logging.getLogger(__name__)


def write_summary(folder: Path, summary: dict, plot: bool, title: str, incidents: list[dict] | None) -> dict:
    """summary.json (strict JSON) and, with `plot`, loss_curve.png, loss_scale.png and
    (`incidents` not None: the stability guard ran) stability.png."""
    summary = strict_json(summary)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    if plot:
        metrics = folder / "metrics.jsonl"
        plot_loss_curve(metrics, folder / "loss_curve.png", title)
        plot_loss_scale(metrics, folder / "loss_scale.png")
        if incidents is not None:
            plot_stability(read_metrics(metrics), incidents, folder / "stability.png", title)
    return summary


def strict_json(summary: dict) -> dict:
    """NaN and infinities are not JSON: null, with a `<key>_reason` saying why."""
    out = {}
    for key, value in summary.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key], out[f"{key}_reason"] = None, f"not finite ({value})"
        elif value is None and key == "tokens_per_sec":
            out[key], out[f"{key}_reason"] = None, "no step ran in this process"
        else:
            out[key] = value
    return out


def progress_bar(enabled: bool, initial: int, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    # disable=None: shown on a terminal, silent in logs and CI.
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, disable=None)


def report_step(bar, record: dict, log_line: bool) -> None:
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}", refresh=False)
    if log_line:
        val = f"  val_loss {record['val_loss']:.4f}  val_ppl {record['val_perplexity']:.2f}" if "val_loss" in record else ""
        logger.info("step %d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s%s", record["step"], record["loss"],
                    record["lr"], record["grad_norm"], record["tokens_per_sec"], val)
