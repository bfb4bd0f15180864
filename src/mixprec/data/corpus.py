"""Real text with no download: this Python's standard-library sources, or the user's files.

Files are read in sorted order and split into training and validation by a hash of
their relative path, so the split is the same on every machine and run.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from mixprec.errors import UserError, user_path

STDLIB = "stdlib"


@dataclass(frozen=True)
class Corpus:
    name: str
    train: str
    val: str


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1])]
    return root, files


def _read_text(path: Path) -> str | None:
    """The file's text, or None for binary files (NUL bytes or invalid UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _is_val(relpath: str, val_fraction: float) -> bool:
    return zlib.crc32(relpath.encode()) % 10_000 < val_fraction * 10_000


def load_corpus(source: str, val_fraction: float) -> Corpus:
    """Training and validation text from `source` (stdlib, a text file or a folder)."""
    if source == STDLIB:
        root, files = _stdlib_files()
    else:
        path = user_path(source, "data.source")
        if not path.exists():
            raise UserError(f"data.source: {source!r} does not exist; accepted: stdlib, or a text file or folder")
        if path.is_file():
            text = _read_text(path)
            if not text:
                raise UserError(f"data.source: {source!r} holds no UTF-8 text")
            # One file: the last val_fraction of it is held out.
            cut = int(len(text) * (1 - val_fraction))
            return Corpus(name=str(path), train=text[:cut], val=text[cut:])
        root, files = path, [p for p in path.rglob("*") if p.is_file()]
    train, val = [], []
    for p in sorted(files):
        text = _read_text(p)
        if text:
            rel = p.relative_to(root).as_posix()
            (val if _is_val(rel, val_fraction) else train).append(text)
    name = f"stdlib ({root})" if source == STDLIB else str(root)
    if not train and not val:
        raise UserError(f"data.source: {source!r} holds no UTF-8 text files")
    if not train or not val:
        # Too few files for a file-level split: split the text instead.
        text = "\n".join(train + val)
        cut = int(len(text) * (1 - val_fraction))
        return Corpus(name=name, train=text[:cut], val=text[cut:])
    return Corpus(name=name, train="\n".join(train), val="\n".join(val))
