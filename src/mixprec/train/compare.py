"""`mixprec compare`: train each preset with the same seed, data, initialisation and
steps, one after another, and judge each against the first (the baseline).

Writes into the run folder: one subfolder per preset (its own run), compare.json,
compare.md, loss_curves.png and speed_memory.png. A preset fails when its validation
loss or perplexity is too far above the baseline's, or it overflowed too often
([compare] thresholds; defaults 5%, 3%, 10%).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

from mixprec.config import to_toml
from mixprec.errors import UserError
from mixprec.precision.presets import resolve_preset_name
from mixprec.reporting import pyplot
from mixprec.train.metrics import _save, read_metrics

logger = logging.getLogger(__name__)


def _entry(text: str) -> tuple[str, str, str]:
    """(name, preset, plan file) of one --presets entry: a preset, or plan:PATH (a plan file
    from `mixprec plan`, on the base mode it was measured under)."""
    if text.startswith("plan:"):
        from mixprec.plan.file import read_plan

        path = text.removeprefix("plan:")
        plan = read_plan(path)
        return f"plan-{Path(path).stem}", resolve_preset_name(plan.base or "bf16-mixed", f"{path} [plan] base"), path
    name = resolve_preset_name(text, "--presets")
    return name, name, ""


def run_compare(config, presets: list[str]) -> dict:
    entries = [_entry(p) for p in presets]
    names = [name for name, _, _ in entries]
    if len(names) < 2 or len(set(names)) != len(names):
        raise UserError(f"--presets {','.join(presets)}: accepted: two or more different presets (or plan:PLAN.toml), "
                        "the first the baseline (for example fp32,bf16-mixed)")
    from tqdm.auto import tqdm

    folder = Path(config.job.dump_folder)
    runs = {}
    for name, preset, plan in tqdm(entries, desc="compare", unit="preset", disable=None):
        # Only the preset (and plan) differs: no [training] precision keys may override it.
        precision = dataclasses.replace(config.precision, preset=preset, param_dtype="", storage_dtype="", plan=plan)
        training = dataclasses.replace(config.training, dtype="", mixed_precision_param="")
        run_config = dataclasses.replace(config, precision=precision, training=training,
                                         job=dataclasses.replace(config.job, dump_folder=str(folder / name)),
                                         checkpoint=dataclasses.replace(config.checkpoint, enable=False))
        # Each preset in a process of its own: a CPU's peak memory is the process's peak
        # resident set, which one process would carry from one run into the next.
        (folder / name).mkdir(parents=True, exist_ok=True)
        path = folder / name / "compare_config.toml"
        path.write_text(to_toml(run_config))
        logger.info("compare: training %s into %s", name, folder / name)
        proc = subprocess.run([sys.executable, "-m", "mixprec", "train", "--config", str(path)])
        if proc.returncode not in (0, 3):  # 3: gave up as unstable, with a summary saying so
            raise UserError(f"compare: the {name} run failed (exit code {proc.returncode}); its log is above")
        summary = json.loads((folder / name / "summary.json").read_text())
        for key in ("final_train_loss", "final_val_loss", "val_perplexity"):  # null in the file: not finite
            summary[key] = math.nan if summary.get(key) is None else summary[key]
        runs[name] = summary
    report = judge(runs, config.compare)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "compare.md").write_text(to_markdown(report))
    if config.metrics.plot:
        plot_loss_curves({n: folder / n / "metrics.jsonl" for n in names}, folder / "loss_curves.png")
        plot_speed_memory(report, folder / "speed_memory.png")
    return report


def judge(runs: dict[str, dict], thresholds) -> dict:
    """Per preset: the figures, their ratios to the baseline and pass/fail."""
    base_name, base = next(iter(runs.items()))
    rows = []
    for name, r in runs.items():
        loss_diff = (r["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
        ppl_diff = (r["val_perplexity"] - base["val_perplexity"]) / base["val_perplexity"]
        failures = []
        if r.get("stopped_unstable"):
            failures.append(f"unstable: gave up after {r['stability']['rewinds']} rewinds at step {r['steps']}")
        elif not math.isfinite(r["final_val_loss"]):
            failures.append(f"validation loss is {r['final_val_loss']}")
        if loss_diff > thresholds.max_loss_diff:
            failures.append(f"validation loss {loss_diff:+.2%} > {thresholds.max_loss_diff:.0%}")
        if ppl_diff > thresholds.max_perplexity_diff:
            failures.append(f"perplexity {ppl_diff:+.2%} > {thresholds.max_perplexity_diff:.0%}")
        if r["overflow_rate"] > thresholds.max_overflow_rate:
            failures.append(f"overflow rate {r['overflow_rate']:.1%} > {thresholds.max_overflow_rate:.0%}")
        speed = r["tokens_per_sec"] / base["tokens_per_sec"] if r["tokens_per_sec"] and base["tokens_per_sec"] else None
        rows.append({
            "preset": name, "final_train_loss": r["final_train_loss"], "final_val_loss": r["final_val_loss"],
            "val_perplexity": r["val_perplexity"], "loss_diff": loss_diff, "perplexity_diff": ppl_diff,
            "tokens_per_sec": r["tokens_per_sec"], "speedup": speed, "peak_memory_bytes": r["peak_memory_bytes"],
            "memory_ratio": r["peak_memory_bytes"] / base["peak_memory_bytes"] if base["peak_memory_bytes"] else None,
            "training_state_bytes": r["param_bytes"] + r["optimizer_state_bytes"],
            "overflow_rate": r["overflow_rate"], "skipped_steps": r["skipped_steps"],
            # stability guard off: None
            "incidents": r["stability"]["incidents"] if r.get("stability") else None,
            "rewinds": r["stability"]["rewinds"] if r.get("stability") else None,
            "fallback": r["fallback_triggered"], "precision_final": r["precision_final"],
            "gemm_flops_by_format": r.get("gemm_flops_by_format", {}), "promoted": sorted(r.get("promoted", {})),
            "passed": not failures, "failures": failures,
        })
    return {"baseline": base_name, "thresholds": dataclasses.asdict(thresholds), "presets": rows,
            "passed": all(r["passed"] for r in rows)}


def to_markdown(report: dict) -> str:
    lines = [f"# mixprec compare (baseline {report['baseline']})", "",
             "| preset | val loss | diff | perplexity | diff | tokens/s | speed-up | peak memory MiB | ratio | "
             "GEMM FLOPs by format | overflow rate | skipped | fallback | incidents (rewinds) | result |",
             "|" + "---|" * 15]
    for r in report["presets"]:
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        mem = f"{r['memory_ratio']:.2f}" if r["memory_ratio"] else "-"
        result = "pass" if r["passed"] else "FAIL: " + "; ".join(r["failures"])
        incidents = "-" if r["incidents"] is None else f"{r['incidents']} ({r['rewinds']})"
        lines.append(f"| {r['preset']} | {r['final_val_loss']:.4f} | {r['loss_diff']:+.2%} | {r['val_perplexity']:.2f} "
                     f"| {r['perplexity_diff']:+.2%} | {r['tokens_per_sec'] or 0:.0f} | {speed} | "
                     f"{r['peak_memory_bytes'] / 2**20:.0f} | {mem} | {_shares(r['gemm_flops_by_format'])} | "
                     f"{r['overflow_rate']:.1%} | {r['skipped_steps']} "
                     f"| {'yes' if r['fallback'] else 'no'} | {incidents} | {result} |")
    t = report["thresholds"]
    lines += ["", f"Thresholds: validation loss within {t['max_loss_diff']:.0%}, perplexity within "
              f"{t['max_perplexity_diff']:.0%}, overflow rate under {t['max_overflow_rate']:.0%} ([compare] table).", ""]
    return "\n".join(lines)


def _shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in shares.items()) or "-"


def plot_loss_curves(metrics: dict[str, Path], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, path) in enumerate(metrics.items()):
        records = read_metrics(path)
        color = f"C{i}"
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], color=color, lw=1, alpha=0.6,
                label=f"{name} train")
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o-", color=color, label=f"{name} validation")
    _save(plt, fig, ax, out, "cross-entropy (nats/token)")


def plot_speed_memory(report: dict, out: Path) -> None:
    plt = pyplot()
    rows = report["presets"]
    names = [r["preset"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(names, [r["speedup"] or 0 for r in rows], color="C0")
    a.set_title(f"tokens/s vs {report['baseline']}")
    a.axhline(1, color="k", lw=0.8)
    b.bar(names, [r["memory_ratio"] or 0 for r in rows], color="C1")
    b.set_title(f"peak memory vs {report['baseline']}")
    b.axhline(1, color="k", lw=0.8)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
