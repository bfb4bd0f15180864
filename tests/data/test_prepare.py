"""`mixprec prepare` and training on its shards, against the in-memory text path."""

import gzip
import json
import shutil
import subprocess
import sys
import zlib

import pytest
import torch

from mixprec.cli import main
from mixprec.data.corpus import load_corpus
from mixprec.data.prepare import run_prepare
from mixprec.data.shards import HEADER_BYTES, open_prepared
from mixprec.data.tokenizer import ByteTokenizer
from tests.conftest import kill_9_after, run_train, tiny_args
from tests.test_cli import one_line_error


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """30 text files of different lengths, a binary file and an empty one."""
    root = tmp_path_factory.mktemp("texts")
    for i in range(30):
        (root / f"{i:02d}.txt").write_text("".join(f"file {i} line {j}: {'é' * (j % 3)} text\n" for j in range(40 * (i + 1))))
    (root / "blob.bin").write_bytes(b"\0\1\2" * 100)
    (root / "empty.txt").write_text("")
    return root


def everything(tokens) -> torch.Tensor:
    return tokens.rows(torch.tensor([0]), len(tokens))[0]


@pytest.fixture(scope="module")
def prepared(folder, tmp_path_factory):
    """The folder in shards of about 8 KB: units cut through files, windows across shards."""
    out = tmp_path_factory.mktemp("prepared") / "shards"
    run_prepare(str(folder), out, shard_mb=0.008, workers=1)
    return out


def test_a_prepared_folder_holds_the_tokens_of_the_text_path(folder, prepared):
    corpus, data = load_corpus(str(folder), 0.05), open_prepared(prepared)
    index = json.loads((prepared / "index.json").read_text())
    assert len(index["splits"]["train"]) > 10 and index["dtype"] == "uint8"
    assert torch.equal(everything(data.train), ByteTokenizer().encode(corpus.train))
    assert torch.equal(everything(data.val), ByteTokenizer().encode(corpus.val))


def test_training_on_shards_equals_training_on_the_text(tmp_path, folder, prepared):
    flags = ("--training.steps", "4", "--training.local_batch_size", "8")
    text = run_train(tmp_path / "text", folder, *flags)
    shards = run_train(tmp_path / "shards", prepared, *flags)
    keys = ("loss", "grad_norm", "val_loss")
    assert [[r.get(k) for k in keys] for r in shards] == [[r.get(k) for k in keys] for r in text]


def test_two_workers_write_the_same_shards_and_a_rerun_keeps_finished_units(tmp_path, folder, prepared, caplog):
    out = tmp_path / "again"
    run_prepare(str(folder), out, shard_mb=0.008, workers=2)
    ours, theirs = (json.loads((d / "index.json").read_text()) for d in (out, prepared))
    assert ours["splits"] == theirs["splits"]
    # an interrupted run: one unit's marker and shard gone, a half-written file left over
    (out / "unit-00003.json").unlink()
    (out / "train-00003.bin").unlink()
    (out / "train-00004.bin.tmp").write_bytes(b"partial")
    (out / "index.json").unlink()
    caplog.set_level("INFO", logger="mixprec")
    run_prepare(str(folder), out, shard_mb=0.008, workers=1)
    assert f"{len(ours['splits']['train']) - 1} of {len(ours['splits']['train'])} units already done" in caplog.text
    assert json.loads((out / "index.json").read_text())["splits"] == theirs["splits"]
    assert not list(out.glob("*.tmp"))


def test_one_file_jsonl_gz_and_a_users_tokenizer_json(tmp_path, text_file):
    text = text_file.read_text()
    single = tmp_path / "single"
    run_prepare(str(text_file), single, shard_mb=0.05, workers=1)  # one file: its tail is validation
    data = open_prepared(single)
    assert bytes(everything(data.train).tolist()) + bytes(everything(data.val).tolist()) == text.encode()
    assert bytes(everything(data.val).tolist()).decode().startswith(text.splitlines(keepends=True)[-len(
        bytes(everything(data.val).tolist()).decode().splitlines())])  # the cut is at a line start

    alone = tmp_path / "alone"  # a folder of that one file: too few files for a file-level split
    alone.mkdir()
    shutil.copy(text_file, alone / "corpus.txt")
    run_prepare(str(alone), tmp_path / "alone-shards", shard_mb=0.05, workers=1)
    assert [s["crc32"] for s in json.loads((tmp_path / "alone-shards" / "index.json").read_text())["splits"]["val"]] \
        == [s["crc32"] for s in json.loads((single / "index.json").read_text())["splits"]["val"]]

    bpe = tmp_path / "bpe"
    run_prepare(str(text_file), bpe, tokenizer="bpe", bpe_vocab_size=300, workers=1)
    from tokenizers import Tokenizer  # long texts are encoded in pieces: the tokens of the whole text

    whole = Tokenizer.from_file(str(bpe / "tokenizer.json")).encode(
        bytes(everything(data.train).tolist()).decode(), add_special_tokens=False).ids
    assert everything(open_prepared(bpe).train).tolist() == whole
    records = [{"text": line, "id": i} for i, line in enumerate(text.split("\n\n")) if line.strip()]
    source = tmp_path / "docs.jsonl.gz"
    with gzip.open(source, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n")
    users = tmp_path / "users"
    run_prepare(str(source), users, tokenizer=str(bpe / "tokenizer.json"), workers=1)
    data = open_prepared(users)
    assert data.tokenizer_kind == "file" and data.vocab_size == 300
    tok = data.tokenizer()
    train, val = tok.decode(everything(data.train)), tok.decode(everything(data.val))
    assert sorted(train.split("\n") + val.split("\n")) == sorted(t for r in records for t in r["text"].split("\n"))
    assert 0 < len(val) < len(train)


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "train-00002.bin").unlink(), ["train-00002.bin is missing"]),
    (lambda d: (d / "train-00003.bin").write_bytes((d / "train-00003.bin").read_bytes()[:-3]),
     ["train-00003.bin has", "partial"]),
    (lambda d: _flip(d / "train-00005.bin"), ["train-00005.bin is damaged", "CRC-32"]),
    (lambda d: shutil.copy(d / "train-00001.bin", d / "train-00007.bin"), ["train-00007.bin has", "replaced"]),
    (lambda d: _flip(d / "train-00006.bin", rewrite_header=True), ["train-00006.bin is not the shard the index"]),
    (lambda d: (d / "index.json").write_text("{"), ["index.json is not a mixprec token index"]),
])
def test_a_damaged_folder_stops_before_any_step(tmp_path, prepared, capsys, damage, words):
    shards = tmp_path / "shards"
    shutil.copytree(prepared, shards)
    damage(shards)
    run = tmp_path / "run"
    err = one_line_error(capsys, ["train", "--data.source", str(shards), "--model.flavor", "debug",
                                  "--job.dump_folder", str(run), "--training.device", "cpu"])
    assert all(w in err for w in words), err
    assert not (run / "metrics.jsonl").exists()


def _flip(path, rewrite_header=False):
    """One bit of one token flipped; with rewrite_header, the header's checksum made to match
    (a whole shard, but not the one the index lists)."""
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 7] ^= 1
    if rewrite_header:
        data[28:32] = zlib.crc32(data[HEADER_BYTES:]).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_a_shard_of_another_tokenizer_and_a_checkpoint_of_another_tokenizer(tmp_path, folder, prepared, capsys):
    other = tmp_path / "bpe"
    run_prepare(str(folder), other, tokenizer="bpe", bpe_vocab_size=300, shard_mb=0.008, workers=1)
    mixed = tmp_path / "mixed"
    shutil.copytree(prepared, mixed)
    shutil.copy(other / "train-00001.bin", mixed / "train-00001.bin")
    err = one_line_error(capsys, ["train", "--data.source", str(mixed), "--job.dump_folder", str(tmp_path / "r"),
                                  "--training.device", "cpu"])
    assert "train-00001.bin was written with another tokenizer" in err
    # a run made on the byte shards does not resume on the BPE ones
    run = tmp_path / "run"
    run_train(run, prepared, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2")
    err = one_line_error(capsys, ["train", "--data.source", str(other), "--model.flavor", "debug",
                                  "--job.dump_folder", str(run), "--training.device", "cpu", "--training.seq_len",
                                  "32", "--checkpoint.enable", "--training.steps", "4"])
    assert "does not match this config" in err and "tokenizer: checkpoint 'byte' vs config 'bpe " in err


@pytest.mark.parametrize("argv, words", [
    (["prepare", "/no/such/folder", "--out", "X"], ["'/no/such/folder' does not exist"]),
    (["prepare", "stdlib", "--out", "X", "--tokenizer", "gpt2"], ["--tokenizer 'gpt2' is neither"]),
    (["prepare", "stdlib", "--out", "X", "--val-fraction", "1.5"], ["--val-fraction: bad value 1.5"]),
    (["prepare", "stdlib"], ["--out"]),
])
def test_bad_prepare_arguments(tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, argv)
    assert all(w in err for w in words), err


def test_prepare_refuses_a_foreign_folder_and_other_settings(tmp_path, folder, prepared, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    err = one_line_error(capsys, ["prepare", str(folder), "--out", str(foreign)])
    assert "is not empty and holds no mixprec preparation" in err and (foreign / "notes.txt").read_text() == "keep me"
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    err = one_line_error(capsys, ["prepare", str(folder), "--out", str(copy), "--shard-mb", "0.008",
                                  "--val-fraction", "0.2"])
    assert "holds a preparation with other settings" in err and "val_fraction 0.05 -> 0.2" in err
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before


def test_jsonl_without_the_text_field_is_one_line(tmp_path, capsys):
    source = tmp_path / "d.jsonl"
    source.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    err = one_line_error(capsys, ["prepare", str(source), "--out", str(tmp_path / "o"), "--workers", "1"])
    assert "d.jsonl" in err and "string field 'text'" in err and "--text-field" in err


def _train_cmd(folder, source) -> list[str]:
    return [sys.executable, "-m", "mixprec", *tiny_args(
        folder, source, "--training.steps", "16", "--training.seq_len", "64", "--training.local_batch_size", "8",
        "--training.eval_interval", "8", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
        "--precision.preset", "fp32")]


def _records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_reads_the_same_tokens_in_the_same_order(tmp_path, prepared):
    """A run on shards killed (SIGKILL) after its step-8 checkpoint, then started again, logs
    every step's loss and grad norm as the uninterrupted run does, bit for bit. (Two gloo ranks
    on shards, one killed and restarted by torchrun: tests/distributed/test_elastic.py.)"""
    full, run = tmp_path / "full", tmp_path / "killed"
    done = subprocess.run(_train_cmd(full, prepared), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = run / "checkpoint" / "step-8.pt"
    kill_9_after(_train_cmd(run, prepared), saved)
    steps_before = [r["step"] for r in _records(run)]
    assert saved.exists() and steps_before[-1] < 16, steps_before  # killed mid-run, after the checkpoint
    again = subprocess.run(_train_cmd(run, prepared), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    keys = ("step", "loss", "grad_norm", "val_loss")
    assert [[r.get(k) for k in keys] for r in _records(run)] == [[r.get(k) for k in keys] for r in _records(full)]


@pytest.mark.parametrize("eos, config", [("<|endoftext|>", None), ("<doc_end>", {"eos_token": {"content": "<doc_end>"}})])
def test_a_pretrained_tokenizers_eos_separates_documents(tmp_path, text_file, eos, config):
    from mixprec.data.tokenizer import train_bpe

    text = text_file.read_text()
    tok = train_bpe([text[:50_000]], 300)
    tok.add_special_tokens([eos, "<pad>"])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    if config:
        (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    docs = [d for d in text.split("\n\n") if d.strip()][:200]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    index = run_prepare(str(source), tmp_path / "out", tokenizer=str(tmp_path / "tok" / "tokenizer.json"),
                        shard_mb=0.004, workers=1)  # units of ~4 KB: flushes fall inside and between documents
    eos_id = tok.token_to_id(eos)
    assert index["separator"] == eos
    data = open_prepared(tmp_path / "out")
    ids = everything(data.train).tolist() + [eos_id] + everything(data.val).tolist()
    pieces, start = [], 0
    for i, t in enumerate(ids + [eos_id]):
        if t == eos_id:
            pieces.append(ids[start:i])
            start = i + 1
    # every document's own tokens, each exactly once, between end-of-text tokens
    assert sorted(map(tuple, pieces)) == sorted(tuple(tok.encode(d, add_special_tokens=False).ids) for d in docs)


def test_an_unfinished_preparation_is_refused_and_a_rerun_finishes_it(tmp_path, folder, prepared, capsys):
    # issue 55 item 3: without index.json the folder was read as text (its JSON metadata trained on, exit 0)
    unfinished = tmp_path / "shards"
    shutil.copytree(prepared, unfinished)
    (unfinished / "index.json").unlink()
    run = tmp_path / "run"
    err = one_line_error(capsys, ["train", "--data.source", str(unfinished), "--model.flavor", "debug",
                                  "--job.dump_folder", str(run), "--training.device", "cpu"])
    assert "never finished" in err and "re-run mixprec prepare" in err, err
    assert not (run / "metrics.jsonl").exists()
    run_prepare(str(folder), unfinished, shard_mb=0.008, workers=1)
    assert everything(open_prepared(unfinished).train).tolist() == everything(open_prepared(prepared).train).tolist()


def _users_tokenizer(tmp_path, layout: str, lines: list[str]):
    """A tokenizer.json as pretrained models ship them, with Llama's BOS template: byte-level
    (GPT-2, Llama 3) or SentencePiece's layout (Llama 2: "▁" prepended, no pre-tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    special = ["<s>", "</s>"]
    if layout == "byte-level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=special, show_progress=False)
    else:
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False)
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path = tmp_path / f"{layout}.json"
    path.write_text(tok.to_str())
    return tok, path


@pytest.mark.parametrize("layout", ["byte-level", "sentencepiece"])
def test_long_texts_encode_to_the_tokenizers_own_tokens_without_special_ones(tmp_path, layout):
    # issue 55 items 4 and 5: the text path put a BOS every 64K characters (encode_batch adds special tokens);
    # prepare's 8,192-character pieces each got their own "▁" under SentencePiece's layout
    from mixprec.data.prepare import _FileEncoder
    from mixprec.data.tokenizer import build_tokenizer

    lines = [f"line {i}: {'word ' * (i % 7)}and {i * 37 % 1000} more" for i in range(3000)]
    tok, path = _users_tokenizer(tmp_path, layout, lines[:300])
    text = "\n".join(lines)  # ~100,000 characters, one document
    assert len(text) > 1 << 16
    want = tok.encode(text, add_special_tokens=False).ids
    in_memory = build_tokenizer(str(path), "", 0, tmp_path / "unused")
    assert in_memory.cuttable == (layout == "byte-level")
    assert in_memory.encode(text).tolist() == want
    assert _FileEncoder(path).encode(text).tolist() == want


def test_no_split_begins_with_a_separator_when_the_first_unit_wrote_nothing(tmp_path):
    # issue 55 item 7: a binary file first (a unit of its own): the next unit opened the split with a newline
    source = tmp_path / "texts"
    source.mkdir()
    (source / "00.bin").write_bytes(b"\0\1\2" * 4000)
    for i in range(1, 13):
        (source / f"{i:02d}.txt").write_text("".join(f"doc {i} line {j}\n" for j in range(400)))
    out = tmp_path / "shards"
    run_prepare(str(source), out, shard_mb=0.008, workers=1)
    corpus = load_corpus(str(source), 0.05)  # the in-memory path: the same texts, joined by newlines
    data = open_prepared(out)
    for split, text in (("train", corpus.train), ("val", corpus.val)):
        got = bytes(everything(getattr(data, split)).tolist()).decode()
        assert got == text, (split, got[:40], text[:40])


def test_a_rerun_repairs_damaged_shards(tmp_path, folder, prepared, caplog):
    # issue 55 item 8: a re-run compared only the header's CRC with its record: a flipped bit or a cut shard survived
    shards = tmp_path / "shards"
    shutil.copytree(prepared, shards)
    _flip(shards / "train-00005.bin")
    (shards / "train-00003.bin").write_bytes((shards / "train-00003.bin").read_bytes()[:-3])
    val = next(s["file"] for s in json.loads((shards / "index.json").read_text())["splits"]["val"] if s["tokens"] > 8)
    _flip(shards / val, rewrite_header=True)  # a whole shard, but not the one recorded
    with caplog.at_level("WARNING", logger="mixprec"):
        run_prepare(str(folder), shards, shard_mb=0.008, workers=1)
    damaged = {"train-00005.bin", "train-00003.bin", val}
    assert {f for f in damaged if f"{f} is damaged" in caplog.text} == damaged
    repaired, original = open_prepared(shards), open_prepared(prepared)
    assert everything(repaired.train).tolist() == everything(original.train).tolist()
    assert everything(repaired.val).tolist() == everything(original.val).tolist()


def test_bad_sources_and_outputs_are_one_line(tmp_path, capsys):
    # issue 55 item 9: tracebacks before (RuntimeError for ~user, EOFError for a cut .gz), and an empty or binary
    # source "prepared" 0 tokens with exit 0
    whole = gzip.compress(b"".join(b"line %d of the text\n" % i for i in range(4000)))
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"{i}.txt").write_text("words of a document\n" * 800)
    (texts / "cut.txt.gz").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "a.bin").write_bytes(b"\0\1\2" * 50)
    cases = [
        (["~nosuchuser/x.txt", "--out", str(tmp_path / "a")], "home folder of a user this machine does not have"),
        ([str(texts), "--out", "~nosuchuser/o"], "--out '~nosuchuser/o' names the home folder"),
        ([str(texts / "cut.txt.gz"), "--out", str(tmp_path / "b")], "cut.txt.gz: not a readable gzip file"),
        ([str(texts), "--out", str(tmp_path / "c"), "--workers", "2", "--shard-mb", "0.01"],  # in a worker
         "cut.txt.gz: not a readable gzip file"),
        ([str(tmp_path / "empty.txt"), "--out", str(tmp_path / "d")], "holds no text"),
        ([str(tmp_path / "binary"), "--out", str(tmp_path / "e")], "gave no training tokens"),
    ]
    for argv, words in cases:
        err = one_line_error(capsys, ["prepare", *argv])
        assert words in err, (argv, err)
    assert not (tmp_path / "d").exists() and not (tmp_path / "e" / "index.json").exists()
