"""Checks that the run folder and the checkpoint folder can be written, made before
any work: a run that trains for hours and then cannot save has lost all of it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mixprec.errors import UserError


def check_writable(folder: Path, key: str) -> None:
    """`folder` exists as a writable folder, or can be created: its nearest existing
    ancestor is a folder this process can write in, and every missing name fits the
    file system. Probes with a temporary file (removed at once); creates nothing."""
    existing, missing = Path(os.path.abspath(folder)), []
    while not os.path.exists(existing):  # False (not an error) for a name too long to stat
        missing.append(existing.name)
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == Path(os.path.abspath(folder)) else f"is inside {existing}, a file"
        raise UserError(f"{key} {folder} {where}; accepted: a folder path (new or existing)")
    name_max = os.pathconf(existing, "PC_NAME_MAX")
    for name in missing:
        if len(name.encode()) > name_max:
            raise UserError(f"{key}: the name {name[:32]}... is {len(name.encode())} bytes; accepted: names of at "
                            f"most {name_max} bytes")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise UserError(f"{key} {folder}: cannot write in {existing} ({e.strerror}); accepted: a folder this user "
                        "can write") from None
