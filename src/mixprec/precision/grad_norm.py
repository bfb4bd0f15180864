"""The global gradient norm over plain tensors and DTensors of several meshes."""

from __future__ import annotations

import torch


def grad_norm(params: list[torch.Tensor]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The global gradient norm, and the parameters grouped as it was reduced. Unlike
    clip_grad_norm_, the gradients may mix plain tensors with DTensors of several meshes
    and layouts (tensor parallel: sharded projections, replicated norms): each such group
    is reduced on its own, then the group norms are combined."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, g.placements) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(p)
    norms = []
    for key, group in groups.items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if key is not None else norm)  # a DTensor's norm: reduced over its mesh
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    return total, list(groups.values())
