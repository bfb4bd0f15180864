"""A user's own model under mixprec's library API: step time per preset against FP32, side by
side in one process, for a tiny Hugging Face LlamaForCausalLM (hidden 256, 4 layers,
vocabulary 256; random init, nothing downloaded) trained on this repository's README bytes.

The loop is the README's: Policy.setup, autocast, backward, step. Each row is the median of
`--steps` steps after 3 warm-up steps, 8 x 128 tokens. Run it alone on the machine.

    python benchmarks/any_model.py [--presets fp32,bf16-mixed,fp16-mixed] [--attention sdpa,sdpa-native,eager]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import mixprec


def tiny_llama(attention: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation=attention)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batches(n: int, batch: int = 8, seq: int = 128):
    data = torch.tensor(list((Path(__file__).parent.parent / "README.md").read_bytes()), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq + 1] for s in starts])
        yield {"input_ids": x[:, :-1], "labels": x[:, :-1]}


def run(preset: str, attention: str, steps: int) -> dict:
    """attention: a transformers attn_implementation, or sdpa-native: SDPA with its bfloat16
    and float16 CPU kernels left out of the matmul emulation (as before mixprec covered them)."""
    from mixprec.precision import emulation

    saved = dict(emulation._ATTENTION)
    if attention == "sdpa-native":
        emulation._ATTENTION.clear()
    try:
        return _run(preset, attention.removesuffix("-native"), steps)
    finally:
        emulation._ATTENTION.update(saved)


def _run(preset: str, attention: str, steps: int) -> dict:
    policy = mixprec.Policy.from_preset(preset)
    model = tiny_llama(attention)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="fp32,bf16-mixed,fp16-mixed")
    p.add_argument("--attention", default="sdpa,sdpa-native,eager")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'attention':<13}{'preset':<12}{'ms/step':>9}{'vs fp32':>9}{'loss (last 5)':>15}")
    for attention in args.attention.split(","):
        base = None
        for preset in args.presets.split(","):
            r = run(preset, attention, args.steps)
            base = base or r["step_s"]
            print(f"{attention:<13}{preset:<12}{r['step_s'] * 1e3:>9.0f}{r['step_s'] / base:>9.2f}{r['loss']:>15.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
