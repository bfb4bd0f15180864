"""`mixprec plan`: run a few real training steps, measure every Linear layer FP8 can take in
every candidate format on the last of them (mixprec.plan.measure; a mixture of experts' experts
modules whole, mixprec.plan.experts), choose a format per layer (mixprec.plan.choose) and
write the plan file (mixprec.plan.file) that
`precision.plan` takes. The command gives it the trainer's step (`for_planning` says how
the config is run); a library user gives `plan_precision` a model, a policy and batches.

The base mode is the config's (bf16-mixed by default); layers FP8 cannot take (the
output projection, shapes that are not multiples of 16, fp8.filter_fqns) stay in it and
are listed with their reason. Nothing is saved besides the plan (and its plot): the
steps only produce real activations and gradients.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from mixprec.errors import UserError
from mixprec.narrow.convert import output_projections, why_not
from mixprec.narrow.experts.hf import find_experts
from mixprec.narrow.formats.recipe import FP8Recipe
from mixprec.plan.choose import choose, floors, margin, modeled_speedups
from mixprec.plan.config import PlanConfig
from mixprec.narrow.experts.layer import tokens_per_expert
from mixprec.plan.experts import SERIES_DB, ExpertsCapture, few_tokens, kept_by, measure_experts
from mixprec.plan.file import write_plan
from mixprec.plan.measure import GEMMS, Capture, gemm_times, measure
from mixprec.precision.spec import FP32, format_name, parse_format
from mixprec.reporting import device_name, peak_memory_bytes, pyplot

logger = logging.getLogger(__name__)


def _candidates(names) -> dict[str, FP8Recipe]:
    out = {}
    for name in names:
        fmt = parse_format(name, "plan.candidates")
        if not isinstance(fmt, FP8Recipe) or fmt.delayed:
            raise UserError(f"plan.candidates: {name!r} cannot be planned from one step's tensors; accepted: "
                            "current-scaling FP8 recipes (fp8-tensorwise, fp8-rowwise, fp8-blockwise)")
        out[format_name(fmt)] = fmt
    return out


def _worse(old: dict | None, new: dict) -> dict:
    """Per figure, the worse of two steps' (lower SQNR, larger shares)."""
    if old is None:
        return new
    out = {k: min(old[k], new[k]) for k in old if k.endswith("_db")}
    for k in ("flushed", "saturated"):
        out[k] = {role: max(old[k][role], new[k][role]) for role in old[k]}
    return out


def plan_precision(model: nn.Module, policy, optimizer: torch.optim.Optimizer, batches, *,
                   config: PlanConfig = PlanConfig(),
         loss_fn=None, max_norm: float | None = 1.0, out: str | None = None) -> dict:
    """Plan any model: one optimizer step per batch of `batches` under `policy` (the base
    mode, set up by `policy.setup(model, optimizer)`), the last `config.measure_steps`
    measured; `loss_fn(model, batch)` as in mixprec.audit. Returns the report (what
    `mixprec plan` prints); with `out`, the plan file is written there too.

        report = mixprec.plan_precision(model, policy, optimizer, batches, out="plan.toml")
    """
    batches = list(batches)
    if loss_fn is None:
        def loss_fn(model, batch):
            return model(*batch) if isinstance(batch, (tuple, list)) else model(**batch).loss

    steps = iter(batches)

    def step() -> None:
        batch = next(steps)
        with policy.autocast():
            loss = loss_fn(model, batch)
        policy.backward(loss)
        policy.step(optimizer, max_norm)

    config = dataclasses.replace(config, steps=len(batches), measure_steps=min(config.measure_steps, len(batches)))
    device = next(model.parameters()).device
    report = plan_layers(model, policy, step, config, device, type(model).__name__)
    if out is not None:
        save(report, out)
    return report


def for_planning(config):
    """The config as `mixprec plan` runs it: eager, so that the hooks see every layer; no
    stability guard, which has nothing to recover in a few steps."""
    return dataclasses.replace(config, compile=dataclasses.replace(config.compile, enable=False),
                               stability=dataclasses.replace(config.stability, enable=False))


def plan_layers(model: nn.Module, policy, step, pcfg: PlanConfig, device: torch.device, model_name: str, *,
                exclude=(), started: float | None = None, progress: bool = True) -> dict:
    """Run `step()` pcfg.steps times, measure the last pcfg.measure_steps, choose."""
    from tqdm.auto import tqdm

    t0 = started if started is not None else time.perf_counter()
    candidates = _candidates(pcfg.candidates)
    if policy.layout.fp8():
        raise UserError(f"mixprec plan: precision {policy.name} already puts layers in FP8; accepted: the base mode "
                        "the plan chooses from (bf16-mixed, fp32, bf16-master, ...), without fp8.recipe")
    base = format_name(policy.param_dtype)
    outputs = output_projections(model)
    layers, left_out = {}, {}
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            why = why_not(fqn, module, exclude, outputs)
            if why is None:
                layers[fqn] = module
            else:
                left_out[fqn] = why
    experts = {}
    for fqn, why in find_experts(model).items():
        if why is None:
            experts[fqn] = model.get_submodule(fqn)
        else:
            left_out[fqn] = why
    formats = ({base: policy.param_dtype} if policy.param_dtype != FP32 else {}) | candidates
    measured: dict[str, dict[str, dict]] = {fqn: {} for fqn in [*layers, *experts]}
    tokens: dict[str, list[int]] = {}
    shapes: dict[str, tuple[int, int, int]] = {}
    measuring_s = 0.0
    bar = tqdm(total=pcfg.steps, desc="plan", unit="step", disable=not progress or None)
    for i in range(pcfg.steps):
        if i < pcfg.steps - pcfg.measure_steps:
            step()
            bar.update()
            continue
        with Capture(model, layers) as capture, ExpertsCapture(model, experts) as routed:
            step()
        t1 = time.perf_counter()
        for fqn, module in experts.items():
            x, index, weights = routed.inputs[fqn]
            counts = tokens_per_expert(index, module.num_experts).tolist()
            if fqn not in tokens or statistics.median(counts) < statistics.median(tokens[fqn]):
                tokens[fqn] = counts  # the measured step whose experts got the fewest rows
            for name, fmt in candidates.items():
                measured[fqn][name] = _worse(measured[fqn].get(name), measure_experts(
                    module, x, index, weights, routed.dy[fqn], fmt, policy.param_dtype))
        for fqn, module in layers.items():
            x, dy = capture.x[fqn], capture.dy[fqn]
            shapes[fqn] = (x.shape[0], module.in_features, module.out_features)
            for name, fmt in formats.items():
                measured[fqn][name] = _worse(measured[fqn].get(name), measure(x, module.weight, dy, fmt,
                                                                               policy.param_dtype))
        measuring_s += time.perf_counter() - t1
        bar.update()
    bar.close()
    speedups, speed_note = _speedups(pcfg, shapes, formats, base, policy, device)
    floor = floors(pcfg)
    layer_rows, chosen = {}, {}
    for fqn in layers:
        fmt, reason = choose({n: measured[fqn][n] for n in candidates}, base, floor, pcfg.objective,
                             speedups.get(fqn))
        chosen[fqn] = fmt
        layer_rows[fqn] = {"format": fmt, "reason": reason, "features": [layers[fqn].in_features,
                                                                          layers[fqn].out_features],
                           "measured": measured[fqn]}
        if speedups.get(fqn):
            layer_rows[fqn]["expected_speedup"] = {n: s for n, s in speedups[fqn].items() if s is not None}
    modeled = modeled_speedups(candidates, base) if pcfg.objective == "speed" and pcfg.target == "h100" else None
    for fqn in experts:
        layer_rows[fqn] = _experts_row(model, fqn, measured[fqn], candidates, tokens[fqn], base, floor, pcfg, modeled)
        chosen[fqn] = layer_rows[fqn]["format"]
    feats = {fqn: m.in_features * m.out_features for fqn, m in model.named_modules()
             if isinstance(m, nn.Linear) and fqn not in outputs}
    feats |= {fqn: policy.layout.modules[fqn].features for fqn in experts}  # a token's share of the experts
    fp8_share = sum(feats[f] for f, fmt in chosen.items() if fmt != base) / max(1, sum(feats.values()))
    header = {"base": policy.requested, "objective": pcfg.objective, "target": pcfg.target or "this device",
              "floors_db": floor, "candidates": list(candidates), "steps": pcfg.steps,
              "measured_steps": pcfg.measure_steps, "device": device_name(device), "model": model_name,
              "speed": speed_note, "fp8_flop_share": round(fp8_share, 4),
              "layers_in_fp8": sum(fmt != base for fmt in chosen.values()), "layers": len(chosen),
              "left_out": left_out, "planner_seconds": round(time.perf_counter() - t0, 1),
              "measuring_seconds": round(measuring_s, 1),
              "planner_peak_memory_mib": round(peak_memory_bytes(device) / 2**20)}
    return {"header": header, "layer_rows": layer_rows}


def _experts_row(model, fqn: str, measured: dict, candidates: dict, tokens: list[int], base: str, floor, pcfg,
                 modeled) -> dict:
    """An experts module's plan row: its format and why (mixprec.plan.experts' rules, then choose's)."""
    # two GEMMs in series (up, then down): each at a floor of F dB leaves the module's output F - 3 dB
    floor = {k: v - SERIES_DB if k != "lost" else v for k, v in floor.items()}
    kept = kept_by(candidates, model, fqn)
    offered = {n: f for n, f in measured.items() if n not in kept}
    few = few_tokens(tokens, pcfg.min_expert_tokens)
    if few is not None:
        fmt, reason = base, few
    elif not offered:
        fmt, reason = base, "; ".join(kept.values())
    else:
        fmt, reason = choose(offered, base, floor, pcfg.objective, modeled)
        if pcfg.objective == "speed" and modeled is None:
            reason += " (experts' GEMMs are not timed here: plan.target h100 models them)"
        if kept:
            reason += f"; not offered: {'; '.join(kept.values())}"
    return {"format": fmt, "reason": reason, "kind": "experts", "tokens_per_expert": tokens, "measured": measured}


def save(report: dict, out: str | Path, plot: bool = False) -> None:
    """The plan file (and, with `plot`, its figure beside it as .png)."""
    header = report["header"]
    comment = (f"mixprec plan: a compute format per Linear layer, chosen by measurement.\n"
               f"Use it with --precision.plan {out} (precision.preset {header['base']}).\n"
               "measured.FORMAT: each GEMM's SQNR in dB against FP32 on the real tensors (the worst of the measured\n"
               "steps), and the shares of the input's, weight's and output gradient's values the scaled cast flushes\n"
               "to zero or saturates.")
    write_plan(out, header, report["layer_rows"], comment)
    report["plan"] = str(out)
    if plot:
        report["plot"] = str(plot_plan(report, Path(out).with_suffix(".png")))


def _speedups(pcfg, shapes, formats, base, policy, device) -> tuple[dict, str]:
    """Per layer, each candidate's expected speed-up of the three GEMMs over the base's."""
    if pcfg.objective != "speed":
        return {}, "not measured (objective coverage)"
    candidates = [n for n in formats if n != base]
    if pcfg.target == "h100":
        model = modeled_speedups(candidates, base)
        return {fqn: model for fqn in shapes}, "modeled: the H100 TFLOP/s table in mixprec.plan.choose"
    times = {}
    for shape in sorted(set(shapes.values())):
        t_base, _ = gemm_times(*shape, formats[base] if base in formats else FP32, policy.param_dtype, device,
                               policy.emulate_matmul)
        for name in candidates:
            t, emulated = gemm_times(*shape, formats[name], policy.param_dtype, device, False)
            times[shape, name] = None if emulated else t_base / t
            if emulated:
                logger.info("plan: %s at %s is emulated on this %s (%s): not counted as a speed-up", name,
                            "x".join(map(str, shape)), device.type, emulated)
    return ({fqn: {n: times[shape, n] for n in candidates} for fqn, shape in shapes.items()},
            f"measured on this device ({device_name(device)}): the three GEMMs at each layer's shapes, casts not timed")


def format_plan(report: dict) -> str:
    h = report["header"]
    floor = h["floors_db"]
    lines = [f"plan for {h['model']} on {h['device']}: base {h['base']}, objective "
             f"{h['objective']}, floors {floor['forward']:g} dB forward / {floor['input_gradient']:g} dB gradients",
             f"{'layer':<34} {'format':<15} {'fwd dB':>7} {'dgrad dB':>8} {'wgrad dB':>8}  reason"]
    for fqn, row in report["layer_rows"].items():
        fig = row["measured"].get(row["format"]) or {}
        dbs = " ".join(f"{fig.get(f'{g}_db', float('nan')):>{w}.1f}" for g, w in zip(GEMMS, (7, 8, 8)))
        lines.append(f"{fqn:<34} {row['format']:<15} {dbs}  {row['reason']}")
    for fqn, why in h["left_out"].items():
        lines.append(f"{fqn:<34} {'(base)':<15} {'':>25}  left out: {why}")
    lines.append(f"plan: {h['layers_in_fp8']} of {h['layers']} layers in FP8, {h['fp8_flop_share']:.1%} of the "
                 f"block projections' GEMM FLOPs" + (f"; written to {report['plan']}" if "plan" in report else "")
                 + f" ({h['planner_seconds']:.0f} s, {h['measuring_seconds']:.0f} s of it measuring; peak memory "
                 f"{h['planner_peak_memory_mib']} MiB)")
    return "\n".join(lines)


def plot_plan(report: dict, out: Path) -> Path:
    """Each layer's worst-GEMM SQNR margin per candidate, the chosen one marked."""
    plt = pyplot()
    h = report["header"]
    floor = h["floors_db"]
    names = list(report["layer_rows"])
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.18), 4.5))
    for i, cand in enumerate(h["candidates"]):
        ys = [margin(report["layer_rows"][n]["measured"][cand], floor)[0] for n in names]
        ax.plot(range(len(names)), ys, "o-", ms=3, lw=0.8, color=f"C{i}", label=cand)
        picked = [(j, y) for j, (n, y) in enumerate(zip(names, ys)) if report["layer_rows"][n]["format"] == cand]
        if picked:
            ax.plot(*zip(*picked), "o", ms=7, mfc="none", color=f"C{i}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=5)
    ax.set_ylabel("worst GEMM SQNR - its floor (dB)")
    ax.set_title(f"mixprec plan ({h['objective']}): circles mark each layer's choice; below 0 misses a floor")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
