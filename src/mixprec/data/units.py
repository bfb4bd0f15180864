"""The input of `mixprec prepare`: SOURCE cut into units of pieces (whole files, or line-aligned
byte ranges of big files), and the documents a piece holds with the split each goes to.

SOURCE is `stdlib`, a text file, a `.jsonl` file (one JSON object a line, its text in a named
field), a `.gz` of either, or a folder of any of them. A unit is about `shard_bytes` of input;
a `.gz` cannot be cut. The split follows the text sources' rules: a folder's files go to
validation by a hash of their relative path; with too few files for that (one file, or every
file on one side), the last `val_fraction` of the bytes (from a line start) is validation;
JSON lines go by a hash of their file and byte offset.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from mixprec.data.corpus import STDLIB, _is_val, _stdlib_files
from mixprec.errors import UserError, user_path

BLOCK = 4 << 20  # bytes read, and of text tokenized, at a time


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of one input file (end -1: to the end), owned as whole lines."""
    path: str
    rel: str
    start: int = 0
    end: int = -1
    split: str = ""  # train or val; "" for JSON lines (each record by its hash)
    whole: bool = False  # the whole of an uncompressed file: read at once, skipped whole if binary

    @property
    def jsonl(self) -> bool:
        return self.path.removesuffix(".gz").endswith(".jsonl")


@dataclass
class Unit:
    index: int
    pieces: list[Piece]
    lead: dict[str, bool] = field(default_factory=dict)  # an earlier unit holds documents of this split


def _files(source: str) -> tuple[Path, list[Path]]:
    if source == STDLIB:
        root, files = _stdlib_files()
        return root, sorted(files)
    path = user_path(source, "the source").resolve()
    if not path.exists():
        raise UserError(f"{source!r} does not exist; accepted: stdlib, or a text, .jsonl or .gz "
                        "file or a folder of them")
    if path.is_file():
        return path.parent, [path]
    return path, sorted(p for p in path.rglob("*") if p.is_file())


def _gz_size(path: Path) -> int:
    size = 0
    with _gz_errors(path), gzip.open(path, "rb") as f:
        while chunk := f.read(BLOCK):
            size += len(chunk)
    return size


@contextlib.contextmanager
def _gz_errors(path):
    """A damaged .gz (cut short, not gzip, a bad checksum) as one line, in the main process or a worker."""
    try:
        yield
    except (EOFError, OSError, zlib.error) as e:
        if not str(path).endswith(".gz"):
            raise
        raise UserError(f"{path}: not a readable gzip file ({e}); accepted: whole .gz files (check or remove "
                        "this one)") from None


def input_bytes(pieces: list[Piece]) -> int:
    """Bytes of input (compressed, for a whole .gz)."""
    return sum(os.path.getsize(p.path) if p.end < 0 else p.end - p.start for p in pieces)


def plan_units(source: str, val_fraction: float, shard_bytes: int) -> list[Unit]:
    """The input cut into units of about shard_bytes, in the order their tokens are joined."""
    root, files = _files(source)
    pieces: list[Piece] = []
    rels = [p.relative_to(root).as_posix() for p in files]
    splits = ["" if Piece(str(p), r).jsonl else "val" if _is_val(r, val_fraction) else "train"
              for p, r in zip(files, rels)]
    # Too few files for a file-level split (one file, or all on one side), as for data.source: the
    # last val_fraction of the bytes, from a line start, is validation.
    ranges = {}
    if source != STDLIB and "" not in splits and len(set(splits)) == 1:
        sizes = [_gz_size(p) if p.suffix == ".gz" else p.stat().st_size for p in files]
        cut, before = int(sum(sizes) * (1 - val_fraction)), 0
        for path, size in zip(files, sizes):
            a = min(max(cut - before, 0), size)
            ranges[path] = [(s, lo, hi) for s, lo, hi in (("train", 0, a), ("val", a, size)) if hi > lo]
            before += size
    for path, rel, split in zip(files, rels, splits):
        if path.suffix == ".gz":  # no seeking into a compressed stream: one piece a range
            pieces += [Piece(str(path), rel, a, b, s) for s, a, b in ranges.get(path, [(split, 0, -1)])]
            continue
        size = path.stat().st_size
        if path not in ranges and size <= shard_bytes:
            pieces.append(Piece(str(path), rel, 0, size, split, whole=split != ""))
            continue
        for s, a, b in ranges.get(path, [(split, 0, size)]):  # big files: ranges of shard_bytes
            pieces += [Piece(str(path), rel, start, min(start + shard_bytes, b), s) for start in range(a, b, shard_bytes)]
    units, current, filled = [], [], 0
    for piece in pieces:
        current.append(piece)
        filled += input_bytes([piece])
        if filled >= shard_bytes:
            units.append(Unit(len(units), current))
            current, filled = [], 0
    if current:
        units.append(Unit(len(units), current))
    seen = {"train": False, "val": False}
    for unit in units:
        unit.lead = dict(seen)
        for piece in unit.pieces:
            for split in ([piece.split] if piece.split else ["train", "val"]):
                seen[split] = True
    return units




def _owned_bytes(piece: Piece):
    """(offset in the file, block): the piece's bytes in newline-aligned blocks of about BLOCK,
    the lines that start in [start, end)."""
    opener = gzip.open if piece.path.endswith(".gz") else open
    with _gz_errors(piece.path), opener(piece.path, "rb") as f:
        pos = piece.start
        if pos > 0:  # skip to the first line start at or after `start`
            if opener is open:
                f.seek(pos - 1)
            else:
                _skip(f, pos - 1)
            pos = pos - 1 + len(f.readline())
        end = piece.end
        while end < 0 or pos < end:
            want = BLOCK if end < 0 else min(BLOCK, end - pos)
            block = f.read(want)
            if not block:
                return
            if not block.endswith(b"\n"):
                block += f.readline()  # finish the line that starts inside the range
            yield pos, block
            pos += len(block)


def _skip(f, n: int) -> None:
    while n > 0:
        n -= len(f.read(min(n, BLOCK)))


def _text(block: bytes) -> str | None:
    if b"\0" in block:
        return None
    try:
        return block.decode("utf-8")
    except UnicodeDecodeError:
        return None


def documents(piece: Piece, text_field: str, val_fraction: float):
    """(split, text or None for skipped bytes, bytes read) of the piece's documents: a text
    file's blocks (a whole file at once: a binary file is skipped, as data.source skips it) or
    its JSON lines."""
    if piece.jsonl:
        for offset, block in _owned_bytes(piece):
            for line in block.splitlines(keepends=True):
                yield _record(piece, line, offset, text_field, val_fraction), len(line)
                offset += len(line)
        return
    blocks = [b"".join(b for _, b in _owned_bytes(piece))] if piece.whole else (b for _, b in _owned_bytes(piece))
    for block in blocks:
        text = _text(block)
        yield (piece.split, text), len(block)


def _record(piece: Piece, line: bytes, offset: int, text_field: str, val_fraction: float) -> tuple[str, str]:
    """(split, text) of the JSON line at byte `offset` of its (uncompressed) file."""
    if not line.strip():
        return "train", ""
    try:
        text = json.loads(line)[text_field]
        if not isinstance(text, str):
            raise TypeError
    except (ValueError, KeyError, TypeError, IndexError):
        raise UserError(f"{piece.path}: the line at byte {offset} is not a JSON "
                        f"object with a string field {text_field!r} ({line[:60]!r}); accepted: JSON lines with "
                        "that field (--text-field names it)") from None
    return ("val" if _is_val(f"{piece.rel}@{offset}", val_fraction) else "train"), text
