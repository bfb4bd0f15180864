"""The narrow recipes on the experts of tiny Hugging Face mixture-of-experts models: each
family (2 decoder layers, 8 experts, top-2, randomly initialised from a config.json written
here) trained by `mixprec compare` on the default corpus (this Python's standard library)
for several seeds, then each recipe's final validation loss against bf16-mixed, seed by seed
(benchmarks/seed_spread.py).

    python benchmarks/moe_accuracy.py --out runs/moe-acc [--families qwen3_moe,mixtral,gpt_oss]   # any of FAMILIES
        [--presets bf16-mixed,fp8-rowwise,...] [--seeds 0,1,2] [--steps 150]

Each compare run prints its own progress; a family's table follows its last seed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BASE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=1024,
            num_experts_per_tok=2)
FAMILIES = {  # each family's own names for the expert count and its layout
    "qwen3_moe": dict(num_experts=8, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, shared_expert_intermediate_size=64),
    "mixtral": dict(num_local_experts=8, intermediate_size=64),
    "olmoe": dict(num_experts=8, intermediate_size=64),
    "deepseek_v3": dict(n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                        kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                        head_dim=16),
    "gpt_oss": dict(num_local_experts=8, intermediate_size=64, layer_types=["full_attention"] * 2),  # transposed, biased
}
PRESETS = "bf16-mixed,fp8-tensorwise,fp8-rowwise,fp8-blockwise,mxfp8,nvfp4,mxfp4"


def write_config(folder: Path, family: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": family, **BASE, **FAMILIES[family]}, indent=1))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", default="qwen3_moe,mixtral,gpt_oss")
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    out, here = Path(args.out), Path(__file__).resolve().parent
    for family in args.families.split(","):
        if family not in FAMILIES:
            sys.exit(f"--families: unknown family {family!r}; accepted: {', '.join(FAMILIES)}")
        config = write_config(out / family / "config", family)
        runs = []
        for seed in args.seeds.split(","):
            run = out / family / f"seed{seed}"
            if not (run / "compare.json").is_file():
                subprocess.run([sys.executable, "-m", "mixprec", "compare", "--presets", args.presets, "--config",
                                str(here.parent / "configs" / "debug.toml"), "--model.hf_config", str(config),
                                "--training.steps", str(args.steps), "--training.warmup_steps", "15",
                                "--training.eval_interval", str(args.steps), "--training.eval_batches", "8",
                                "--training.seed", seed, "--job.dump_folder", str(run)],
                               check=False)
            runs.append(str(run))
        print(f"## {family}", flush=True)
        subprocess.run([sys.executable, str(here / "seed_spread.py"), *runs, "--plot",
                        str(out / family / "seed_spread.png")], check=False)


if __name__ == "__main__":
    main()
