"""A mixture of experts in the narrow formats: each expert's projections a Linear of their own on disk (the
released checkpoints' layout, which transformers merges), gpt-oss's own MXFP4 layout, a transformers MoE family
trained through the experts interface; read back by transformers, compressed-tensors and mixprec alike."""

import json

import pytest
import torch

from conftest import run_train
from mixprec.cli import main
from mixprec.interop.hf_folder import HFFolder
from mixprec.interop.quantized import dequantized
from mixprec.interop.safetensors_io import write_file
from mixprec.runs.export import export
from mixprec.runs.generate import load_model
from test_export import _logits, trained
from test_quantized import CPU, _dequantizing, _fp8_export


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, text_file):
    """moe-debug (8 experts, top-2, a shared expert), 4 steps in fp8-rowwise."""
    return trained(tmp_path_factory, text_file, "moe-debug", "fp8-rowwise", 4)


def test_an_moes_fp8_block_export_is_read_by_transformers_as_mixprec_reads_it(tmp_path, moe_run):
    """The experts written one Linear per expert and projection (transformers merges them into its fused
    tensors; mixprec's import merges them likewise), each in e4m3 with its own block scales; the routers stay
    float32; transformers' logits are mixprec's."""

    _, folder = _fp8_export(moe_run, tmp_path / "hf")
    names = set(folder.names())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    for e in (0, 7):
        for part in ("gate_proj", "up_proj", "down_proj"):
            w = f"model.layers.0.mlp.experts.{e}.{part}.weight"
            assert folder.dtype(w) == torch.float8_e4m3fn and w + "_scale_inv" in names
    assert folder.dtype("model.layers.0.mlp.gate.weight") == torch.float32  # the router
    assert "model.layers.0.mlp.gate" in folder.config["quantization_config"]["modules_to_not_convert"]
    hf = _dequantizing(tmp_path / "hf")
    ours, _ = load_model(str(tmp_path / "hf"), CPU)
    theirs = hf.state_dict()
    experts = [n for n in ours.state_dict() if n.startswith("hf.") and "experts" in n]
    assert len(experts) == 10  # gate_up_proj, down_proj and the shared expert's three Linears, of two layers
    for name in experts:
        assert torch.equal(theirs[name.removeprefix("hf.")], ours.state_dict()[name]), name
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-6  # measured: equal


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_an_moes_packed_experts_are_read_by_the_decompressor_as_mixprec_reads_them(tmp_path, moe_run, fmt):
    """Each expert's projections packed as a Linear of its own, NVFP4's gate and up sharing one global scale
    (q, k and v too): compressed-tensors' decompressor gives each expert's weight as mixprec's merged import
    holds it; for MXFP4, transformers loads the folder to the same experts (its logits mixprec's to 1e-5)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    export(moe_run, tmp_path / "hf", fmt=fmt)
    folder = HFFolder(tmp_path / "hf")
    qc = QuantizationConfig.model_validate(folder.config["quantization_config"])
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    ours, _ = load_model(str(tmp_path / "hf"), CPU)
    fused = ours.state_dict()["hf.model.layers.1.mlp.experts.gate_up_proj"]  # (E, 2I, D)
    I = fused.shape[1] // 2
    for e in (0, 5):
        for part, rows in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
            base = f"model.layers.1.mlp.experts.{e}.{part}"
            parts = {n.removeprefix(base + "."): folder.read(n) for n in folder.names() if n.startswith(base + ".")}
            theirs = compressor.decompress(parts, qc.config_groups["group_0"])["weight"]
            assert torch.equal(fused[e, rows].to(theirs.dtype), theirs), base
    if fmt == "nvfp4":
        scale = [folder.read(f"model.layers.1.mlp.experts.3.{p}.weight_global_scale") for p in ("gate_proj", "up_proj")]
        qkv = [folder.read(f"model.layers.0.self_attn.{p}_proj.weight_global_scale") for p in "qkv"]
        assert torch.equal(*scale) and torch.equal(qkv[0], qkv[1]) and torch.equal(qkv[1], qkv[2])
        return  # transformers 5.24 drops the experts' global scales when it merges them (their values 448 x 6)

    hf = _dequantizing(tmp_path / "hf")
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    _logits(hf, x)  # the first forward decompresses
    for p in hf.parameters():
        p.data = p.data.float()
    theirs = hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(theirs, fused.bfloat16().float())
    for name, p in ours.named_parameters():
        if "mlp.gate." not in name:  # the routers stay float32 in both
            p.data = p.data.bfloat16().float()
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-5


def test_a_per_expert_folder_loads_into_the_fused_experts(tmp_path, moe_run):
    """A folder with one weight per expert and projection, as released MoE checkpoints are written: read as
    the fused tensors the model holds, the logits of the fused folder it was split from, bit for bit."""
    from mixprec.interop.expert_files import per_expert

    export(moe_run, tmp_path / "fused", dtype=torch.float32)
    folder = HFFolder(tmp_path / "fused")
    tensors, linears = per_expert({n: folder.read(n) for n in folder.names()})
    assert len(linears) == 2 * 8 * 3  # two layers, 8 experts, gate, up and down
    (tmp_path / "split").mkdir()
    write_file(tmp_path / "split" / "model.safetensors", tensors, metadata={"format": "pt"})
    for file in ("config.json", "tokenizer.json"):
        (tmp_path / "split" / file).write_text((tmp_path / "fused" / file).read_text())
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    split, _ = load_model(str(tmp_path / "split"), CPU)
    fused, _ = load_model(str(tmp_path / "fused"), CPU)
    assert torch.equal(_logits(split, x), _logits(fused, x))
    from mixprec.interop.expert_files import Fused

    name = "model.layers.1.mlp.experts.gate_up_proj"
    source = Fused(HFFolder(tmp_path / "split"), {name})
    assert source.shape(name) == (8, 64, 64) and name in source.names()
    assert torch.equal(source.read(name, slice(2, 5)), folder.read(name)[2:5])  # a rank's experts, only theirs read


def test_a_gpt_oss_run_exports_its_experts_in_the_familys_mxfp4_and_transformers_reads_them(tmp_path, text_file):
    """gpt-oss's own MXFP4 layout (_blocks, _scales; quant_method mxfp4), which transformers dequantizes on the
    CPU: the weights mixprec imports from the folder, bit for bit, and the same logits; attention stays in the
    export's dtype."""

    (tmp_path / "cfg").mkdir()
    small = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, num_experts_per_tok=2,
                 max_position_embeddings=64, num_local_experts=8, layer_types=["full_attention"] * 2)
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({"model_type": "gpt_oss", **small}))
    run_train(tmp_path / "run", text_file, "--model.hf_config", str(tmp_path / "cfg"), "--data.tokenizer", "byte",
              "--precision.preset", "fp32", "--training.steps", "2", "--checkpoint.interval", "2")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "mxfp4", "--dtype",
                 "float32"]) == 0
    folder = HFFolder(tmp_path / "hf")
    assert folder.config["quantization_config"]["quant_method"] == "mxfp4"
    assert folder.shape("model.layers.0.mlp.experts.gate_up_proj_blocks") == (8, 128, 2, 16)  # (E, 2I, H/32, 16)
    assert folder.dtype("model.layers.0.self_attn.q_proj.weight") == torch.float32
    source, name = dequantized(folder, "test"), "model.layers.1.mlp.experts.down_proj"
    assert source.shape(name) == (8, 64, 64) and torch.equal(source.read(name, slice(2, 5)), source.read(name)[2:5])
    hf = _dequantizing(tmp_path / "hf")
    ours, _ = load_model(str(tmp_path / "hf"), CPU)
    theirs = hf.state_dict()
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            assert torch.equal(theirs[name], ours.state_dict()["hf." + name]), name
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(hf, x), _logits(ours, x))  # the same transformers code on the same weights
    trained, _ = load_model(str(tmp_path / "run"), CPU)
    assert not torch.equal(_logits(trained, x), _logits(ours, x))  # and they are the run's, in e2m1


def test_a_qwen3_moe_run_exports_its_experts_in_fp8_blocks_that_transformers_reads(tmp_path, text_file):
    """A transformers MoE family trained through the experts interface (model.hf_config): its fused experts
    written one e4m3 Linear per expert, which transformers merges back; its logits are mixprec's."""
    from conftest import tiny_qwen3_moe

    config = tiny_qwen3_moe(tmp_path / "cfg")
    run_train(tmp_path / "run", text_file, "--model.hf_config", str(config), "--data.tokenizer", "byte",
              "--precision.preset", "fp8-rowwise", "--training.steps", "2", "--checkpoint.interval", "2")
    export(tmp_path / "run", tmp_path / "hf", dtype=torch.float32, fmt="fp8-block")
    folder = HFFolder(tmp_path / "hf")
    assert folder.dtype("model.layers.1.mlp.experts.7.down_proj.weight") == torch.float8_e4m3fn
    hf = _dequantizing(tmp_path / "hf")
    ours, _ = load_model(str(tmp_path / "hf"), CPU)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-6
