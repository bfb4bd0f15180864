"""Narrow formats in and out of a Hugging Face folder (mixprec.interop.quantized), proven by their readers:
transformers' FineGrainedFP8 loader dequantizes mixprec's fp8-block export to the weights mixprec imports, and a
folder built from the format's definition (ue8m0 scales) imports to transformers' weights; --format on the
command line, and the quantization_configs refused. NVFP4/MXFP4 and compressed-tensors:
test_quantized_packed.py; mixtures of experts: test_quantized_experts.py; serve-gap: test_serve_gap.py."""

import json

import pytest
import torch

from conftest import run_train
from mixprec.cli import main
from mixprec.interop.hf_folder import HFFolder
from mixprec.interop.quantized import FineGrainedFP8, quantize_folder
from mixprec.interop.safetensors_io import write_file
from mixprec.runs.export import export
from mixprec.runs.generate import load_model
from test_export import _logits, trained

CPU = torch.device("cpu")  # transformers' models load there: mixprec's too, on a GPU machine as well


def _dequantizing(folder):
    """transformers' model of a quantized folder with its weights dequantized, on any machine: on a GPU its
    FP8, MXFP4 and compressed-tensors loaders would keep the narrow weights and kernels of their own."""
    import transformers

    method = json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"]
    config = {"fp8": lambda: transformers.FineGrainedFP8Config(dequantize=True),
              "mxfp4": lambda: transformers.Mxfp4Config(dequantize=True),
              "compressed-tensors": lambda: transformers.CompressedTensorsConfig(run_compressed=False)}[method]()
    return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config).eval()


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, text_file):
    """The debug flavor, 6 steps in fp8-blockwise, a checkpoint at the end."""
    return trained(tmp_path_factory, text_file, "debug", "fp8-blockwise", 6)


def _fp8_export(run, out):
    result = export(run, out, dtype=torch.float32, fmt="fp8-block")
    return result, HFFolder(out)


def test_fp8_block_export_is_read_by_transformers_as_mixprec_reads_it(tmp_path, fp8_run):

    _, folder = _fp8_export(fp8_run, tmp_path / "hf")
    qc = folder.config["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    # attention's Linears (64 x 64, 32 x 64: one partial block) in e4m3; the MLP's 192-row weights are kept (a
    # grid of 2 blocks over 192 rows reads as 96-row blocks to a reader that takes the block from the grid),
    # and the head: never narrow; embeddings and norms are not Linears
    q = "model.layers.0.self_attn.q_proj.weight"
    assert folder.dtype(q) == torch.float8_e4m3fn and folder.shape(q + "_scale_inv") == (1, 1)
    assert folder.dtype(q + "_scale_inv") == torch.float32
    assert folder.dtype("model.layers.0.mlp.gate_proj.weight") == torch.float32
    assert "model.layers.0.mlp.gate_proj" in qc["modules_to_not_convert"] and "lm_head" in qc["modules_to_not_convert"]
    assert folder.dtype("model.embed_tokens.weight") == torch.float32
    hf = _dequantizing(tmp_path / "hf")
    ours, _ = load_model(str(tmp_path / "hf"), CPU)  # mixprec's import of the same folder
    theirs = hf.state_dict()
    source = FineGrainedFP8(folder, "test")
    for name in source.scales:  # transformers' dequantized weights are mixprec's, bit for bit
        assert torch.equal(theirs[name], source.read(name)), name
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-6  # measured 1.5e-7: sums ordered differently
    # and the e4m3 weights are what the run's weights quantize to, not the weights themselves
    run_model, _ = load_model(str(fp8_run), CPU)
    assert not torch.equal(run_model.layers[0].attention.wv.weight, ours.layers[0].attention.wv.weight)
    assert torch.equal(run_model.layers[0].feed_forward.w1.weight, ours.layers[0].feed_forward.w1.weight)


def test_the_exported_bytes_are_those_the_fp8_blockwise_forward_casts(monkeypatch):
    """What the recipe's Linear casts its weight to in its forward, recorded there, against the export of the
    same weight (256 x 112 and 48 x 256: whole blocks, and one partial block in a dimension)."""
    from mixprec.narrow import convert_to_fp8
    from mixprec.narrow.linear import fp8 as linear
    from mixprec.narrow.formats.recipe import RECIPES

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(112, 256), torch.nn.Linear(256, 48))
    weights = {f"model.layers.{i}.weight": m.weight.detach().clone() for i, m in enumerate(model)}
    convert_to_fp8(model, RECIPES["blockwise"], compute_dtype=torch.float32, exclude=())
    cast, seen = linear._FP8Matmul.cast, []

    def recording(ctx, x, weight, plan, state):
        xq, wq = cast(ctx, x, weight, plan, state)
        seen.append((wq.data, wq.scale_inv))
        return xq, wq

    monkeypatch.setattr(linear._FP8Matmul, "cast", staticmethod(recording))
    model(torch.randn(3, 112))
    assert len(seen) == len(weights)  # both Linears converted and cast
    out, _, _ = quantize_folder(weights, {}, {n: n.removesuffix(".weight") for n in weights}, [], "fp8-block")
    for (data, scale_inv), name in zip(seen, weights):
        assert torch.equal(out[name].view(torch.uint8), data.view(torch.uint8)), name
        assert torch.equal(out[name + "_scale_inv"], scale_inv.float()), name


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.uint8, torch.bfloat16])
def test_a_folder_built_from_the_formats_definition_imports_to_transformers_weights(tmp_path, fp8_run,
                                                                                    scale_dtype):
    """DeepSeek-V3.1's ue8m0 scales (power-of-two, stored as e8m0, or as its bytes) and bfloat16 scales, one per
    block of 32 x 32: e4m3 elements whose product with their block's scale is the weight."""

    export(fp8_run, tmp_path / "plain", dtype=torch.float32)
    folder = HFFolder(tmp_path / "plain")
    tensors = {n: folder.read(n) for n in folder.names()}
    gen = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if "self_attn" in n]:  # (64, 64) and (32, 64): whole 32 x 32 blocks
        w = tensors[name]
        exponents = torch.randint(-12, -4, (w.shape[0] // 32, w.shape[1] // 32), generator=gen)
        scale = torch.exp2(exponents.float())
        q = (w / scale.repeat_interleave(32, 0).repeat_interleave(32, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        stored = ((exponents + 127).to(torch.uint8) if scale_dtype == torch.uint8 else scale.to(scale_dtype))
        tensors[name], tensors[name + "_scale_inv"] = q, stored
    config = {**folder.config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                       "activation_scheme": "dynamic", "weight_block_size": [32, 32]}}
    (tmp_path / "fp8").mkdir()
    write_file(tmp_path / "fp8" / "model.safetensors", tensors, metadata={"format": "pt"})
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    (tmp_path / "fp8" / "tokenizer.json").write_text((tmp_path / "plain" / "tokenizer.json").read_text())
    theirs = _dequantizing(tmp_path / "fp8")
    ours, _ = load_model(str(tmp_path / "fp8"), CPU)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert (_logits(theirs, x) - _logits(ours, x)).abs().max() < 1e-6
    source = FineGrainedFP8(HFFolder(tmp_path / "fp8"), "test")
    for name, value in theirs.state_dict().items():
        if name in source.scales:
            assert torch.equal(value, source.read(name)), name
            # read a row range (a rank's shard): the rows of the whole, reading only their blocks
            assert torch.equal(source.read(name, slice(5, 40)), value[5:40]), name


def test_fine_tuning_from_an_fp8_folder_starts_where_its_dequantized_twin_does(tmp_path, fp8_run, text_file):
    """The first step's loss from the fp8-block folder equals the loss from the same weights, dequantized by
    transformers and written in float32 without a quantization_config."""

    _fp8_export(fp8_run, tmp_path / "fp8")
    hf = _dequantizing(tmp_path / "fp8")
    config = {k: v for k, v in json.loads((tmp_path / "fp8" / "config.json").read_text()).items()
              if k != "quantization_config"}
    (tmp_path / "twin").mkdir()
    write_file(tmp_path / "twin" / "model.safetensors", {k: v.contiguous() for k, v in hf.state_dict().items()},
               metadata={"format": "pt"})
    (tmp_path / "twin" / "config.json").write_text(json.dumps(config))
    runs = [run_train(tmp_path / f"from_{name}", text_file, "--precision.preset", "fp32",
                      "--checkpoint.initial_load", str(tmp_path / name), "--training.steps", "2",
                      "--checkpoint.enable", "false") for name in ("fp8", "twin")]
    assert runs[0][0]["loss"] == runs[1][0]["loss"]


def test_export_format_on_the_command_line_and_bad_formats_in_one_line(tmp_path, fp8_run, capsys):
    for fmt, method in (("fp8-block", "fp8"), ("nvfp4", "compressed-tensors"), ("mxfp4", "compressed-tensors")):
        assert main(["export", str(fp8_run), str(tmp_path / fmt), "--format", fmt]) == 0  # docs/pretrained.md's
        qc = json.loads((tmp_path / fmt / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == method
    capsys.readouterr()
    assert main(["export", str(fp8_run), str(tmp_path / "out"), "--format", "int3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--format 'int3' is not known; accepted: bf16, fp8-block, nvfp4, mxfp4" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "awq"}, "quant_method 'awq' is not read; accepted: fp8 (FineGrainedFP8"),
    ("yes", "quant_method None is not read; accepted: fp8"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"},
     "compressed-tensors format 'int-quantized' is not read; accepted: nvfp4-pack-quantized, mxfp4-pack-quantized, "
     "float-quantized"),
])
def test_a_quantization_config_mixprec_does_not_read_is_refused_in_one_line(tmp_path, fp8_run, text_file, capsys,
                                                                           qc, words):
    export(fp8_run, tmp_path / "hf", dtype=torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = qc
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    with pytest.raises(AssertionError):  # training refuses it too, and writes nothing
        run_train(tmp_path / "run", text_file, "--checkpoint.initial_load", str(tmp_path / "hf"))
    assert words in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_export_import_export_gives_the_same_elements_and_scales_within_a_step(tmp_path, fp8_run, text_file):
    """The fp8-block folder imported (fine-tuning from it one step at a learning rate of 1e-30, under every
    weight's last bit) and exported again: the same e4m3 elements (each block's largest element casts to 448 both
    times); a scale the same or one float32 step apart (448 / amax and its reciprocal, each rounded: the
    reciprocal of a rounded reciprocal is not always the number)."""
    _fp8_export(fp8_run, tmp_path / "first")
    run_train(tmp_path / "run", text_file, "--checkpoint.initial_load", str(tmp_path / "first"), "--precision.preset",
              "fp32", "--training.steps", "1", "--checkpoint.interval", "1", "--training.lr", "1e-30",
              "--training.warmup_steps", "0")
    _, again = _fp8_export(tmp_path / "run", tmp_path / "again")
    first = HFFolder(tmp_path / "first")
    narrow = [n for n in first.names() if first.dtype(n) == torch.float8_e4m3fn]
    assert narrow and first.names() == again.names()
    for name in narrow:
        assert torch.equal(first.read(name).view(torch.uint8), again.read(name).view(torch.uint8)), name
        a, b = first.read(name + "_scale_inv"), again.read(name + "_scale_inv")
        assert ((a.view(torch.int32) - b.view(torch.int32)).abs() <= 1).all(), name
