"""Training throughput, MFU, peak memory and a step-time breakdown per preset, side by
side, against a minimal plain-PyTorch loop on the identical model.

Each preset runs in its own process (so its peak memory is its own):
- mixprec: Trainer.train_step, the trainer's real step (policy hooks, clipping, loss
  scaling, data); then the same step taken apart with timers: forward, backward,
  optimizer.step, and the policy's bookkeeping (unscale, inf check, clipping, the
  loss-scale update) as the rest of Policy.step;
- plain: `with torch.autocast(...): loss = model(x, y)`, `loss.backward()`,
  clip_grad_norm_, fused AdamW step, zero_grad: nothing else. It is run with
  mixprec's matmul emulation on (the same GEMM kernels, so the ratio is the
  framework's overhead) and, for a couple of steps, as a user would run it here
  (native low-precision kernels).
MFU is model FLOPs (6N per token plus attention) per second against the best FP32 and
BF16 GEMM throughput bench_gemm.py measures on the same shapes.

    python benchmarks/bench_train.py --flavor small --presets fp32,bf16-mixed,bf16-true,fp16-mixed

With --device cuda (or --modes) it measures, per preset, four runs each in its own
process (so each peak memory is its own): mixprec's Trainer.train_step and a plain
loop on the identical model and batch (autocast where the preset has it, a GradScaler
for the fp16 presets, fused AdamW, clipping, the full-logits loss), each eager and compiled (mixprec:
[compile] per block and loss; plain: torch.compile(model)). MFU is against the GPU's
data-sheet peak for what the matmuls compute in (Policy.matmul_dtype). Each run is timed
over a window of --steps steps with one wait for the device at its end and a read (the
loss; mixprec: and its steps' figures) every 10 steps, as the loops run: a per-step
synchronize would hide whether a step waits for the host. Each run also counts its graph
breaks and, on CUDA, the synchronising calls of one step that does not read (torch's sync
debug mode), and keeps mixprec's log lines (the kernel probes and routes). With --profile
a table of the kernels by device time, and with --trace a Chrome trace beside it that
shows the gaps between steps.

    python benchmarks/bench_train.py --device cuda --flavor 1B --batch 4 --seq-len 2048 \
        --presets bf16-mixed,fp16-mixed,bf16-true [--section.key value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

READ_EVERY = 10
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")  # --modes: the host reads every this many steps, as the trainer at metrics.log_freq 10

sys.path.insert(0, str(Path(__file__).parent))
from bench_gemm import SHAPES, cases, gflops  # noqa: E402


def _timed(fn, steps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def one(preset: str, flavor: str, steps: int, native_steps: int, extra: list[str]) -> dict:
    from mixprec.config import load_config
    from mixprec.models.llama import build_model
    from mixprec.precision.emulation import EmulatedMatmul
    from mixprec.train.trainer import Trainer

    overrides = {"model.flavor": flavor, "precision.preset": preset, "checkpoint.enable": "false",
                 "metrics.progress_bar": "false", "metrics.plot": "false", "training.eval_interval": "0",
                 "training.warmup_steps": "1"}
    overrides.update({k.removeprefix("--"): v for k, v in zip(extra[::2], extra[1::2])})  # --section.key value
    with tempfile.TemporaryDirectory() as tmp:
        overrides["job.dump_folder"] = tmp
        trainer = Trainer(load_config(None, overrides))
    policy, model, opt = trainer.policy, trainer.model, trainer.optimizer
    batches = [trainer.loader.next_batch() for _ in range(4)]
    tokens = batches[0][0].numel()
    result = {"preset": preset, "tokens_per_step": tokens,
              "flops_per_token": trainer.raw_model.flops_per_token(batches[0][0].shape[1])}

    # 1. the trainer's step
    result["mixprec_step_s"] = statistics.median(_timed(trainer.train_step, steps))

    # 2. the same step with timers
    parts = {"forward": [], "backward": [], "optimizer": [], "bookkeeping": []}
    inner_step = opt.step

    def timed_opt_step(*a, **k):
        start = time.perf_counter()
        out = inner_step(*a, **k)
        parts["optimizer"].append(time.perf_counter() - start)
        return out

    opt.step = timed_opt_step
    for i in range(steps + 2):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        with policy.autocast():
            loss = model(x, y)
        t1 = time.perf_counter()
        policy.backward(loss)
        t2 = time.perf_counter()
        n_opt = len(parts["optimizer"])
        policy.step(opt, 1.0)
        t3 = time.perf_counter()
        opt_time = parts["optimizer"][-1] if len(parts["optimizer"]) > n_opt else 0.0
        if i >= 2:
            parts["forward"].append(t1 - t0)
            parts["backward"].append(t2 - t1)
            parts["bookkeeping"].append(t3 - t2 - opt_time)
    opt.step = inner_step
    parts["optimizer"] = parts["optimizer"][2:]
    result["breakdown_s"] = {k: statistics.median(v) if v else 0.0 for k, v in parts.items()}

    # 3. the plain loop on the identical model and batches
    def plain(emulate: bool, n: int) -> float:
        ref = build_model(trainer.args, device="cpu", storage_dtype=policy.storage_dtype, seed=0)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)
        low = policy.param_dtype != policy.storage_dtype
        it = iter(range(10**9))

        def step():
            x, y = batches[next(it) % len(batches)]
            mode = EmulatedMatmul() if emulate and policy.param_dtype != torch.float32 else contextlib.nullcontext()
            with mode:
                with torch.autocast("cpu", dtype=policy.param_dtype, enabled=low):
                    loss = ref(x, y)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

        return statistics.median(_timed(step, n, warmup=1 if n < 3 else 2))

    result["plain_emulated_step_s"] = plain(True, steps)
    if native_steps and policy.param_dtype != torch.float32:
        result["plain_native_step_s"] = plain(False, native_steps)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["training_state_bytes"] = (sum(p.numel() * p.element_size() for p in trainer.raw_model.parameters())
                                      + sum(t.numel() * t.element_size() for s in opt.state.values()
                                            for t in s.values() if torch.is_tensor(t)))
    return result


def one_mode(preset: str, impl: str, compiled: bool, flavor: str, device: str, batch: int, seq_len: int, steps: int,
             extra: list[str], profile: str | None = None, trace: bool = False, rowwise_route: str = "auto") -> dict:
    """One (preset, mixprec or plain, eager or compiled) run: tokens/s, MFU, peak memory."""
    from mixprec.config import load_config
    from mixprec.models.llama import build_model
    from mixprec.reporting import peak_memory_bytes
    from mixprec.train.metrics import peak_flops
    from mixprec.train.trainer import Trainer
    from torch._dynamo.utils import counters

    lines = _mixprec_lines()
    if rowwise_route != "auto":  # an A/B of the row-wise route on CUDA: torch's row-wise kernel, or scales after
        import mixprec.narrow.gemm.fp8 as gemm

        gemm.scales_after = lambda device_type, fast_accum: rowwise_route == "after"
    overrides = {"model.flavor": flavor, "precision.preset": preset, "checkpoint.enable": "false",
                 "metrics.progress_bar": "false", "metrics.plot": "false", "training.eval_interval": "0",
                 "training.warmup_steps": "1", "training.device": device, "training.local_batch_size": str(batch),
                 "training.seq_len": str(seq_len), "compile.enable": str(compiled and impl == "mixprec").lower()}
    overrides.update({k.removeprefix("--"): v for k, v in zip(extra[::2], extra[1::2])})  # --section.key value
    with tempfile.TemporaryDirectory() as tmp:
        overrides["job.dump_folder"] = tmp
        trainer = Trainer(load_config(None, overrides))
    dev, policy = trainer.device, trainer.policy
    flops = trainer.raw_model.flops_per_token(seq_len)
    if impl == "mixprec":
        def step():
            return trainer.train_step()[0]

        def read(loss):  # what the trainer's read step reads: the losses and the steps' figures
            loss.item()
            policy.settle()
    else:  # the plain loop on a fresh copy of the same model; the trainer's is dropped first
        args, storage, x, y = trainer.args, policy.storage_dtype, *trainer.loader.next_batch()
        del trainer
        # the full-logits cross-entropy, as a plain loop writes it
        model = build_model(replace(args, loss_chunk=0), device=dev, storage_dtype=storage, seed=0)
        if compiled:
            model = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        low = policy.param_dtype != storage
        scaler = torch.amp.GradScaler(dev.type, enabled=policy.loss_scale is not None)

        def step():
            with torch.autocast(dev.type, dtype=policy.param_dtype, enabled=low):
                loss = model(x, y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss

        def read(loss):  # a plain loop logs its loss (TorchTitan: on its log steps)
            loss.item()

    def window(n: int) -> float:
        """Seconds for n steps as a training loop runs them: the host reads every READ_EVERY
        steps (the trainer's metrics.log_freq) and waits for the device only there and at the
        end, so a loop whose steps do not stop to read overlaps its host work with the device."""
        start = time.perf_counter()
        for i in range(n):
            loss = step()
            if (i + 1) % READ_EVERY == 0 or i == n - 1:
                read(loss)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    window(3)  # compile and allocator warm-up
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    seconds = window(steps)
    syncs = _synchronising_calls(step, dev)
    if profile:  # a few steps under torch.profiler: the kernels by device time, to a text file
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            window(3)
        sort = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        Path(profile).write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
        if trace:
            prof.export_chrome_trace(str(Path(profile).with_suffix(".trace.json")))  # the gaps between steps
    tokens = batch * seq_len
    tps = tokens * steps / seconds
    peak = peak_flops(dev, policy)
    return {"preset": preset, "impl": impl, "compiled": compiled, "tokens_per_sec": tps,
            "mfu": flops * tps / peak if peak else None, "peak_memory_bytes": peak_memory_bytes(dev),
            "matmul_dtype": policy.matmul_dtype, "graph_breaks": sum(counters["graph_break"].values()),
            "synchronising_calls": syncs, "log": lines, "rowwise_route": rowwise_route}


def _mixprec_lines() -> list[str]:
    """mixprec's log lines of this run (INFO and above: the kernel probes, routes, fallbacks), as they come."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname}: {record.getMessage()}")

    root = logging.getLogger("mixprec")
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    root.addHandler(Keep(logging.INFO))
    return lines


def _synchronising_calls(step, dev: torch.device) -> list[str] | None:
    """Where one step that does not read (not a log step) makes the host wait for the device
    (file:line of the Python frame of each call torch's sync debug mode warns at). None off CUDA."""
    if dev.type != "cuda":
        return None
    import warnings

    torch.cuda.synchronize(dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(dev)
    # sync debug mode's own message; other warnings that speak of synchronisation (AccumulateGrad's stream
    # mismatch) are kept apart, with their text, so that one is not read as the other. The mode's one-time
    # notice that it is a prototype (seen on an H100, torch 2.11) is no synchronising call.
    return [f"{w.filename}:{w.lineno}" + ("" if str(w.message).startswith(SYNC_MESSAGE) else f" ({str(w.message)[:160]})")
            for w in caught if "synchroniz" in str(w.message) and "is a prototype feature" not in str(w.message)]


def modes_table(args, extra: list[str]) -> None:
    results = []
    for preset in args.presets.split(","):
        for impl in args.impls.split(","):
            for compiled in [m == "compiled" for m in args.compile_modes.split(",")]:
                cmd = [sys.executable, __file__, "--one-mode", f"{preset}:{impl}:{int(compiled)}", "--flavor",
                       args.flavor, "--device", args.device, "--batch", str(args.batch), "--seq-len",
                       str(args.seq_len), "--steps", str(args.steps), *(["--trace"] if args.trace else []),
                       "--rowwise-route", args.rowwise_route, *extra]
                name = f"{preset} {impl} {'compiled' if compiled else 'eager'}"
                if args.profile and name == args.profile:
                    cmd += ["--profile-to", str(Path(args.profile_dir) / f"profile-{preset}-{impl}-{int(compiled)}.txt")]
                print(f"--- {name}", flush=True)
                start = time.perf_counter()
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
                except subprocess.TimeoutExpired:
                    print(f"    over {args.run_timeout} s: left out", flush=True)
                    continue
                if proc.returncode:
                    print(proc.stderr[-2000:], flush=True)
                    continue
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                r = results[-1]
                print(f"    {time.perf_counter() - start:.0f} s: {r['tokens_per_sec']:.0f} tok/s, peak "
                      f"{r['peak_memory_bytes'] / 2**30:.1f} GiB, {r['graph_breaks']} graph breaks, "
                      f"synchronising calls in a non-log step: {r['synchronising_calls']}", flush=True)
                for line in r["log"]:
                    print(f"    {line}", flush=True)
    print(f"\n{args.flavor} flavor, {args.batch} x {args.seq_len} tokens per step, {args.device}")
    print(f"{'preset':<12}{'impl':<9}{'mode':<10}{'tok/s':>10}{'MFU':>8}{'peak GiB':>10}{'vs plain':>10}")
    by_key = {(r["preset"], r["impl"], r["compiled"]): r for r in results}
    for r in results:
        plain = by_key.get((r["preset"], "plain", r["compiled"]))
        ratio = r["tokens_per_sec"] / plain["tokens_per_sec"] if plain else float("nan")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"{r['preset']:<12}{r['impl']:<9}{'compiled' if r['compiled'] else 'eager':<10}"
              f"{r['tokens_per_sec']:>10.0f}{mfu:>8}{r['peak_memory_bytes'] / 2**30:>10.1f}{ratio:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="small")
    p.add_argument("--presets", default="fp32,bf16-mixed,bf16-true,fp16-mixed")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--native-steps", type=int, default=1, help="plain-loop steps with native kernels; 0 skips")
    p.add_argument("--native-presets", default="bf16-mixed", help="presets to run the native plain loop for (slow "
                   "on CPUs without BF16/FP16 GEMM kernels)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one preset in this process
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--device", default="cpu", help="cpu or cuda; cuda measures eager and compiled (--modes)")
    p.add_argument("--modes", action="store_true", help="eager and compiled, mixprec and plain (default on cuda)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (with --modes)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (with --modes)")
    p.add_argument("--impls", default="plain,mixprec", help="with --modes: plain, mixprec or both")
    p.add_argument("--compile-modes", default="eager,compiled", help="with --modes: eager, compiled or both")
    p.add_argument("--run-timeout", type=float, default=900, help="with --modes: seconds before a run is left out")
    p.add_argument("--profile", help="with --modes: profile this run ('PRESET IMPL eager|compiled') to a text file")
    p.add_argument("--profile-dir", default=".", help="where --profile writes its table")
    p.add_argument("--trace", action="store_true", help="with --profile: also a Chrome trace beside the table")
    p.add_argument("--rowwise-route", choices=("auto", "after", "kernel"), default="auto",
                   help="row-wise FP8 GEMMs: mixprec's choice (auto), unit scales with the row scales after, or "
                        "torch's row-wise kernel")
    p.add_argument("--one-mode", help=argparse.SUPPRESS)  # internal: preset:impl:compiled in this process
    p.add_argument("--profile-to", help=argparse.SUPPRESS)
    args, extra = p.parse_known_args()
    if args.one_mode:
        preset, impl, compiled = args.one_mode.split(":")
        print(json.dumps(one_mode(preset, impl, compiled == "1", args.flavor, args.device, args.batch, args.seq_len,
                                  args.steps, extra, args.profile_to, args.trace, args.rowwise_route)))
        return
    if args.modes or args.device == "cuda":
        modes_table(args, extra)
        return
    if args.one:
        print(json.dumps(one(args.one, args.flavor, args.steps, args.native_steps, extra)))
        return
    gemm = {}
    for shape in ("small w1", "small w2"):
        m, k, n = SHAPES[shape]
        c = cases(m, k, n, torch.device("cpu"))
        for kind in ("fp32", "bf16 native"):
            gemm[kind] = max(gemm.get(kind, 0), gflops(c[kind], 2 * m * k * n, torch.device("cpu")) * 1e9)
    results = []
    for preset in args.presets.split(","):
        cmd = [sys.executable, __file__, "--one", preset, "--flavor", args.flavor, "--steps", str(args.steps),
               "--native-steps", str(args.native_steps if preset in args.native_presets.split(",") else 0), *extra]
        print(f"--- {preset}", flush=True)
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    base = results[0]
    print(f"\n{args.flavor} flavor, {base['tokens_per_step']} tokens per step, {torch.get_num_threads()} threads; "
          f"GEMM peaks: fp32 {gemm['fp32'] / 1e9:.0f}, native bf16 {gemm['bf16 native'] / 1e9:.0f} GFLOP/s")
    head = (f"{'preset':<12}{'tok/s':>8}{'vs base':>8}{'MFU fp32pk':>11}{'MFU bf16pk':>11}{'fwd ms':>8}{'bwd ms':>8}"
            f"{'opt ms':>8}{'prec ms':>8}{'plain/mix':>10}{'native tok/s':>13}{'peak RSS MiB':>13}{'vs base':>8}")
    print(head)
    for r in results:
        tps = r["tokens_per_step"] / r["mixprec_step_s"]
        r["tokens_per_sec"] = tps
        r["mfu_fp32_peak"] = r["flops_per_token"] * tps / gemm["fp32"]
        r["mfu_bf16_peak"] = r["flops_per_token"] * tps / gemm["bf16 native"]
        r["mixprec_vs_plain"] = r["plain_emulated_step_s"] / r["mixprec_step_s"]
        b = r["breakdown_s"]
        native = r["tokens_per_step"] / r["plain_native_step_s"] if "plain_native_step_s" in r else None
        print(f"{r['preset']:<12}{tps:>8.0f}{tps * base['mixprec_step_s'] / base['tokens_per_step']:>8.2f}"
              f"{r['mfu_fp32_peak']:>11.1%}{r['mfu_bf16_peak']:>11.0%}{b['forward'] * 1e3:>8.0f}"
              f"{b['backward'] * 1e3:>8.0f}{b['optimizer'] * 1e3:>8.0f}{b['bookkeeping'] * 1e3:>8.1f}"
              f"{r['mixprec_vs_plain']:>10.3f}{native if native else float('nan'):>13.1f}"
              f"{r['peak_rss_bytes'] / 2**20:>13.0f}{r['peak_rss_bytes'] / base['peak_rss_bytes']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gemm_peaks": gemm, "results": results}, indent=2))


if __name__ == "__main__":
    main()
