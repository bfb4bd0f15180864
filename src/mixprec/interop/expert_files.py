"""A mixture of experts' weights as Hugging Face folders hold them on disk: one Linear per expert and projection
(`mlp.experts.{e}.gate_proj.weight` (I, D), `up_proj` (I, D), `down_proj` (D, I)), which transformers merges
into the fused tensors its models hold (`mlp.experts.gate_up_proj` (E, 2I, D), gate first; `down_proj`
(E, D, I)) and which inference engines read per expert, each with its own scales in a narrow format.

    tensors, linears = per_expert(tensors)        # fused -> per expert (export in a narrow format)
    source = Fused(source, wanted)                 # a per-expert folder read as the fused tensors a model wants

Only the fused layout transformers' qwen2_moe conversion maps (Qwen2/3-MoE, DeepSeek-V3, GLM-4-MoE, mixprec's
MoE flavors as Glm4Moe: `PER_EXPERT`) is split or merged; other families' fused experts (gpt-oss's, transposed
with their gate and up interleaved) stay as they are.
"""

from __future__ import annotations

import re

import torch

from mixprec.interop.interfaces import View

_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_SPLIT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


# model types whose checkpoints hold one Linear per expert that transformers merges as qwen2_moe's conversion does
PER_EXPERT = ("qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v2", "deepseek_v3", "olmoe")


def per_expert(tensors: dict[str, torch.Tensor], model_type: str = "glm4_moe") -> tuple[dict[str, torch.Tensor],
                                                                                       dict[str, str]]:
    """(the tensors with each fused (E, N, K) experts tensor split into one 2-D weight per expert and
    projection, the new weights' names -> their Linear's name); a model type not in PER_EXPERT unchanged."""
    if model_type not in PER_EXPERT:
        return tensors, {}
    out, linears = {}, {}
    for name, t in tensors.items():
        m = _FUSED.match(name)
        if m is None or t.dim() != 3:
            out[name] = t
            continue
        prefix, proj = m.groups()
        parts = (("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",))
        for e in range(t.shape[0]):
            for part, w in zip(parts, t[e].chunk(len(parts), dim=0)):
                module = f"{prefix}.{e}.{part}"
                out[module + ".weight"] = w.contiguous()
                linears[module + ".weight"] = module
    return out, linears


def is_fused(name: str) -> bool:
    """Whether `name` is a fused experts tensor (`...experts.gate_up_proj`, `...experts.down_proj`)."""
    return _FUSED.match(name) is not None


class Fused(View):
    """A folder with one weight per expert read as the fused experts tensors of `wanted`; a rank's rows of a
    fused tensor are its experts, and only theirs are read."""

    def __init__(self, source, wanted):
        super().__init__(source)
        groups: dict[tuple[str, str], dict[int, str]] = {}
        for name in source.names():
            m = _SPLIT.match(name)
            if m is not None:
                prefix, e, part = m.groups()
                groups.setdefault((prefix, part), {})[int(e)] = name
        self.fused: dict[str, tuple[list[str], ...]] = {}
        for (prefix, part), by_expert in groups.items():
            experts = [by_expert[e] for e in sorted(by_expert)]
            if part == "down_proj" and f"{prefix}.down_proj" in wanted:
                self.fused[f"{prefix}.down_proj"] = (experts,)
            elif part == "gate_proj" and f"{prefix}.gate_up_proj" in wanted and (prefix, "up_proj") in groups:
                ups = groups[(prefix, "up_proj")]
                self.fused[f"{prefix}.gate_up_proj"] = (experts, [ups[e] for e in sorted(ups)])
        self.hidden = {n for parts in self.fused.values() for names in parts for n in names}

    @property
    def made(self) -> dict[str, tuple[list[str], ...]]:
        return self.fused

    def __bool__(self) -> bool:
        return bool(self.fused)

    def _shape(self, name: str) -> tuple[int, ...]:
        parts = self.fused[name]
        rows, cols = self.source.shape(parts[0][0])
        return len(parts[0]), rows * len(parts), cols

    def _dtype(self, name: str) -> torch.dtype:
        return self.source.dtype(self.fused[name][0][0])

    def _read(self, name: str, rows: slice | None) -> torch.Tensor:
        parts = self.fused[name]
        experts = range(len(parts[0]))[rows] if rows is not None else range(len(parts[0]))
        return torch.stack([torch.cat([self.source.read(names[e]) for names in parts]) for e in experts])
