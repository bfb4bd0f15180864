"""Run under torchrun by test_finetune.py: fine-tune a Hugging Face Llama folder under FSDP2 in
each preset given, counting the safetensors bytes this rank reads; writes rank-N.json."""

import json
import os
import sys

from mixprec.config import load_config
from mixprec.distributed.parallel import exit_process_group
from mixprec.interop import safetensors_io
from mixprec.train.trainer import Trainer

hf, text, out, presets = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
read = {"bytes": 0}
plain_read = safetensors_io.SafetensorsFile.read


def counted(self, name, rows=None):
    t = plain_read(self, name, rows)
    read["bytes"] += t.numel() * t.element_size()
    return t


safetensors_io.SafetensorsFile.read = counted
rank, results = int(os.environ["RANK"]), {}
for preset in presets:
    read["bytes"] = 0
    config = load_config(None, {
        "checkpoint.initial_load": hf, "data.source": text, "job.dump_folder": f"{out}/{preset}",
        "precision.preset": preset, "training.device": "cpu", "training.steps": "8", "training.seq_len": "32",
        "training.local_batch_size": "2", "training.warmup_steps": "0", "training.lr": "3e-3",
        "training.eval_interval": "8", "training.eval_batches": "2", "metrics.progress_bar": "false",
        "metrics.plot": "false", "checkpoint.interval": "8", "parallelism.data_parallel_shard_degree": "2"})
    Trainer(config).train()
    results[preset] = {"bytes_read": read["bytes"]}
with open(f"{out}/rank-{rank}.json", "w") as f:
    json.dump(results, f)
exit_process_group(0)
