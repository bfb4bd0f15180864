import pytest
import torch

from mixprec import UserError
from mixprec.data.corpus import load_corpus
from mixprec.data.loader import TrainLoader, val_batches
from mixprec.data.tokenizer import BPETokenizer, ByteTokenizer


def test_stdlib_corpus_is_real_deterministic_and_split():
    a, b = load_corpus("stdlib", 0.05), load_corpus("stdlib", 0.05)
    assert a.train == b.train and a.val == b.val
    assert len(a.train) > 5_000_000 and len(a.val) > 100_000
    assert "def " in a.train and "import " in a.val
    assert a.val not in a.train  # held-out files are not in the training text


def test_user_folder_and_file(tmp_path, text_file):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(30):
        (folder / f"{i}.txt").write_text(f"file {i}\n" * 50)
    (folder / "blob.bin").write_bytes(b"\0\1\2")  # binary files are skipped
    corpus = load_corpus(str(folder), 0.2)
    assert corpus.train and corpus.val and "\0" not in corpus.train + corpus.val
    single = load_corpus(str(text_file), 0.1)
    assert single.train + single.val == text_file.read_text()


@pytest.mark.parametrize("make, words", [
    (lambda p: p / "missing", ["does not exist"]),
    (lambda p: (p / "empty").mkdir() or p / "empty", ["no UTF-8 text"]),
    (lambda p: (p / "e.txt").write_text("") or p / "e.txt", ["no UTF-8 text"]),
])
def test_bad_sources(tmp_path, make, words):
    with pytest.raises(UserError) as e:
        load_corpus(str(make(tmp_path)), 0.1)
    assert all(w in str(e.value) for w in words)


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids.dtype == torch.long and int(ids.max()) < 256
    assert tok.decode(ids) == "héllo"


def test_bpe_is_trained_then_cached(tmp_path, text_file):
    text = text_file.read_text()
    cache = tmp_path / "tokenizer.json"
    tok = BPETokenizer.train_or_load(text, 300, cache)
    assert cache.exists() and tok.vocab_size == 300
    ids = tok.encode(text[:2000])
    assert len(ids) < 2000 and tok.decode(ids) == text[:2000]
    again = BPETokenizer.train_or_load("different text", 300, cache)
    assert torch.equal(again.encode(text[:2000]), ids)
    with pytest.raises(UserError, match="bpe_vocab_size"):
        BPETokenizer.train_or_load(text, 512, cache)


def test_loader_is_deterministic_and_resumable():
    tokens = torch.arange(1000)
    a = TrainLoader(tokens, seq_len=10, batch_size=7, seed=3)
    batches = [a.next_batch() for _ in range(40)]  # past one epoch of 99 windows
    x, y = batches[0]
    assert x.shape == (7, 10) and torch.equal(y, x + 1)
    b = TrainLoader(tokens, seq_len=10, batch_size=7, seed=3)
    for _ in range(25):
        b.next_batch()
    c = TrainLoader(tokens, seq_len=10, batch_size=7, seed=3)
    c.load_state_dict(b.state_dict())
    for i in range(25, 40):
        assert torch.equal(c.next_batch()[0], batches[i][0])
    # One epoch visits every window once.
    epoch = torch.cat([x[:, 0] for x, _ in batches])[:99]
    assert sorted(epoch.tolist()) == list(range(0, 990, 10))


def test_short_splits_are_user_errors():
    with pytest.raises(UserError, match="shorter than one sequence"):
        TrainLoader(torch.arange(10), seq_len=16, batch_size=2, seed=0)
    with pytest.raises(UserError, match="validation split"):
        val_batches(torch.arange(10), 16, 2, 2)


def test_each_rank_reads_only_its_rows_of_the_global_batch():
    tokens = torch.arange(1000)
    full = TrainLoader(tokens, seq_len=10, batch_size=8, seed=1)
    ranks = [TrainLoader(tokens, seq_len=10, batch_size=8, seed=1, rows=slice(4 * r, 4 * r + 4)) for r in range(2)]
    for _ in range(30):  # across epochs
        x, y = full.next_batch()
        mine = [loader.next_batch() for loader in ranks]
        assert all(m[0].shape == (4, 10) for m in mine)
        assert torch.equal(torch.cat([m[0] for m in mine]), x) and torch.equal(torch.cat([m[1] for m in mine]), y)


def test_the_window_order_is_int64_randperms_order_held_in_int32():
    for n in (10, 65_537, 1_000_003):
        loader = TrainLoader(torch.zeros(n * 2 + 1, dtype=torch.uint8), seq_len=2, batch_size=1, seed=5)
        gen = torch.Generator().manual_seed(5 * 1_000_003)
        assert loader._order.dtype == torch.int32
        assert torch.equal(loader._order.long(), torch.randperm(n, generator=gen))
