"""The declared interfaces hold: every weight source mixprec reads is a WeightSource, every
architecture's adapter a StateDictAdapter (the mixprec-checkpoint map a NameMap), and the
loader reads through them alone."""

import torch

from helpers import save_tiny
from mixprec.interop.adapters import adapter_for
from mixprec.interop.hf_folder import HFFolder
from mixprec.interop.interfaces import NameMap, StateDictAdapter, WeightSource
from mixprec.interop.load import CheckpointWeights, OwnNames, load_weights, materialize
from mixprec.interop.safetensors_io import SafetensorsFile, write_file
from mixprec.models.hf import HFCausalLM, hf_config_from_dict
from mixprec.models.llama import Llama, build_model, model_args


def test_every_source_and_adapter_implements_its_interface(tmp_path):
    save_tiny(tmp_path / "hf")
    write_file(tmp_path / "one.safetensors", {"w": torch.ones(2, 3)})
    args = model_args("debug", 256)
    model = build_model(args, device="cpu", storage_dtype=torch.float32, seed=0)
    torch.save({"format": 1, "meta": args.architecture(), "step": 3, "model": model.state_dict()}, tmp_path / "c.pt")
    sources = [HFFolder(tmp_path / "hf"), SafetensorsFile(tmp_path / "one.safetensors"),
               CheckpointWeights(tmp_path / "c.pt")]
    assert all(isinstance(s, WeightSource) for s in sources)
    assert sources[1].names() == ["w"] and sources[1].shape("w") == (2, 3)
    hf_model = HFCausalLM(hf_config_from_dict(HFFolder(tmp_path / "hf").config, "test"))
    for adapter in (adapter_for(model), adapter_for(hf_model)):
        assert isinstance(adapter, StateDictAdapter), type(adapter).__name__
    assert isinstance(OwnNames(), NameMap) and not isinstance(OwnNames(), StateDictAdapter)
    assert not isinstance(object(), WeightSource)


def test_a_checkpoint_loads_through_the_interfaces_alone(tmp_path):
    """The loader asks only what the interfaces declare: a source written here from scratch
    (names, shape, dtype, read) loads, rows and all."""
    args = model_args("debug", 256, tie_embeddings=True)
    saved = build_model(args, device="cpu", storage_dtype=torch.float32, seed=1)
    tensors = {k: v.clone() for k, v in saved.state_dict().items() if k != "output.weight"}  # a tie stored once

    class Plain:
        path = "in memory"

        def names(self):
            return list(tensors)

        def shape(self, name):
            return tuple(tensors[name].shape)

        def dtype(self, name):
            return tensors[name].dtype

        def read(self, name, rows=None):
            return tensors[name] if rows is None else tensors[name][rows]

    assert isinstance(Plain(), WeightSource)
    with torch.device("meta"):
        model = Llama(args)
    materialize(model, torch.device("cpu"))
    load_weights(model, Plain(), OwnNames())
    assert model.output.weight is model.tok_embeddings.weight
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
