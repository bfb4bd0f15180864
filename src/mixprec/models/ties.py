"""Tied parameters, one rule for every model: a Parameter that several modules hold (an output
projection sharing the token embeddings) belongs to the first name `named_modules` reaches it
by, and each later name is a tie of it. A tie is stored once, under the first name (Hugging
Face folders, export), sharded in one FSDP unit (the root's), and made again after anything
that gives each module its own tensor (`to_empty`). A module reached by two paths
(`HFCausalLM.layers` is its decoder's own list) is not a tie: its parameters have one owner."""

from __future__ import annotations

from torch import nn


def tie_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(tied name, the first name holding the same Parameter), in module order."""
    first, pairs = {}, []
    for fqn, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{fqn}.{name}" if fqn else name
            if id(p) in first:
                pairs.append((full, first[id(p)]))
            else:
                first[id(p)] = full
    return pairs


def tied_names(model: nn.Module) -> set[str]:
    """The names stored nowhere of their own: each tie's later names."""
    return {name for name, _ in tie_pairs(model)}


def tied_modules(model: nn.Module) -> set[str]:
    """The modules holding either side of a tie (the embeddings and the output projection)."""
    return {name.rpartition(".")[0] for pair in tie_pairs(model) for name in pair}


def retie(model: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """Make each tie of `pairs` (from `tie_pairs` before the tensors were remade) one Parameter again."""
    for name, first in pairs:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(first))
