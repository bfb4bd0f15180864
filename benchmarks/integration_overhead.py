"""Step time of mixprec inside Fabric, the Lightning Trainer and the Hugging Face Trainer
against each framework's own bf16-mixed, side by side in one process.

    python benchmarks/integration_overhead.py               # 3 rounds of 12 steps per variant
    python benchmarks/integration_overhead.py --rounds 5 --steps 16

The same transformers Llama (hidden 256, 4 layers, vocabulary 1024; batch 8 x 128 tokens),
AdamW, clipping at 1.0; per framework the two variants alternate round by round (the first 2
steps of each round are not timed); medians of the per-step times. Run it alone on the
machine: two torch processes on 2 cores time nothing.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch

BATCH, SEQ = 8, 128


def model_and_data(steps: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(steps):
        ids = torch.randint(0, 1024, (BATCH, SEQ), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    return LlamaForCausalLM(config), data


def fabric(mixprec: bool, steps: int) -> list[float]:
    import lightning as L

    from mixprec.lightning import FabricPrecision

    model, data = model_and_data(steps)
    kwargs = {"plugins": [FabricPrecision("bf16-mixed", max_norm=1.0, device_type="cpu")]} if mixprec else \
        {"precision": "bf16-mixed"}
    f = L.Fabric(accelerator="cpu", devices=1, **kwargs)
    model, opt = f.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times = []
    for batch in data:
        start = time.perf_counter()
        loss = model(**batch).loss
        f.backward(loss)
        if not mixprec:
            f.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def trainer(mixprec: bool, steps: int) -> list[float]:
    import lightning as L

    from mixprec.lightning import TrainerPrecision

    model, data = model_and_data(steps)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, index):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(L.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    kwargs = {"plugins": [TrainerPrecision("bf16-mixed", device_type="cpu")]} if mixprec else {"precision": "bf16-mixed"}
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=1.0, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
              **kwargs).fit(Module(), torch.utils.data.DataLoader(data, batch_size=None))
    return clock.times


def hf_trainer(mixprec: bool, steps: int) -> list[float]:
    import transformers

    import mixprec.hf

    model, data = model_and_data(steps)

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            for b in data:
                for i in range(BATCH):
                    yield {k: v[i] for k, v in b.items()}

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    with tempfile.TemporaryDirectory() as folder:
        args = transformers.TrainingArguments(output_dir=folder, use_cpu=True, max_steps=steps, bf16=not mixprec,
                                              per_device_train_batch_size=BATCH, max_grad_norm=1.0, logging_steps=10**6,
                                              save_strategy="no", report_to=[], disable_tqdm=True,
                                              dataloader_num_workers=0)
        cls = mixprec.hf.Trainer if mixprec else transformers.Trainer
        extra = {"precision": "bf16-mixed"} if mixprec else {}
        cls(model=model, args=args, train_dataset=Rows(), callbacks=[clock], **extra).train()
    return clock.times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| framework | its own bf16-mixed (ms/step) | mixprec bf16-mixed (ms/step) | mixprec / own |")
    print("|---|---|---|---|")
    for name, run in (("Fabric", fabric), ("Lightning Trainer", trainer), ("HF Trainer", hf_trainer)):
        own, ours = [], []
        for _ in range(args.rounds):
            own += run(False, args.steps)[2:]
            ours += run(True, args.steps)[2:]
        a, b = statistics.median(own), statistics.median(ours)
        print(f"| {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.3f} |", flush=True)


if __name__ == "__main__":
    main()
