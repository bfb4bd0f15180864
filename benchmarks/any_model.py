"""A user's own model under mixprec's library API: step time per preset against FP32, side by
side in one process, for a tiny Hugging Face LlamaForCausalLM (hidden 256, 4 layers,
vocabulary 256; random init, nothing downloaded) trained on this repository's README bytes.

The loop is the README's: Policy.setup, autocast, backward, step. Each row is the median of
`--steps` steps after 3 warm-up steps, 8 x 128 tokens. Run it alone on the machine.

    python benchmarks/any_model.py [--presets fp32,bf16-mixed,fp16-mixed] [--attention sdpa,sdpa-native,eager]
    python benchmarks/any_model.py --memory --presets fp32,bf16-mixed,bf16-true,fp16-master,fp8-tensorwise
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import mixprec
import mixprec.optim


def tiny_llama(attention: str = "sdpa", arch: str = "llama"):
    """A tiny model of `arch` (llama, qwen2, gpt2): hidden 256, 4 layers, vocabulary 256."""
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_positions=256, n_embd=256, n_layer=4, n_head=4, attn_implementation=attention))
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    return model_class(config_class(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    attn_implementation=attention))


def batches(n: int, batch: int = 8, seq: int = 128):
    data = torch.tensor(list((Path(__file__).parent.parent / "README.md").read_bytes()), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq + 1] for s in starts])
        yield {"input_ids": x[:, :-1], "labels": x[:, :-1]}


def run(preset: str, attention: str, steps: int, arch: str = "llama") -> dict:
    """attention: a transformers attn_implementation, or sdpa-native: SDPA with its bfloat16
    and float16 CPU kernels left out of the matmul emulation (as before mixprec covered them)."""
    from mixprec.precision import emulation

    saved = dict(emulation._ATTENTION)
    if attention == "sdpa-native":
        emulation._ATTENTION.clear()
    try:
        return _run(preset, attention.removesuffix("-native"), steps, arch)
    finally:
        emulation._ATTENTION.update(saved)


def _run(preset: str, attention: str, steps: int, arch: str) -> dict:
    policy = mixprec.Policy.from_preset(preset)
    model = tiny_llama(attention, arch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = policy.setup(model, optimizer)
    times, losses = [], []
    for i, batch in enumerate(batches(steps + 3)):
        start = time.perf_counter()
        with policy.autocast():
            loss = model(**batch).loss
        policy.backward(loss)
        policy.step(optimizer, max_norm=1.0)
        if i >= 3:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"step_s": statistics.median(times), "loss": statistics.mean(losses[-5:])}


def _measured_step(build, preset, batch, mesh=None):
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    policy = mixprec.Policy.from_preset(preset, emulate_matmul=False)
    model = build()
    if mesh is not None:  # the trainer's FSDP2 layout for any model, as plan_memory applies it
        from mixprec.analysis.plan_model import _shard

        _shard(model, policy, mesh)
    # setup puts mixprec's AdamW in place where the mode keeps other moments (fp8-blockwise: bfloat16)
    model, optimizer = policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=mesh is None))

    def step():
        with policy.autocast():
            loss = model(*batch) if isinstance(batch, tuple) else model(**batch).loss
        policy.backward(loss)
        policy.step(optimizer)

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _rank(rank: int, world: int, init: str, build, preset, batch, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        peak = _measured_step(build, preset, batch, init_device_mesh("cpu", (world,)))
        if rank == 0:
            Path(out).write_text(str(peak))
    finally:
        dist.destroy_process_group()


def measured_peak(build, preset, batch, dp_shard: int = 1, backend: str = "gloo"):
    """MemTracker's peak of a real steady step of the library loop (matmul emulation off:
    the planner plans the program, not the CPU's emulation of it); with dp_shard, rank 0's
    under FSDP2 on that many gloo processes (`build` must be picklable), or with backend
    "fake" on real tensors in this process under PyTorch's fake process group (collectives
    move no data and hold no buffer of their own, as plan_memory plans them)."""
    if dp_shard == 1:
        return _measured_step(build, preset, batch)
    if backend == "fake":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp_shard)
        try:
            return _measured_step(build, preset, batch, init_device_mesh("cpu", (dp_shard,)))
        finally:
            dist.destroy_process_group()
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out, init = Path(tmp) / "peak", f"file://{tmp}/store"
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # two ranks on two cores
        try:
            mp.spawn(_rank, args=(dp_shard, init, build, preset, batch, str(out)), nprocs=dp_shard)
        finally:
            torch.set_num_threads(torch_threads)
        return int(out.read_text())


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=256, n_embd=256, n_layer=4, n_head=4))


def memory_table(presets: list[str]) -> None:
    """mixprec.plan_memory against MemTracker's measured peak of a real step, per architecture."""
    batch = next(batches(1))
    print(f"{'model':<8}{'preset':<16}{'planned MiB':>12}{'measured MiB':>13}{'planned/measured':>17}")
    for name, build in (("llama", tiny_llama), ("gpt2", tiny_gpt2)):
        for preset in presets:
            planned = mixprec.plan_memory(build, preset, batch)["peak_bytes"]
            measured = measured_peak(build, preset, batch)
            print(f"{name:<8}{preset:<16}{planned / 2**20:>12.1f}{measured / 2**20:>13.1f}{planned / measured:>17.3f}",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="fp32,bf16-mixed,fp16-mixed")
    p.add_argument("--attention", default="sdpa,sdpa-native,eager")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--models", default="llama", help="llama, qwen2, gpt2 (comma-separated)")
    p.add_argument("--memory", action="store_true", help="planned against measured peak memory instead of time")
    args = p.parse_args()
    if args.memory:
        import logging

        logging.getLogger("mixprec").setLevel(logging.ERROR)  # the measured runs' emulation-off warnings
        memory_table(args.presets.split(","))
        return
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'model':<7}{'attention':<13}{'preset':<16}{'ms/step':>9}{'vs fp32':>9}{'loss (last 5)':>15}"
          f"{'vs fp32':>9}")
    for arch in args.models.split(","):
        for attention in args.attention.split(","):
            base = None
            for preset in args.presets.split(","):
                r = run(preset, attention, args.steps, arch)
                base = base or r
                print(f"{arch:<7}{attention:<13}{preset:<16}{r['step_s'] * 1e3:>9.0f}{r['step_s'] / base['step_s']:>9.2f}"
                      f"{r['loss']:>15.4f}{r['loss'] / base['loss'] - 1:>+9.2%}", flush=True)


if __name__ == "__main__":
    main()
