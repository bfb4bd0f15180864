"""The memory planner against PyTorch's MemTracker on real training steps (CPU or CUDA).

One warm-up step, then one step under torch.distributed._tools.mem_tracker.MemTracker,
which tags every tensor allocation (parameters, gradients, optimizer states,
activations, temporaries) and reports the peak; the planner's peak is printed beside it.

    python benchmarks/memory_planner.py --flavor small --presets fp32,bf16-mixed,bf16-true --batch 4 --seq-len 256
    python benchmarks/memory_planner.py --device cuda --flavor 1B --presets bf16-mixed --batch 4 --seq-len 2048 \
        --attention sdpa --loss chunked --checkpointing selective
"""

from __future__ import annotations

import argparse

import torch

from mixprec import Policy, build_model, model_args
from mixprec.analysis.memory import Setup, plan
from mixprec.models.loss import loss_chunk
from mixprec.train.parallelize import apply_activation_checkpointing


def measured_peak(flavor: str, preset: str, batch: int, seq_len: int, attention: str = "eager",
                  checkpointing: str = "none", vocab_size: int = 256, loss: str = "full", device: str = "cpu",
                  overrides=()) -> float:
    """Peak bytes of one steady-state training step, as MemTracker sees it."""
    from dataclasses import replace

    from torch.distributed._tools.mem_tracker import MemTracker

    args = replace(model_args(flavor, vocab_size), attention=attention)
    args = replace(args, loss_chunk=loss_chunk(loss, args.vocab_size, batch * seq_len))
    policy = Policy.from_preset(preset, overrides=overrides)
    model = build_model(args, device=device, storage_dtype=policy.storage_dtype, seed=0)
    apply_activation_checkpointing(model, checkpointing)
    # setup puts mixprec's AdamW in place where the mode keeps other moments (bfloat16, 8-bit)
    _, opt = policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        with policy.autocast():
            loss = model(x[:, :-1], x[:, 1:])
        policy.backward(loss)
        policy.step(opt, 1.0)

    step()  # optimizer states exist from here on
    tracker = MemTracker()
    masters = list(policy.masters.named_masters(model).values()) if policy.masters is not None else []
    tracker.track_external(model, opt, *masters)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")
    return next(v["Total"] for k, v in snapshot.items() if k.type == torch.device(device).type)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="small")
    p.add_argument("--presets", default="fp32,bf16-mixed,bf16-true")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--attention", default="eager", choices=["eager", "sdpa"])
    p.add_argument("--checkpointing", default="none", choices=["none", "selective", "full"])
    p.add_argument("--loss", default="full", choices=["full", "chunked"])
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--device", default="cpu", help="cpu or cuda (MemTracker follows CUDA allocations too)")
    a = p.parse_args()
    print(f"{'preset':<12} {'measured MiB':>13} {'planned MiB':>12} {'error':>7}")
    for preset in a.presets.split(","):
        got = measured_peak(a.flavor, preset, a.batch, a.seq_len, a.attention, a.checkpointing, a.vocab_size, a.loss,
                            a.device)
        want = plan(Setup(model_args(a.flavor, a.vocab_size), preset, a.batch, a.seq_len, attention=a.attention,
                          checkpointing=a.checkpointing, loss=a.loss))["bytes"]["peak"]
        print(f"{preset:<12} {got / 2**20:13.1f} {want / 2**20:12.1f} {want / got - 1:+7.1%}", flush=True)


if __name__ == "__main__":
    main()
