"""safetensors files read a row range at a time, and written, without pickle.

The format: 8 bytes (little-endian u64) giving the header's length, a JSON header
`{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the raw little-endian bytes, offsets counted from the end of the header.

Read here with plain `readinto` into a tensor's buffer rather than the `safetensors`
package's mmap, so that a rank that reads half of a tensor's rows holds half of its bytes
(a mapped page touched stays in the process's resident memory until the file is closed), and
a header that lies about sizes is refused with one line before anything is read.

    f = SafetensorsFile("model.safetensors")
    f.read("model.embed_tokens.weight", rows=slice(0, 1000))   # rows 0..999, as stored
    write_file("out.safetensors", {"w": tensor}, metadata={"format": "pt"})
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from mixprec.errors import UserError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "F8_E8M0": torch.float8_e8m0fnu}  # e8m0: the exponent-only scales of MX and ue8m0 FP8 folders
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors package's own limit


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                (n,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (-1,)
                if not 0 < n <= min(_MAX_HEADER, size - 8):
                    raise self._bad(f"a header length of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
        except OSError as e:
            raise UserError(f"{self.path}: cannot read ({e.strerror}); accepted: a readable .safetensors file") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self._bad("a header that is not JSON") from None
        if not isinstance(header, dict):
            raise self._bad("a header that is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self.start, data_size = 8 + n, size - 8 - n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        for name, e in header.items():
            try:
                dtype, shape, (begin, end) = DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} described as {str(e)[:80]}") from None
            nbytes = math.prod(shape) * dtype.itemsize
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_size or end - begin != nbytes:
                raise self._bad(f"tensor {name!r} of {e['dtype']} {list(shape)} ({nbytes} bytes) at bytes "
                                f"[{begin}, {end}) of {data_size}")
            self.entries[name] = (dtype, shape, begin)

    def _bad(self, what: str) -> UserError:
        return UserError(f"{self.path}: not a valid safetensors file ({what}); accepted: a file written by "
                         "safetensors or save_pretrained")

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][0]

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor `name`, or the rows `rows` of its first dimension (contiguous bytes: only those are read)."""
        dtype, shape, begin = self.entries[name]
        if rows is not None and shape:
            lo, hi, _ = rows.indices(shape[0])
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            begin, shape = begin + lo * row_bytes, (max(0, hi - lo), *shape[1:])
        buffer = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.start + begin)
            if f.readinto(buffer.numpy()) != buffer.numel():
                raise self._bad(f"tensor {name!r} cut short")
        return buffer.view(dtype).reshape(shape)


def write_file(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` (CPU or not, any layout) to `path`; returns the bytes written."""
    header, offset = {}, 0
    for name, t in tensors.items():
        if t.dtype not in NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors package writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(text) + offset
