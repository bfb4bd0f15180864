"""Pretrained weights in: a Hugging Face folder into mixprec's Llama (q/k rows reordered) or a
transformers model, checked by logits and by the first step's loss against transformers'."""

import json

import pytest
import torch

from conftest import run_train
from helpers import first_batch, hf_loss, save_tiny
from mixprec.cli import main
from mixprec.interop.adapters import LlamaAdapter, llama_fields
from mixprec.interop.hf_folder import HFFolder
from mixprec.interop.load import load_weights, materialize, open_source
from mixprec.models.llama import ModelArgs, build_model


def _mixprec_llama(folder):
    args = ModelArgs(**llama_fields(HFFolder(folder).config, "test"))
    model = build_model(args, device="cpu", storage_dtype=torch.float32, seed=None)
    materialize(model, torch.device("cpu"))
    load_weights(model, *open_source(folder, model))
    return model


@pytest.mark.parametrize("tie, shard", [(False, "5GB"), (True, "40KB")])
def test_hf_llama_logits_equal_mixprec_llama(tmp_path, tie, shard):
    hf = save_tiny(tmp_path / "llama", tie_word_embeddings=tie, _shard=shard)
    assert (tmp_path / "llama" / "model.safetensors.index.json").is_file() == (shard == "40KB")
    ours = _mixprec_llama(tmp_path / "llama")
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, mine = hf(input_ids=x).logits, ours(x)
    # the same weights; rotate_half against rotated pairs orders the sums differently
    assert (theirs - mine).abs().max() < 1e-5
    # and back: mixprec's layout to Hugging Face's gives the file's tensors bit for bit
    adapter, folder = LlamaAdapter(ours.args), HFFolder(tmp_path / "llama")
    for name, p in ours.named_parameters():
        assert torch.equal(adapter.to_hf(name, p.detach()), folder.read(adapter.hf_name(name)))


def test_q_k_rows_of_part_of_a_head_are_cut_from_whole_heads(tmp_path):
    save_tiny(tmp_path / "llama")
    folder, model = HFFolder(tmp_path / "llama"), _mixprec_llama(tmp_path / "llama")
    adapter, wq = LlamaAdapter(model.args), model.layers[1].attention.wq.weight.detach()
    for rows in (slice(0, 7), slice(5, 37), slice(30, 64)):  # head_dim 16: starts and ends inside heads
        assert torch.equal(adapter.read("layers.1.attention.wq.weight", folder.read, rows), wq[rows])


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_first_step_loss_equals_transformers_loss(tmp_path, text_file, model_type):
    hf = save_tiny(tmp_path / "hf", model_type)
    extra = () if model_type == "llama" else ("--model.hf_config", str(tmp_path / "hf"))
    records = run_train(tmp_path / "run", text_file, "--checkpoint.initial_load", str(tmp_path / "hf"),
                        "--precision.preset", "fp32", "--training.steps", "2", *extra)
    assert abs(records[0]["loss"] - hf_loss(hf, first_batch(text_file))) < 1e-5


def _fails(capsys, args, match):
    capsys.readouterr()  # what the test's own saving printed
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    return err


def _edit_weights(folder, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


BAD_LOADS = {
    "missing tensor": (lambda f: _edit_weights(f, lambda t: t.pop("model.norm.weight")), "tensors missing"),
    "left-over tensor": (lambda f: _edit_weights(f, lambda t: t.update(extra=torch.ones(2))), "no place for"),
    "shape": (lambda f: _edit_weights(f, lambda t: t.update({"model.norm.weight": torch.ones(65)})), "is [65]"),
    "dtype": (lambda f: _edit_weights(f, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int64)})),
              "floating-point"),
    "not a Llama": (lambda f: (f / "config.json").write_text(json.dumps(
        {**json.loads((f / "config.json").read_text()), "model_type": "qwen2"})), "is not a Llama"),
    "lying header": (lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:-100]), "not a valid safetensors file"),
    "pickle only": (lambda f: ((f / "model.safetensors").unlink(), (f / "pytorch_model.bin").write_bytes(b"x")),
                    "never loaded"),
}


@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_bad_pretrained_folder_is_one_line_and_writes_nothing(tmp_path, text_file, capsys, case):
    save_tiny(tmp_path / "hf")
    edit, match = BAD_LOADS[case]
    edit(tmp_path / "hf")
    args = ["train", "--data.source", str(text_file), "--job.dump_folder", str(tmp_path / "run"),
            "--training.device", "cpu", "--training.seq_len", "32", "--checkpoint.initial_load", str(tmp_path / "hf")]
    _fails(capsys, args, match)
    assert not (tmp_path / "run").exists()


def test_initial_load_of_a_missing_path(tmp_path, text_file, capsys):
    _fails(capsys, ["train", "--data.source", str(text_file), "--job.dump_folder", str(tmp_path / "run"),
                    "--checkpoint.initial_load", str(tmp_path / "nowhere")], "no such file or folder")
    assert not (tmp_path / "run").exists()
