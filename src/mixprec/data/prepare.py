"""`mixprec prepare SOURCE --out DIR`: text to token shards once, so training reads the windows it
draws instead of reading and tokenizing its corpus at every start.

The input is cut into units of about `shard_mb` of text (`mixprec.data.units`: what a unit
holds and which split each document goes to); each unit is tokenized by one worker process,
streaming, into one training and one validation shard, then marked done. A re-run skips the
units already done; index.json, written last, is what makes the folder trainable. Documents
of a split are separated by the tokenizer's end-of-text token where it has one (a pretrained
model's tokenizer.json: `eos_token` of the tokenizer_config.json beside it, else a special
token named as Llama, GPT-2 or Gemma name theirs), so that the model sees where a document
ends as it did in pretraining; otherwise by a newline, as `data.source` joins a folder's files,
so a folder prepared with the byte tokenizer gives the tokens the trainer makes of the same
folder in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import queue
import shutil
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mixprec.data.shards import (FORMAT, HEADER_BYTES, INDEX, SETTINGS, VERSION, ShardWriter, read_header,
                                 shard_crc, token_dtype)
from mixprec.data.tokenizer import BPETokenizer
from mixprec.data.units import BLOCK, Unit, documents, input_bytes, plan_units
from mixprec.errors import UserError, user_path

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- tokenizers

class _ByteEncoder:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


class _FileEncoder:
    """A `tokenizers` tokenizer.json: each document's tokens as the trainer's text path makes them."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.tok = BPETokenizer(Tokenizer.from_file(str(path)))
        self.vocab_size = self.tok.vocab_size

    def encode(self, text: str) -> np.ndarray:
        return self.encode_documents([text], None)

    def encode_documents(self, texts: list[str], eos: int | None) -> np.ndarray:
        """The tokens of each text, `eos` between two (in one batch call for all of them)."""
        parts = []
        for i, ids in enumerate(self.tok.encode_texts(texts)):
            if i and eos is not None:
                parts.append(np.array([eos], dtype=np.int64))
            parts.append(np.asarray(ids, dtype=np.int64))
        return np.concatenate(parts or [np.zeros(0, np.int64)])


END_OF_TEXT = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")  # Llama 3, GPT-2 and Qwen, Llama 2, Gemma


def eos_token(tokenizer_json: Path) -> tuple[str, int] | None:
    """(content, id) of the tokenizer's end-of-text token: tokenizer_config.json's eos_token
    beside the file, else a special token of the usual names; None when it has neither."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    config = tokenizer_json.with_name("tokenizer_config.json")
    names = list(END_OF_TEXT)
    try:
        named = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
        names.insert(0, named.get("content") if isinstance(named, dict) else named)
    except (ValueError, AttributeError):
        pass
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for name in names:
        if name and name in special:
            return name, tok.token_to_id(name)
    return None


def _load_tokenizer(out: Path, kind: str):
    return _ByteEncoder() if kind == "byte" else _FileEncoder(out / "tokenizer.json")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _fingerprint(out: Path, kind: str) -> str:
    return _digest(b"byte" if kind == "byte" else (out / "tokenizer.json").read_bytes())


def _train_bpe(source_units: list[Unit], vocab_size: int, sample_bytes: int, out: Path, text_field: str,
               val_fraction: float) -> None:
    """A byte-level BPE (the trainer's own kind) trained on the first sample_bytes of training text."""
    from mixprec.data.tokenizer import train_bpe

    def sample():
        taken = 0
        for unit in source_units:
            for piece in unit.pieces:
                for (split, text), _ in documents(piece, text_field, val_fraction):
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


# ---------------------------------------------------------------- the workers

_PROGRESS = None  # a worker's queue of (input bytes, tokens) the parent reports


def _init_worker(progress) -> None:
    global _PROGRESS
    _PROGRESS = progress


def _unit_names(index: int) -> dict[str, str]:
    return {split: f"{split}-{index:05d}.bin" for split in ("train", "val")}


def prepare_unit(unit: Unit, out: Path, kind: str, fingerprint: str, text_field: str, val_fraction: float,
                 eos: int | None = None) -> dict:
    """Tokenize one unit into its training and validation shards, then mark it done; `eos`
    separates documents (None: a newline)."""
    tokenizer = _load_tokenizer(out, kind)
    writers = {split: ShardWriter(out / name, tokenizer.vocab_size, fingerprint)
               for split, name in _unit_names(unit.index).items()}
    pending = {"train": [], "val": []}
    read = {"train": 0, "val": 0}  # input bytes behind the pending text
    has_doc = dict(unit.lead)
    own = {"train": False, "val": False}  # whether this unit has written a document of the split
    lead = {}  # tokens of the separator after an earlier unit's documents, written first (see _drop_stray_leads)
    separator = np.array([eos], dtype=np.int64) if eos is not None else tokenizer.encode("\n")
    skipped = 0

    def flush(split: str) -> None:
        if eos is None:
            tokens = tokenizer.encode("".join(pending[split]))
        else:  # a None stands where a document ends
            docs = [[]]
            for t in pending[split]:
                docs.append([]) if t is None else docs[-1].append(t)
            tokens = tokenizer.encode_documents(["".join(d) for d in docs], eos)
        writers[split].append(tokens)
        if _PROGRESS is not None:
            _PROGRESS.put((read[split], len(tokens)))
        pending[split], read[split] = [], 0

    for piece in unit.pieces:
        starts_doc = piece.start == 0  # a later range of a file continues its document
        for (split, text), nbytes in documents(piece, text_field, val_fraction):
            if text is None:
                skipped += nbytes
            if not text:
                continue
            if has_doc[split] and (piece.jsonl or starts_doc):
                if own[split]:
                    pending[split].append("\n" if eos is None else None)
                else:  # after an earlier unit's documents
                    writers[split].append(separator)
                    lead[split] = len(separator)
            starts_doc, has_doc[split], own[split] = False, True, True
            pending[split].append(text)
            read[split] += nbytes
            if read[split] >= BLOCK:
                flush(split)
    for split in pending:
        flush(split)
    shards = {split: w.close() for split, w in writers.items()}
    record = {"unit": asdict(unit), "shards": shards, "skipped_bytes": skipped, "lead": lead}
    _write_record(out, unit.index, record)
    return record


def _write_record(out: Path, index: int, record: dict) -> None:
    tmp = out / f"unit-{index:05d}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(out / f"unit-{index:05d}.json")


def _drop_stray_leads(out: Path, units: list[Unit], records: dict[int, dict], vocab: int, fingerprint: str) -> None:
    """A unit opens a split with a separator where the plan saw earlier documents of it; where
    those wrote nothing after all (a binary file, JSON lines that all went to the other split),
    the split would begin with that separator: it is cut from the shard, rewritten."""
    for split in ("train", "val"):
        for unit in units:
            record = records[unit.index]
            shard = record["shards"][split]
            if record.get("lead", {}).get(split):
                n = record["lead"].pop(split)
                path = out / shard["file"]
                tokens = np.fromfile(path, dtype=token_dtype(vocab), offset=HEADER_BYTES)
                writer = ShardWriter(path, vocab, fingerprint)
                writer.append(tokens[n:])
                record["shards"][split] = writer.close()
                _write_record(out, unit.index, record)
                logger.info("prepare: %s began with a separator after no document (dropped)", shard["file"])
            if shard["tokens"]:
                break


# ---------------------------------------------------------------- the driver

def _settings(source: str, tokenizer: str, bpe_vocab_size: int, bpe_sample_mb: float, val_fraction: float,
              text_field: str, shard_mb: float, units: list[Unit]) -> dict:
    plan = _digest(json.dumps([asdict(u) for u in units]).encode())
    spec = tokenizer if tokenizer in ("byte", "bpe") else _digest(Path(tokenizer).expanduser().read_bytes())
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
    """The record of a unit an earlier run finished, if its shards are whole: each one's size,
    header and tokens (read again: a flipped bit or a cut file is tokenized again)."""
    try:
        record = json.loads((out / f"unit-{index:05d}.json").read_text())
    except (OSError, ValueError):
        return None
    try:
        for shard in record["shards"].values():
            path = out / shard["file"]
            header = read_header(path)
            whole = (header["crc32"] == shard["crc32"] and header["tokens"] == shard["tokens"]
                     and path.stat().st_size == HEADER_BYTES + shard["tokens"] * header["itemsize"])
            if not whole or shard_crc(path) != shard["crc32"]:
                logger.warning("prepare: %s is damaged (its size, header or tokens are not what unit %d recorded): "
                               "the unit is tokenized again", shard["file"], index)
                return None
        return record
    except (OSError, KeyError, TypeError, UserError) as e:
        logger.warning("prepare: unit %d's shards are unreadable (%s): the unit is tokenized again", index, e)
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
    out = user_path(str(out), "--out")
    kind = _check_args(source, out, tokenizer, bpe_vocab_size, val_fraction, shard_mb, bpe_sample_mb, workers)
    t0 = time.perf_counter()
    units = plan_units(source, val_fraction, max(1, int(shard_mb * 1e6)))
    if not sum(input_bytes(u.pieces) for u in units):
        raise UserError(f"{source!r} holds no text (empty files only); accepted: a text, .jsonl or .gz file, or a "
                        "folder of them, with text in it")
    settings = _settings(source, tokenizer, bpe_vocab_size, bpe_sample_mb, val_fraction, text_field, shard_mb, units)
    eos = eos_token(Path(tokenizer).expanduser()) if kind == "file" else None
    if eos is not None:
        settings["separator"] = eos[0]  # older preparations (a newline) keep their settings
        logger.info("prepare: documents separated by the tokenizer's %s (id %d)", *eos)
    elif kind == "file":
        logger.info("prepare: the tokenizer has no end-of-text token (no eos_token in a tokenizer_config.json beside "
                    "it, none of %s); documents separated by a newline", ", ".join(END_OF_TEXT))
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
        _train_bpe(units, bpe_vocab_size, int(bpe_sample_mb * 1e6), out, text_field, val_fraction)
    vocab = _load_tokenizer(out, kind).vocab_size
    fingerprint = _fingerprint(out, kind)

    records = {u.index: r for u in units if (r := _done(out, u.index)) is not None}
    todo = [u for u in units if u.index not in records]
    if records:
        logger.info("prepare: %d of %d units already done by an earlier run, kept", len(records), len(units))
    total = sum(input_bytes(u.pieces) for u in todo)
    n = min(workers or len(os.sched_getaffinity(0)), max(len(todo), 1))
    logger.info("prepare: %s -> %s: %d units of about %g MB, %.0f MB to tokenize on %d worker processes (%s "
                "tokenizer, vocabulary %d, %s shards)", source, out, len(units), shard_mb, total / 1e6, n,
                tokenizer, vocab, token_dtype(vocab).name)
    if todo:
        records.update(_run_units(todo, out, kind, fingerprint, n, text_field, val_fraction, total,
                                  eos[1] if eos else None))
    _drop_stray_leads(out, units, records, vocab, fingerprint)
    shards = {split: [records[u.index]["shards"][split] for u in units] for split in ("train", "val")}
    index = {"format": FORMAT, "version": VERSION, "source": source,
             "tokenizer": {"kind": kind, "vocab_size": vocab, "fingerprint": fingerprint},
             "dtype": token_dtype(vocab).name, "separator": eos[0] if eos else "\n", "val_fraction": val_fraction,
             "tokens": {split: sum(s["tokens"] for s in shards[split]) for split in shards},
             "skipped_bytes": sum(r["skipped_bytes"] for r in records.values()), "splits": shards}
    if not index["tokens"]["train"]:  # no index: the folder stays unfinished, refused as a data.source
        raise UserError(f"{source!r} gave no training tokens ({index['skipped_bytes']} bytes skipped as binary or "
                        "not UTF-8); accepted: a source with text in it")
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(out / INDEX)
    seconds = time.perf_counter() - t0
    logger.info("prepare: %d training and %d validation tokens in %d shards, %.1f s (%.1f MB/s of input)%s",
                index["tokens"]["train"], index["tokens"]["val"], 2 * len(units), seconds, total / 1e6 / seconds,
                f"; {index['skipped_bytes']} bytes of binary or non-UTF-8 input skipped" if index["skipped_bytes"] else "")
    return index


def _run_units(todo: list[Unit], out: Path, kind: str, fingerprint: str, workers: int, text_field: str,
               val_fraction: float, total: int, eos: int | None) -> dict[int, dict]:
    """The units on `workers` processes, progress logged as their blocks finish."""
    report, records, args = _Progress(total), {}, (out, kind, fingerprint, text_field, val_fraction, eos)
    if workers == 1:  # this process, no pool
        for unit in todo:
            record = records[unit.index] = prepare_unit(unit, *args)
            report.add(input_bytes(unit.pieces), sum(s["tokens"] for s in record["shards"].values()))
        return records
    ctx = multiprocessing.get_context("spawn")  # the workers import no torch and inherit no threads
    progress = ctx.Queue()
    if kind != "byte":  # one tokenizer thread a process, one process a core
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(progress,)) as pool:
        futures = {pool.submit(prepare_unit, u, *args): u.index for u in todo}
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
