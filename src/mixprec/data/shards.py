"""Token shards on disk: what `mixprec prepare` writes and the trainer reads a window at a time.

A prepared folder holds `index.json` (the tokenizer, the element type, each split's shards with
their token counts and CRC-32s) and one file per shard: a 64-byte header (magic, version, bytes
per token, vocabulary, token count, CRC-32 of the tokens, the tokenizer's fingerprint), then the
tokens, little-endian uint8, uint16 or uint32 (the narrowest type that holds the vocabulary).
A split's token stream is its shards end to end, in the index's order.

Opening a folder checks every shard against the index and its own header (present, complete,
same tokenizer, same checksum) before any training step; the checksums are read with plain
file reads, so the check leaves no shard pages in the process's memory.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mixprec.errors import UserError

INDEX = "index.json"
SETTINGS = "prepare.json"  # written first by mixprec prepare: a folder with it and no index is unfinished
FORMAT, VERSION = "mixprec-tokens", 1
MAGIC = b"MXPTOKS\0"
_HEADER = struct.Struct("<8sIIIQI16s")  # magic, version, itemsize, vocab, tokens, crc32, fingerprint
HEADER_BYTES = 64
_READ = 1 << 20  # checksum reads, bytes (a buffer a thread)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every token id."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype).newbyteorder("<")
    raise UserError(f"a vocabulary of {vocab_size} tokens does not fit in uint32; accepted: at most 2^32")


class ShardWriter:
    """Appends tokens to `path` (through a temporary file renamed at close, so a shard on disk is
    always complete) and keeps the count and the CRC-32 for the header and the index."""

    def __init__(self, path: Path, vocab_size: int, fingerprint: str):
        self.path, self.vocab_size, self.fingerprint = path, vocab_size, fingerprint
        self.dtype = token_dtype(vocab_size)
        self.tokens, self.crc = 0, 0
        self._tmp = path.with_name(path.name + ".tmp")
        self._file = open(self._tmp, "wb")
        self._file.write(bytes(HEADER_BYTES))

    def append(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._file.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.tokens += len(tokens)

    def close(self) -> dict:
        self._file.seek(0)
        self._file.write(_HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.vocab_size, self.tokens, self.crc,
                                      self.fingerprint.encode()))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._tmp.replace(self.path)
        return {"file": self.path.name, "tokens": self.tokens, "crc32": self.crc}


def read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise UserError(f"data.source: {path} is not a mixprec token shard (no header); accepted: shards written "
                        "by mixprec prepare")
    magic, version, itemsize, vocab, tokens, crc, fingerprint = _HEADER.unpack_from(raw)
    return {"version": version, "itemsize": itemsize, "vocab_size": vocab, "tokens": tokens, "crc32": crc,
            "fingerprint": fingerprint.decode(errors="replace")}


def shard_crc(path: Path) -> int:
    """CRC-32 of a shard's tokens, read in fixed-size pieces (memory stays flat)."""
    crc, buffer = 0, bytearray(_READ)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        f.seek(HEADER_BYTES)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


class Tokens:
    """One split's token stream: its shards end to end, read a window at a time with positioned
    reads. Not memory-mapped: a mapped file enters the process's resident memory a page-cache
    folio (up to 2 MB) per touched window on current Linux kernels, +109 MB after 200 windows of
    a 2 GB corpus here; read, the shards stay in the page cache (shared by every rank on the
    machine) and a run's resident memory does not grow with its corpus."""

    def __init__(self, paths: list[Path], counts: list[int], dtype: np.dtype):
        kept = [(p, n) for p, n in zip(paths, counts) if n]  # an empty shard holds no window
        self._paths, self._dtype = [p for p, _ in kept], dtype
        self._ends = np.cumsum([n for _, n in kept], dtype=np.int64)
        self._starts = self._ends - [n for _, n in kept]

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def _read(self, shard: int, first: int, count: int) -> np.ndarray:
        size = self._dtype.itemsize
        fd = os.open(self._paths[shard], os.O_RDONLY)
        try:
            data = os.pread(fd, count * size, HEADER_BYTES + first * size)
        finally:
            os.close(fd)
        return np.frombuffer(data, dtype=self._dtype)

    def rows(self, starts, length: int):
        """tokens[s : s + length] for each start s (a tensor), as an int64 tensor (len(starts), length)."""
        import torch  # `mixprec prepare` and its workers use this module without torch

        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            filled = 0
            shard = int(np.searchsorted(self._ends, start, side="right"))
            while filled < length:  # a window can run across the end of a shard
                first = start + filled - int(self._starts[shard])
                piece = self._read(shard, first, min(length - filled, int(self._ends[shard] - self._starts[shard]) - first))
                out[row, filled:filled + len(piece)] = piece
                filled, shard = filled + len(piece), shard + 1
        return torch.from_numpy(out)


@dataclass(frozen=True)
class Prepared:
    folder: Path
    tokenizer_kind: str  # byte, bpe (trained by prepare) or file (the user's tokenizer.json)
    vocab_size: int
    fingerprint: str
    train: Tokens
    val: Tokens

    @property
    def tokenizer_name(self) -> str:
        """What a checkpoint records: 'byte' as for text sources, else the tokenizer file's fingerprint."""
        return "byte" if self.tokenizer_kind == "byte" else f"{self.tokenizer_kind} {self.fingerprint}"

    def tokenizer(self):
        from mixprec.data.tokenizer import BPETokenizer, ByteTokenizer

        if self.tokenizer_kind == "byte":
            return ByteTokenizer()
        from tokenizers import Tokenizer

        return BPETokenizer(Tokenizer.from_file(str(self.folder / "tokenizer.json")))


def is_prepared(source: str) -> bool:
    """Whether `source` is a prepared folder; a preparation that never finished (its settings
    written, no index yet) is refused: read as text, its metadata would be the corpus."""
    try:
        folder = Path(source).expanduser()
        if (folder / INDEX).is_file():
            return True
        unfinished = (folder / SETTINGS).is_file()
    except (OSError, RuntimeError):
        return False
    if unfinished:
        raise UserError(f"data.source: {folder} is a mixprec prepare folder that was never finished ({SETTINGS} but no "
                        f"{INDEX}); accepted: a finished one (re-run mixprec prepare with the same arguments to "
                        "finish it) or a text source")
    return False


def _bad(path: Path, what: str) -> UserError:
    return UserError(f"data.source: {path} {what}; accepted: a folder as mixprec prepare wrote it (re-run "
                     "mixprec prepare with the same arguments to finish or repair it)")


def open_prepared(folder: str | Path) -> Prepared:
    """The prepared folder, every shard checked against the index and its header (checksums on
    every core) before any training step."""
    folder = Path(folder).expanduser()
    try:
        index = json.loads((folder / INDEX).read_text())
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ValueError(f"format {index.get('format')!r} version {index.get('version')!r}")
        tok, splits = index["tokenizer"], index["splits"]
        kind, vocab, fingerprint = tok["kind"], int(tok["vocab_size"]), tok["fingerprint"]
        shards = {split: [(folder / s["file"], int(s["tokens"]), int(s["crc32"])) for s in splits[split]]
                  for split in ("train", "val")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _bad(folder / INDEX, f"is not a mixprec token index ({e})") from None
    if kind != "byte" and not (folder / "tokenizer.json").is_file():
        raise _bad(folder / "tokenizer.json", "is missing (the index names a tokenizer file)")
    dtype = token_dtype(vocab)
    for path, tokens, crc in shards["train"] + shards["val"]:
        if not path.is_file():
            raise _bad(path, "is missing")
        head = read_header(path)
        if head["fingerprint"] != fingerprint or head["vocab_size"] != vocab:
            raise _bad(path, f"was written with another tokenizer (fingerprint {head['fingerprint']}, vocabulary "
                             f"{head['vocab_size']}; the index: {fingerprint}, {vocab})")
        size = path.stat().st_size
        if size != HEADER_BYTES + tokens * dtype.itemsize:
            raise _bad(path, f"has {size} bytes, the index says {tokens} tokens of {dtype.itemsize} bytes "
                             f"({HEADER_BYTES + tokens * dtype.itemsize} bytes with the header): partial or replaced")
        if head["tokens"] != tokens or head["crc32"] != crc or head["itemsize"] != dtype.itemsize:
            raise _bad(path, "is not the shard the index lists (its header's count or checksum differs)")
    every = shards["train"] + shards["val"]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # zlib releases the GIL
        for (path, _, crc), got in zip(every, pool.map(shard_crc, [p for p, _, _ in every])):
            if got != crc:
                raise _bad(path, f"is damaged: its tokens' CRC-32 is {got:08x}, the index says {crc:08x}")
    return Prepared(folder, kind, vocab, fingerprint,
                    *(Tokens([p for p, _, _ in shards[s]], [n for _, n, _ in shards[s]], dtype) for s in ("train", "val")))
