"""`mixprec prepare SOURCE --out DIR`: text to token shards once, so training reads the windows it
draws instead of reading and tokenizing its corpus at every start.

SOURCE is `stdlib`, a text file, a `.jsonl` file (one JSON object a line, its text in a named
field), a `.gz` of either, or a folder of any of them. The input is cut into units of about
`shard_mb` of text (big files into byte ranges that start and end at line starts; a `.gz`
cannot be cut); each unit is tokenized by one worker process, streaming, into one training and
one validation shard, then marked done. A re-run skips the units already done; index.json,
written last, is what makes the folder trainable.

The split follows the text sources' rules: a folder's files go to validation by a hash of their
relative path; with too few files for that (one file, or every file on one side), the last
`val_fraction` of the bytes (from a line start) is validation; JSON lines go by a hash of their
file and byte offset. Documents of a split are joined by a
newline, as `data.source` joins a folder's files, so a folder prepared with the byte tokenizer
gives the tokens the trainer makes of the same folder in memory.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import shutil
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from mixprec.data.corpus import STDLIB, _is_val, _stdlib_files
from mixprec.data.shards import FORMAT, INDEX, VERSION, ShardWriter, read_header, token_dtype
from mixprec.errors import UserError

logger = logging.getLogger(__name__)

_BLOCK = 4 << 20  # bytes of text tokenized at a time
SETTINGS = "prepare.json"


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


# ---------------------------------------------------------------- planning

def _files(source: str) -> tuple[Path, list[Path]]:
    if source == STDLIB:
        root, files = _stdlib_files()
        return root, sorted(files)
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise UserError(f"{source!r} does not exist; accepted: stdlib, or a text, .jsonl or .gz "
                        "file or a folder of them")
    if path.is_file():
        return path.parent, [path]
    return path, sorted(p for p in path.rglob("*") if p.is_file())


def _gz_size(path: Path) -> int:
    size = 0
    with gzip.open(path, "rb") as f:
        while chunk := f.read(_BLOCK):
            size += len(chunk)
    return size


def _input_bytes(pieces: list[Piece]) -> int:
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
        filled += _input_bytes([piece])
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


# ---------------------------------------------------------------- tokenizers

class _ByteEncoder:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


class _FileEncoder:
    """A `tokenizers` tokenizer.json; long texts are encoded in pieces cut after a newline."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # fast: no offsets (tokenizers 0.20+)
        encodings = batch(_pieces(text), add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings] or [np.zeros(0, np.int64)])


def _pieces(text: str, size: int = 8192) -> list[str]:
    """`text` in pieces of about `size` characters, each cut after a newline between two
    characters that are not blank: a byte-level pre-tokenizer splits there anyway, so encoding
    the pieces gives the tokens of the whole text."""
    pieces, start = [], 0
    while start < len(text):
        end = start + size
        while end < len(text) and not (text[end - 1] == "\n" and not text[end - 2].isspace()
                                       and not text[end].isspace()):
            end = text.find("\n", end) + 1 or len(text)
        pieces.append(text[start:end])
        start = end
    return pieces


def _load_tokenizer(out: Path, kind: str):
    return _ByteEncoder() if kind == "byte" else _FileEncoder(out / "tokenizer.json")


def _fingerprint(out: Path, kind: str) -> str:
    data = b"byte" if kind == "byte" else (out / "tokenizer.json").read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _train_bpe(source_units: list[Unit], vocab_size: int, sample_bytes: int, out: Path) -> None:
    """A byte-level BPE (the trainer's own kind) trained on the first sample_bytes of training text."""
    from mixprec.data.tokenizer import train_bpe

    def sample():
        taken = 0
        for unit in source_units:
            for piece in unit.pieces:
                for (split, text), _ in _documents(piece):
                    if split == "train" and text:
                        yield text[:sample_bytes - taken]
                        taken += len(text)
                        if taken >= sample_bytes:
                            return

    t0 = time.perf_counter()
    tok = train_bpe(sample(), vocab_size)
    tmp = out / "tokenizer.json.tmp"
    tok.save(str(tmp))
    tmp.replace(out / "tokenizer.json")
    logger.info("prepare: trained a byte-level BPE of %d tokens on the first %.0f MB of training text in %.1f s",
                vocab_size, sample_bytes / 1e6, time.perf_counter() - t0)


# ---------------------------------------------------------------- reading

def _owned_bytes(piece: Piece):
    """(offset in the file, block): the piece's bytes in newline-aligned blocks of about _BLOCK,
    the lines that start in [start, end)."""
    opener = gzip.open if piece.path.endswith(".gz") else open
    with opener(piece.path, "rb") as f:
        pos = piece.start
        if pos > 0:  # skip to the first line start at or after `start`
            if opener is open:
                f.seek(pos - 1)
            else:
                _skip(f, pos - 1)
            pos = pos - 1 + len(f.readline())
        end = piece.end
        while end < 0 or pos < end:
            want = _BLOCK if end < 0 else min(_BLOCK, end - pos)
            block = f.read(want)
            if not block:
                return
            if not block.endswith(b"\n"):
                block += f.readline()  # finish the line that starts inside the range
            yield pos, block
            pos += len(block)


def _skip(f, n: int) -> None:
    while n > 0:
        n -= len(f.read(min(n, _BLOCK)))


def _text(block: bytes) -> str | None:
    if b"\0" in block:
        return None
    try:
        return block.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _documents(piece: Piece):
    """(split, text or None for skipped bytes, bytes read) of the piece's documents: a text
    file's blocks (a whole file at once: a binary file is skipped, as data.source skips it) or
    its JSON lines."""
    if piece.jsonl:
        for offset, block in _owned_bytes(piece):
            for line in block.splitlines(keepends=True):
                yield _record(piece, line, offset), len(line)
                offset += len(line)
        return
    blocks = [b"".join(b for _, b in _owned_bytes(piece))] if piece.whole else (b for _, b in _owned_bytes(piece))
    for block in blocks:
        text = _text(block)
        yield (piece.split, text), len(block)


def _record(piece: Piece, line: bytes, offset: int) -> tuple[str, str | None]:
    """(split, text) of the JSON line at byte `offset` of its (uncompressed) file."""
    if not line.strip():
        return "train", ""
    try:
        text = json.loads(line)[_TEXT_FIELD]
        if not isinstance(text, str):
            raise TypeError
    except (ValueError, KeyError, TypeError, IndexError):
        raise UserError(f"{piece.path}: the line at byte {offset} is not a JSON "
                        f"object with a string field {_TEXT_FIELD!r} ({line[:60]!r}); accepted: JSON lines with "
                        "that field (--text-field names it)") from None
    return ("val" if _is_val(f"{piece.rel}@{offset}", _VAL_FRACTION) else "train"), text


# ---------------------------------------------------------------- the workers

_TEXT_FIELD, _VAL_FRACTION = "text", 0.05
_PROGRESS = None  # a queue of (text bytes, tokens) the parent reports


def _init_worker(text_field: str, val_fraction: float, progress) -> None:
    global _TEXT_FIELD, _VAL_FRACTION, _PROGRESS
    _TEXT_FIELD, _VAL_FRACTION, _PROGRESS = text_field, val_fraction, progress


def _unit_names(index: int) -> dict[str, str]:
    return {split: f"{split}-{index:05d}.bin" for split in ("train", "val")}


def prepare_unit(unit: Unit, out: Path, kind: str, fingerprint: str) -> dict:
    """Tokenize one unit into its training and validation shards, then mark it done."""
    tokenizer = _load_tokenizer(out, kind)
    writers = {split: ShardWriter(out / name, tokenizer.vocab_size, fingerprint)
               for split, name in _unit_names(unit.index).items()}
    pending = {"train": [], "val": []}
    read = {"train": 0, "val": 0}  # input bytes behind the pending text
    has_doc = dict(unit.lead)
    skipped = 0

    def flush(split: str) -> None:
        tokens = tokenizer.encode("".join(pending[split]))
        writers[split].append(tokens)
        if _PROGRESS is not None:
            _PROGRESS.put((read[split], len(tokens)))
        pending[split], read[split] = [], 0

    for piece in unit.pieces:
        starts_doc = piece.start == 0  # a later range of a file continues its document
        for (split, text), nbytes in _documents(piece):
            if text is None:
                skipped += nbytes
            if not text:
                continue
            if has_doc[split] and (piece.jsonl or starts_doc):
                pending[split].append("\n")
            starts_doc, has_doc[split] = False, True
            pending[split].append(text)
            read[split] += nbytes
            if read[split] >= _BLOCK:
                flush(split)
    for split in pending:
        flush(split)
    shards = {split: w.close() for split, w in writers.items()}
    record = {"unit": asdict(unit), "shards": shards, "skipped_bytes": skipped}
    tmp = out / f"unit-{unit.index:05d}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(out / f"unit-{unit.index:05d}.json")
    return record


# ---------------------------------------------------------------- the driver

def _settings(source: str, tokenizer: str, bpe_vocab_size: int, bpe_sample_mb: float, val_fraction: float,
              text_field: str, shard_mb: float, units: list[Unit]) -> dict:
    plan = hashlib.sha256(json.dumps([asdict(u) for u in units]).encode()).hexdigest()[:16]
    spec = tokenizer if tokenizer in ("byte", "bpe") else hashlib.sha256(Path(tokenizer).expanduser().read_bytes()).hexdigest()[:16]
    return {"format": FORMAT, "version": VERSION, "source": source, "tokenizer": spec,
            "bpe_vocab_size": bpe_vocab_size if tokenizer == "bpe" else None,
            "bpe_sample_mb": bpe_sample_mb if tokenizer == "bpe" else None, "val_fraction": val_fraction,
            "text_field": text_field, "shard_mb": shard_mb, "units": len(units), "input": plan}


def _check_args(source: str, out: Path, tokenizer: str, bpe_vocab_size: int, val_fraction: float,
                shard_mb: float, bpe_sample_mb: float, workers: int) -> str:
    """The tokenizer's kind (byte, bpe or file), or one line on what is wrong."""
    checks = [(0 < val_fraction < 1, "--val-fraction", val_fraction, "a number in (0, 1)"),
              (shard_mb > 0, "--shard-mb", shard_mb, "a number > 0"),
              (bpe_sample_mb > 0, "--bpe-sample-mb", bpe_sample_mb, "a number > 0"),
              (bpe_vocab_size >= 260, "--bpe-vocab-size", bpe_vocab_size, "an integer >= 260"),
              (workers >= 0, "--workers", workers, "an integer >= 0 (0: one a core)")]
    for ok, flag, value, accepted in checks:
        if not ok:
            raise UserError(f"{flag}: bad value {value!r}; accepted: {accepted}")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; accepted: a new or empty folder, or one an "
                        "earlier mixprec prepare of the same source wrote")
    if tokenizer in ("byte", "bpe"):
        return tokenizer
    path = Path(tokenizer).expanduser()
    if not path.is_file():
        raise UserError(f"--tokenizer {tokenizer!r} is neither byte, bpe nor a file; accepted: "
                        "byte, bpe, or the path of a Hugging Face tokenizer.json")
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception on a bad file
        raise UserError(f"--tokenizer {tokenizer}: not a tokenizer.json the tokenizers library "
                        f"reads ({str(e)[:80]}); accepted: byte, bpe, or a Hugging Face tokenizer.json") from None
    return "file"


def _done(out: Path, index: int) -> dict | None:
    """The record of a unit an earlier run finished, if its shards are whole."""
    try:
        record = json.loads((out / f"unit-{index:05d}.json").read_text())
        for shard in record["shards"].values():
            if read_header(out / shard["file"])["crc32"] != shard["crc32"]:
                return None
        return record
    except (OSError, ValueError, KeyError, UserError):
        return None


class _Progress:
    """A log line every few seconds: bytes and tokens done, rate, time left."""

    def __init__(self, total: int, every: float = 5.0):
        self.total, self.every, self.bytes, self.tokens = total, every, 0, 0
        self.t0 = self.last = time.perf_counter()

    def add(self, nbytes: int, tokens: int) -> None:
        self.bytes, self.tokens = self.bytes + nbytes, self.tokens + tokens
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last, rate = now, self.bytes / max(now - self.t0, 1e-9)
            left = f"{(self.total - self.bytes) / rate:.0f} s" if rate and self.total > self.bytes else "-"
            logger.info("prepare: %.0f of %.0f MB (%.0f%%), %d tokens, %.1f MB/s, about %s left",
                        self.bytes / 1e6, self.total / 1e6, 100 * self.bytes / max(self.total, 1), self.tokens,
                        rate / 1e6, left)


def run_prepare(source: str, out: str | Path, tokenizer: str = "byte", bpe_vocab_size: int = 4096,
                val_fraction: float = 0.05, text_field: str = "text", shard_mb: float = 128.0,
                bpe_sample_mb: float = 64.0, workers: int = 0) -> dict:
    """Write (or finish) the token shards of `source` into `out`; returns the index."""
    out = Path(out).expanduser()
    kind = _check_args(source, out, tokenizer, bpe_vocab_size, val_fraction, shard_mb, bpe_sample_mb, workers)
    _init_worker(text_field, val_fraction, None)  # this process reads documents too (the BPE sample)
    t0 = time.perf_counter()
    units = plan_units(source, val_fraction, max(1, int(shard_mb * 1e6)))
    settings = _settings(source, tokenizer, bpe_vocab_size, bpe_sample_mb, val_fraction, text_field, shard_mb, units)
    out.mkdir(parents=True, exist_ok=True)
    if (out / SETTINGS).is_file():
        before = json.loads((out / SETTINGS).read_text())
        if before != settings:
            differ = ", ".join(f"{k} {before.get(k)!r} -> {v!r}" for k, v in settings.items() if before.get(k) != v)
            raise UserError(f"--out {out} holds a preparation with other settings or input "
                            f"({differ}); accepted: the same arguments and input to finish it, or another --out")
    elif any(out.iterdir()):
        raise UserError(f"--out {out} is not empty and holds no mixprec preparation; accepted: a new "
                        "or empty folder")
    (out / SETTINGS).write_text(json.dumps(settings, indent=1))
    for stale in out.glob("*.tmp"):  # an interrupted run's unfinished files
        stale.unlink()
    if kind == "file":
        shutil.copyfile(Path(tokenizer).expanduser(), out / "tokenizer.json")
    elif kind == "bpe" and not (out / "tokenizer.json").is_file():
        _train_bpe(units, bpe_vocab_size, int(bpe_sample_mb * 1e6), out)
    vocab = _load_tokenizer(out, kind).vocab_size
    fingerprint = _fingerprint(out, kind)

    records = {u.index: r for u in units if (r := _done(out, u.index)) is not None}
    todo = [u for u in units if u.index not in records]
    if records:
        logger.info("prepare: %d of %d units already done by an earlier run, kept", len(records), len(units))
    total = sum(_input_bytes(u.pieces) for u in todo)
    n = min(workers or len(os.sched_getaffinity(0)), max(len(todo), 1))
    logger.info("prepare: %s -> %s: %d units of about %g MB, %.0f MB to tokenize on %d worker processes (%s "
                "tokenizer, vocabulary %d, %s shards)", source, out, len(units), shard_mb, total / 1e6, n,
                tokenizer, vocab, token_dtype(vocab).name)
    if todo:
        records.update(_run_units(todo, out, kind, fingerprint, n, text_field, val_fraction, total))
    shards = {split: [records[u.index]["shards"][split] for u in units] for split in ("train", "val")}
    index = {"format": FORMAT, "version": VERSION, "source": source,
             "tokenizer": {"kind": kind, "vocab_size": vocab, "fingerprint": fingerprint},
             "dtype": token_dtype(vocab).name, "separator": "\n", "val_fraction": val_fraction,
             "tokens": {split: sum(s["tokens"] for s in shards[split]) for split in shards},
             "skipped_bytes": sum(r["skipped_bytes"] for r in records.values()), "splits": shards}
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(out / INDEX)
    seconds = time.perf_counter() - t0
    logger.info("prepare: %d training and %d validation tokens in %d shards, %.1f s (%.1f MB/s of input)%s",
                index["tokens"]["train"], index["tokens"]["val"], 2 * len(units), seconds, total / 1e6 / seconds,
                f"; {index['skipped_bytes']} bytes of binary or non-UTF-8 input skipped" if index["skipped_bytes"] else "")
    return index


def _run_units(todo: list[Unit], out: Path, kind: str, fingerprint: str, workers: int, text_field: str,
               val_fraction: float, total: int) -> dict[int, dict]:
    """The units on `workers` processes, progress logged as their blocks finish."""
    report = _Progress(total)
    if workers == 1:  # this process, no pool
        records = {}
        for unit in todo:
            record = records[unit.index] = prepare_unit(unit, out, kind, fingerprint)
            report.add(_input_bytes(unit.pieces), sum(s["tokens"] for s in record["shards"].values()))
        return records
    ctx = multiprocessing.get_context("spawn")  # the workers import no torch and inherit no threads
    progress = ctx.Queue()
    if workers > 1 and kind != "byte":  # one tokenizer thread a process, one process a core
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    records = {}
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(text_field, val_fraction, progress)) as pool:
        futures = {pool.submit(prepare_unit, u, out, kind, fingerprint): u.index for u in todo}
        try:
            while futures:
                finished, _ = wait(futures, timeout=1.0, return_when=FIRST_COMPLETED)
                while True:
                    try:
                        report.add(*progress.get_nowait())
                    except queue.Empty:
                        break
                for f in finished:
                    records[futures.pop(f)] = f.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    return records
