"""The one tie rule: which names share a tensor, for the builder, the loader, export and FSDP2."""

import torch
from torch import nn

from mixprec.models.llama import Llama, build_model, model_args
from mixprec.models.ties import retie, tie_pairs, tied_modules, tied_names


def test_a_tied_llama_has_one_tie_under_the_embeddings_name():
    args = model_args("debug", 256, tie_embeddings=True)
    with torch.device("meta"):
        model = Llama(args)
    assert tie_pairs(model) == [("output.weight", "tok_embeddings.weight")]
    assert tied_names(model) == {"output.weight"} and tied_modules(model) == {"output", "tok_embeddings"}
    with torch.device("meta"):
        untied = Llama(model_args("debug", 256))
    assert tie_pairs(untied) == [] and tied_modules(untied) == set()


def test_a_module_reached_by_two_paths_is_not_a_tie():
    inner = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.layers = inner
    model.layers = inner  # HFCausalLM.layers is its decoder's own list
    assert tie_pairs(model) == []


def test_retie_after_to_empty_makes_one_parameter_again():
    with torch.device("meta"):
        model = Llama(model_args("debug", 256, tie_embeddings=True))
    pairs = tie_pairs(model)
    model.to_empty(device="cpu")
    assert model.output.weight is not model.tok_embeddings.weight  # to_empty gives each module its own
    retie(model, pairs)
    assert model.output.weight is model.tok_embeddings.weight
    built = build_model(model_args("debug", 256, tie_embeddings=True), device="cpu", storage_dtype=torch.float32,
                        seed=0)
    assert built.output.weight is built.tok_embeddings.weight
