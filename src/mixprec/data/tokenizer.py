"""Tokenizers: UTF-8 bytes (vocabulary 256), or byte-level BPE trained locally with
the `tokenizers` library and cached in the run folder. torch is imported where a tensor is
made: `mixprec prepare`'s workers use this module without it."""

from __future__ import annotations

import logging
from pathlib import Path

from mixprec.errors import UserError

logger = logging.getLogger(__name__)


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str):
        import torch

        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    @staticmethod
    def tokenizer_json() -> str:
        """The same tokens as a Hugging Face tokenizer.json (id = byte value), for exported models:
        a byte-level BPE without merges, each byte spelt by GPT-2's printable character for it."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]
        char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
        tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return tok.to_str()


class BPETokenizer:
    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train_or_load(cls, text: str, vocab_size: int, cache: Path) -> "BPETokenizer":
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("data.tokenizer bpe needs the tokenizers package: pip install tokenizers") from None
        if cache.exists():
            try:
                tok = Tokenizer.from_file(str(cache))
            except Exception as e:  # the library raises a bare Exception on a bad file
                raise UserError(f"{cache} is not a tokenizer file ({e}); delete it or use another job.dump_folder") from None
            if tok.get_vocab_size() != vocab_size:
                raise UserError(
                    f"data.bpe_vocab_size {vocab_size} differs from the run folder's tokenizer "
                    f"({tok.get_vocab_size()} in {cache}); use {tok.get_vocab_size()} or another job.dump_folder"
                )
            logger.info("tokenizer: loaded BPE (%d tokens) from %s", vocab_size, cache)
            return cls(tok)
        logger.info("tokenizer: training BPE with %d tokens on %d characters", vocab_size, len(text))
        tok = train_bpe(_chunks(text), vocab_size)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tok.save(str(tmp))
        tmp.replace(cache)
        return cls(tok)

    def encode(self, text: str):
        import torch

        ids = [i for enc in self._tok.encode_batch(list(_chunks(text))) for i in enc.ids]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE of `vocab_size` tokens learnt from an iterable of texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _chunks(text: str, size: int = 1 << 16):
    """Pieces of about `size` characters, cut after a newline so no token spans two."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end == -1 else end + 1
        yield text[start:end]
        start = end


def tokenizer_path(value: str) -> Path:
    """data.tokenizer as a path: a tokenizer.json, or the folder that holds one."""
    p = Path(value).expanduser()
    return p / "tokenizer.json" if p.is_dir() else p


def load_tokenizer_file(path: Path) -> "BPETokenizer":
    """A Hugging Face tokenizer.json (a pretrained model's), read by the tokenizers library."""
    try:
        from tokenizers import Tokenizer

        return BPETokenizer(Tokenizer.from_file(str(path)))
    except Exception as e:  # the library raises a bare Exception on a bad file
        raise UserError(f"{path} is not a tokenizer.json the tokenizers library reads ({str(e)[:80]}); accepted: a "
                        "Hugging Face tokenizer.json") from None


def build_tokenizer(kind: str, train_text: str, vocab_size: int, cache: Path):
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":
        return load_tokenizer_file(tokenizer_path(kind))
    return BPETokenizer.train_or_load(train_text, vocab_size, cache)
