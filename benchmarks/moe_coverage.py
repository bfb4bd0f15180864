"""How much of each Hugging Face mixture-of-experts family runs in a narrow recipe: the share of
the decoder blocks' matmul parameters (Linear weights, routers and expert matrices; not the
output head, which every recipe keeps wide) whose GEMMs the precision layout puts in the recipe, per family and preset, on the tiny configs of
benchmarks/moe_accuracy.py (2 layers, 8 experts, top-2), and for mixprec's own MoE flavors (built on the
meta device: moe-16B's full shape). Nothing is trained.

    python benchmarks/moe_coverage.py [--presets fp8-rowwise,mxfp8,nvfp4] [--families moe-small,moe-16B,qwen3_moe]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_accuracy import BASE, FAMILIES  # noqa: E402


def coverage(family: str, preset: str) -> tuple[float, int, int]:
    """(narrow share of matmul parameters, experts modules narrow, experts modules)."""
    from mixprec.narrow.convert import output_projections
    from mixprec.narrow.experts.hf import expert_weights
    from mixprec.precision import Policy

    from mixprec.models.llama import FLAVORS, build_model, model_args

    if family in FLAVORS:
        model = build_model(model_args(family, 256), device="meta", storage_dtype=torch.float32, seed=None)
    else:
        import transformers

        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(family, **{**BASE, **FAMILIES[family]})
        model = transformers.AutoModelForCausalLM.from_config(config)
    policy = Policy.from_preset(preset)
    layout = policy.prepare_model(model)
    head = output_projections(model)
    narrow = total = 0
    experts = [0, 0]
    for fqn, m in layout.modules.items():
        module = model.get_submodule(fqn)
        if m.kind == "experts":
            params = sum(p.numel() for p in expert_weights(module).values())
            experts[1] += 1
            experts[0] += not isinstance(m.compute, torch.dtype)
        elif fqn not in head and (isinstance(module, nn.Linear) or m.kind == "router"):
            params = module.weight.numel()
        else:
            continue
        total += params
        narrow += params if not isinstance(m.compute, torch.dtype) else 0
    return narrow / total, experts[0], experts[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="fp8-tensorwise,fp8-rowwise,fp8-blockwise,mxfp8,nvfp4,mxfp4")
    parser.add_argument("--families", default=",".join(["moe-debug", "moe-small", "moe-16B", *FAMILIES]))
    args = parser.parse_args()
    presets = args.presets.split(",")
    print("| family | " + " | ".join(presets) + " |\n|---|" + "---:|" * len(presets))
    for family in args.families.split(","):
        cells = []
        for preset in presets:
            share, narrow, total = coverage(family, preset)
            cells.append(f"{share:.1%} ({narrow}/{total} experts)")
        print(f"| {family} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
