"""safetensors files and Hugging Face folders, against the safetensors package (a test-only reference)."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from mixprec.errors import UserError
from mixprec.interop.hf_folder import INDEX, HFFolder, write_folder
from mixprec.interop.safetensors_io import SafetensorsFile, write_file

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64, torch.uint8, torch.bool]


def _tensors():
    g = torch.Generator().manual_seed(0)
    out = {f"t.{i}": torch.randn(7, 5, generator=g).mul(3).to(d) for i, d in enumerate(DTYPES)}
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 4)
    return out


def test_reads_what_the_safetensors_package_writes_rows_included(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "a.safetensors")
    f = SafetensorsFile(tmp_path / "a.safetensors")
    for name, t in tensors.items():
        assert f.dtype(name) == t.dtype and f.shape(name) == tuple(t.shape)
        assert torch.equal(f.read(name).view(torch.uint8) if t.dim() else f.read(name), t.view(torch.uint8) if t.dim() else t)
        if t.dim() and t.shape[0] > 3:
            assert torch.equal(f.read(name, slice(2, 5)).view(torch.uint8), t[2:5].view(torch.uint8))


def test_the_safetensors_package_reads_what_we_write(tmp_path):
    tensors = _tensors()
    write_file(tmp_path / "b.safetensors", tensors, metadata={"format": "pt"})
    back = load_file(tmp_path / "b.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.uint8) if t.dim() else back[name],
                                                           t.view(torch.uint8) if t.dim() else t)


def _lie(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.parametrize("edit, what", [
    (lambda h: h["w"].update(shape=[100, 4]), "bytes"),                  # more elements than its bytes
    (lambda h: h["w"].update(data_offsets=[0, 10**9]), "bytes"),        # past the end of the file
    (lambda h: h["w"].update(dtype="F128"), "described"),               # no such dtype
    (lambda h: h.update(v={"dtype": "F32"}), "described"),              # no shape or offsets
])
def test_a_header_that_lies_is_refused_in_one_line(tmp_path, edit, what):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(4, 4)}, path)
    _lie(path, edit)
    with pytest.raises(UserError, match=f"not a valid safetensors file.*{what}"):
        SafetensorsFile(path)


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(UserError, match="header length"):
        SafetensorsFile(tmp_path / "x.safetensors")


def test_sharded_folder_round_trip_and_its_index(tmp_path):
    tensors = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(5)}
    written = write_folder(tmp_path / "out", tensors, {"model_type": "llama"}, dtype=torch.bfloat16,
                           max_shard_bytes=3 * 64 * 64 * 2)
    assert written["files"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (tmp_path / "out.tmp").exists()
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert index["metadata"]["total_size"] == 5 * 64 * 64 * 2 and len(index["weight_map"]) == 5
    folder = HFFolder(tmp_path / "out")
    for name, t in tensors.items():
        assert torch.equal(folder.read(name), t.to(torch.bfloat16))


def test_folder_errors(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        HFFolder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(UserError, match="pickle files, never loaded"):
        HFFolder(tmp_path)
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(UserError, match="missing"):
        HFFolder(tmp_path)
    save_file({"v": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    with pytest.raises(UserError, match="does not hold it"):
        HFFolder(tmp_path)


def test_write_folder_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not an empty folder"):
        write_folder(tmp_path / "out", {"w": torch.ones(2)}, {}, dtype=torch.float32, max_shard_bytes=1 << 20)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
