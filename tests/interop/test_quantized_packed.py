"""NVFP4 and MXFP4 in compressed-tensors' pack-quantized layouts, and compressed-tensors' FP8 folders, proven by
their readers: compressed-tensors' own decompressor and compressor, and transformers' loader through them."""

import json

import pytest
import torch

from conftest import run_train
from mixprec.interop.hf_folder import HFFolder
from mixprec.interop.quantized import dequantized, quantize_folder
from mixprec.interop.safetensors_io import write_file
from mixprec.runs.export import export
from mixprec.runs.generate import load_model
from test_export import _logits
from test_quantized import CPU, _dequantizing, fp8_run  # noqa: F401 - fp8_run: a fixture


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
                a, b = (source.source.read(f"{base}.{part}") for source in (first, again))
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, part)
            a, b = (source.source.read(f"{base}.weight_packed") for source in (first, again))
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
