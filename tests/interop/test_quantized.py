"""Narrow formats in and out of a Hugging Face folder (mixprec.interop.quantized), proven by their readers:
transformers' FineGrainedFP8 loader on the CPU dequantizes mixprec's fp8-block export to the weights mixprec
imports, and a folder built from the format's definition (ue8m0 scales) imports to transformers' weights."""

import json

import pytest
import torch

from conftest import run_train
from mixprec.cli import main
from mixprec.interop.hf_folder import HFFolder
from mixprec.interop.quantized import FineGrainedFP8, dequantized, quantize_folder
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


# ---- NVFP4 and MXFP4: compressed-tensors' pack-quantized layouts ------------------------------------------------
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_compressed_tensors_decompressor_reads_the_export_as_mixprec_imports_it(tmp_path, fp8_run, fmt):
    """compressed-tensors' own config model validates the export's quantization_config, and its decompressor
    gives every packed weight's values bit for bit as mixprec's import of the folder (it returns bfloat16:
    mixprec's float32 values rounded so)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from mixprec.interop.quantized import CompressedTensors

    export(fp8_run, tmp_path / "hf", dtype=torch.float32, fmt=fmt)
    folder = HFFolder(tmp_path / "hf")
    qc = QuantizationConfig.model_validate(folder.config["quantization_config"])
    assert qc.format == f"{fmt}-pack-quantized" and "lm_head" in qc.ignore
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    source = CompressedTensors(folder, "test", qc.format)
    assert len(source.packed) == 14  # every Linear of the decoder layers: 64 and 192 columns are whole groups
    for name, base in source.packed.items():
        parts = {n.removeprefix(base + "."): folder.read(n) for n in folder.names() if n.startswith(base + ".")}
        theirs = compressor.decompress(parts, qc.config_groups["group_0"])["weight"]
        assert torch.equal(source.read(name).to(theirs.dtype), theirs), name
        assert torch.equal(source.read(name, slice(3, 37)), source.read(name)[3:37]), name  # a rank's rows
    assert ct.__version__  # the reader that ran


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_transformers_loads_the_packed_export_to_mixprecs_weights(tmp_path, fp8_run, fmt):
    pytest.importorskip("compressed_tensors")  # transformers reads these folders through it

    export(fp8_run, tmp_path / "hf", fmt=fmt)  # bfloat16 around the packed weights, as such folders come
    hf = _dequantizing(tmp_path / "hf")
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    _logits(hf, x)  # its first forward decompresses the packed weights (bfloat16)
    for p in hf.parameters():  # then both compute in float32 (transformers refuses .float() on a quantized
        p.data = p.data.float()  # model): widened, exactly
    ours, _ = load_model(str(tmp_path / "hf"), CPU)
    q = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(hf.state_dict()[q], ours.layers[1].feed_forward.w2.weight.detach().bfloat16().float())
    for p in ours.parameters():
        p.data = p.data.bfloat16().float()  # the reader's rounding, then both compute in float32
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-5


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_packed_bytes_are_those_the_recipes_forward_casts(monkeypatch, fmt):
    """The nvfp4 / mxfp4 recipe's Linear records its weight's cast in its forward; the export of the same weight
    holds the same e2m1 codes and block scales (NVFP4's 16 x 16 block scale on each of its rows) and NVFP4's
    tensor scale as the reciprocal a reader divides by."""
    from mixprec.narrow import convert_to_fp8
    from mixprec.narrow.formats import mx
    from mixprec.narrow.formats.recipe import RECIPES

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32))
    weights = {f"model.layers.{i}.weight": m.weight.detach().clone() for i, m in enumerate(model)}
    convert_to_fp8(model, RECIPES[fmt], compute_dtype=torch.float32, exclude=())
    cast, seen = mx._cast, {}

    def recording(x, *args, **kwargs):
        q = cast(x, *args, **kwargs)
        for name, w in weights.items():
            if x.shape == w.shape and torch.equal(x, w):
                seen[name] = q
        return q

    monkeypatch.setattr(mx, "_cast", recording)
    model(torch.randn(3, 64))
    assert set(seen) == set(weights)
    out, _, _ = quantize_folder(weights, {}, {n: n.removesuffix(".weight") for n in weights}, [], fmt)
    for name, q in seen.items():
        base, R = name.removesuffix(".weight"), weights[name].shape[0]
        assert torch.equal(out[base + ".weight_packed"], q.data.view(torch.uint8)[:R]), name
        scale = q.scale.view(torch.uint8).repeat_interleave(q.block[0], 0)[:R]
        assert torch.equal(out[base + ".weight_scale"].view(torch.uint8), scale), name
        if fmt == "nvfp4":
            assert torch.equal(out[base + ".weight_global_scale"], q.tensor_scale.reciprocal().reshape(1))


# ---- a mixture of experts: each expert's projections a Linear of their own on disk -----------------------------
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


# ---- what serving in a narrow format changes -------------------------------------------------------------------
def test_serve_gap_measures_each_format_against_the_trained_forward(fp8_run, monkeypatch, capsys):
    from mixprec.interop.quantized import compressed
    from mixprec.runs.serve_gap import serve_gap

    gap = serve_gap(fp8_run)
    assert list(gap) == ["fp8-block", "nvfp4", "mxfp4"]
    for fmt, r in gap.items():
        assert r["tokens"] == 2 * 4 * 32 and 0 < r["logprob_gap"] and 0 < r["kl"] and 0 <= r["top1_changed"] < 1
        assert abs(r["served_val_loss"] - r["val_loss"]) <= r["logprob_gap"]  # a mean gap bounds the loss's
    # 8 bits against 4 (measured: KL 4.5e-6 against 4.8e-5 and 6.3e-5)
    assert gap["fp8-block"]["kl"] < min(gap["nvfp4"]["kl"], gap["mxfp4"]["kl"])
    assert gap["fp8-block"]["served"] == "8 Linears' inputs in e4m3, 1x128 groups"
    # the trained side is the checkpoint's FP32 forward: its loss by torch's cross entropy
    from mixprec.data.loader import val_batches
    from mixprec.runs.resolve import _run_config
    from mixprec.train.build import load_tokens

    config = _run_config(fp8_run)
    data = val_batches(load_tokens(config.data, fp8_run)[3], 32, 4, 2)
    model, _ = load_model(str(fp8_run), CPU)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
                  for x, y, _ in data]
    assert abs(float(sum(losses)) / 256 - gap["mxfp4"]["val_loss"]) < 1e-5
    # a format that changes nothing serves the trained model: every figure 0
    monkeypatch.setattr(compressed, "write", lambda tensors, config, linears, kept, fmt: (tensors, config, set()))
    same = serve_gap(fp8_run, ["mxfp4"])["mxfp4"]
    assert same["logprob_gap"] == same["kl"] == same["top1_changed"] == 0


def test_serve_gap_on_the_command_line(tmp_path, moe_run, capsys):
    assert main(["serve-gap", str(moe_run), "--format", "fp8-block", "--batches", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result) == ["fp8-block"] and result["fp8-block"]["tokens"] == 4 * 32
    assert main(["serve-gap", str(moe_run), "--format", "mxfp4", "--batches", "1"]) == 0
    assert "top-1 changed" in capsys.readouterr().out
    for args, words in ((["--format", "int4"], "--format 'int4' is not known; accepted: fp8-block, nvfp4, mxfp4"),
                        (["--batches", "-1"], "--batches: bad value -1")):
        assert main(["serve-gap", str(moe_run), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    export(moe_run, tmp_path / "hf")
    assert main(["serve-gap", str(tmp_path / "hf")]) == 2
    assert "not a run folder" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_packed_export_imported_and_exported_again_holds_the_same_weights(tmp_path, fp8_run, text_file, fmt):
    """Export, fine-tune from the folder one step at a learning rate of 1e-30 (under every weight's last bit),
    export again: the same values; NVFP4's scales and codes the same bytes but for the sign of a zero (-0 comes
    back +0 from the optimizer's step); MXFP4's bytes may differ (a block whose largest code is 3 comes back at
    half its scale with every code doubled: the rounded-up scale's rule on values that already fit)."""
    from mixprec.interop.quantized import CompressedTensors
    from mixprec.narrow.formats.microscaling import decode_codes

    def unsigned_zeros(packed):
        codes = decode_codes(packed)
        return torch.where(codes == 8, 0, codes)

    export(fp8_run, tmp_path / "first", dtype=torch.float32, fmt=fmt)
    run_train(tmp_path / "run", text_file, "--checkpoint.initial_load", str(tmp_path / "first"), "--precision.preset",
              "fp32", "--training.steps", "1", "--checkpoint.interval", "1", "--training.lr", "1e-30",
              "--training.warmup_steps", "0")
    export(tmp_path / "run", tmp_path / "again", dtype=torch.float32, fmt=fmt)
    first, again = (CompressedTensors(HFFolder(tmp_path / n), "test", f"{fmt}-pack-quantized") for n in ("first", "again"))
    assert first.packed and first.names() == again.names()
    for name, base in first.packed.items():
        assert torch.equal(first.read(name), again.read(name)), name
        if fmt == "nvfp4":
            for part in ("weight_scale", "weight_global_scale"):
                a, b = (source.folder.read(f"{base}.{part}") for source in (first, again))
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, part)
            a, b = (source.folder.read(f"{base}.weight_packed") for source in (first, again))
            assert torch.equal(unsigned_zeros(a), unsigned_zeros(b)), name


def _compressed_folder(tmp_path, run, scheme, fmt: str, scales) -> tuple[HFFolder, dict]:
    """A folder of the run's weights written by compressed-tensors' own compressor in `fmt`: each decoder
    Linear's parts ({"weight", "weight_scale", ...}) from scales(weight); returns the bfloat16 folder it was
    made from and {weight name: the parts as the compressor wrote them}."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    export(run, tmp_path / "plain")  # bfloat16, as such folders are written from
    folder = HFFolder(tmp_path / "plain")
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors, compressed = {}, {}
    for n in folder.names():
        w = folder.read(n)
        if not (n.endswith("_proj.weight") and "layers." in n):
            tensors[n] = w
            continue
        compressed[n] = compressor.compress({"weight": w, **scales(w.float())}, scheme)
        tensors.update({f"{n.removesuffix('.weight')}.{k}": v.contiguous() for k, v in compressed[n].items()})
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                            ignore=["lm_head"])
    (tmp_path / "ct").mkdir()
    write_file(tmp_path / "ct" / "model.safetensors", tensors, metadata={"format": "pt"})
    (tmp_path / "ct" / "config.json").write_text(json.dumps({**folder.config,
                                                             "quantization_config": qc.model_dump(mode="json")}))
    (tmp_path / "ct" / "tokenizer.json").write_text((tmp_path / "plain" / "tokenizer.json").read_text())
    return folder, compressed


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_folder_written_by_compressed_tensors_imports_as_its_decompressor_and_transformers_read_it(
        tmp_path, fp8_run, fmt):
    """compressed-tensors' own scale rules (its global scale 2688 / amax, its group scales) and compressor write
    the folder from the run's weights; mixprec imports every weight as the package's decompressor and
    transformers' loader give it."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    name = f"{fmt}-pack-quantized"
    scheme = preset_name_to_scheme(fmt.upper() + "A16", ["Linear"])
    compressor = BaseCompressor.get_value_from_registry(name)

    def scales(w):
        groups = w.unflatten(1, (-1, scheme.weights.group_size))
        g = generate_gparam(w.min(), w.max()) if fmt == "nvfp4" else None
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=g)
        return {"weight_scale": scale} if g is None else {"weight_scale": scale, "weight_global_scale": g}

    _, compressed = _compressed_folder(tmp_path, fp8_run, scheme, name, scales)
    source = dequantized(HFFolder(tmp_path / "ct"), "test")
    assert len(compressed) == 14
    for n, parts in compressed.items():
        theirs = compressor.decompress(parts, scheme)["weight"]
        assert torch.equal(source.read(n).to(theirs.dtype), theirs), n
    hf = _dequantizing(tmp_path / "ct")
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    _logits(hf, x)  # the first forward decompresses
    for p in hf.parameters():
        p.data = p.data.float()
    ours, _ = load_model(str(tmp_path / "ct"), CPU)
    for p in ours.parameters():
        p.data = p.data.bfloat16().float()  # the reader's rounding
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-5


@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_a_compressed_tensors_fp8_folder_imports_as_its_decompressor_reads_it(tmp_path, fp8_run, preset):
    """compressed-tensors' FP8 schemes (a weight scale per tensor, per channel, per 128 x 128 block), their
    scales by its own rules and its compressor writing the folder: mixprec imports each weight as its
    decompressor gives it, bit for bit (transformers 5.24's model holds these weights up to two bfloat16 steps
    from the decompressor's values: not a reference of them)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    compressor = BaseCompressor.get_value_from_registry("float-quantized")

    def scales(x):
        if preset == "FP8":
            lo, hi = x.min(), x.max()
        elif preset == "FP8_DYNAMIC":
            lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        else:  # 128 x 128 blocks, the last partial: each block's min and max
            pad = torch.nn.functional.pad(x, (0, -x.shape[1] % 128, 0, -x.shape[0] % 128))
            blocks = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).transpose(1, 2).flatten(2)
            lo, hi = blocks.amin(-1), blocks.amax(-1)
        return {"weight_scale": calculate_qparams(lo, hi, scheme.weights)[0]}

    _, compressed = _compressed_folder(tmp_path, fp8_run, scheme, "float-quantized", scales)
    source = dequantized(HFFolder(tmp_path / "ct"), "test")
    assert len(compressed) == 14 and len(source.scales) == 14
    for n, parts in compressed.items():
        theirs = compressor.decompress(parts, scheme)["weight"]
        assert torch.equal(source.read(n).to(theirs.dtype), theirs), n
        assert torch.equal(source.read(n, slice(5, 70)), source.read(n)[5:70]), n  # a rank's rows

    ours, _ = load_model(str(tmp_path / "ct"), CPU)  # through the loader, into the model
    v = "model.layers.1.self_attn.v_proj.weight"
    assert torch.equal(ours.layers[1].attention.wv.weight.detach(), source.read(v))


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
