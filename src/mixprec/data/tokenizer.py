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
    """A `tokenizers` tokenizer (trained here, or a pretrained model's tokenizer.json). Texts are
    encoded without special tokens (a BOS is the model's business, not the corpus's), each to
    the tokens of the whole text: in pieces encoded in parallel where the cuts change nothing
    (`cut_is_invisible`), else whole."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.cuttable = cut_is_invisible(tokenizer)

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, in one batch call."""
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets (tokenizers 0.20+)
        pieces = [text_pieces(t) if self.cuttable else [t] for t in texts]
        encodings = iter(batch([p for ps in pieces for p in ps], add_special_tokens=False))
        return [[i for _ in ps for i in next(encodings).ids] for ps in pieces]

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

        return torch.tensor(self.encode_texts([text])[0], dtype=torch.long)

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


def cut_is_invisible(tok) -> bool:
    """Whether a text cut after a newline between two non-blank characters (`text_pieces`)
    encodes to the whole text's tokens: a byte-level pre-tokenizer (GPT-2's, Llama 3's, the
    BPE trained here) splits there anyway, unless it adds a prefix space to each text; a
    SentencePiece layout (Llama 2's: a normalizer that prepends "▁", no pre-tokenizer, or a
    Metaspace one) would give each piece its own "▁"."""
    import json

    spec = json.loads(tok.to_str())

    def nodes(tree):
        if isinstance(tree, dict):
            yield tree
            tree = list(tree.values())
        if isinstance(tree, list):
            for child in tree:
                yield from nodes(child)

    pre = list(nodes(spec.get("pre_tokenizer")))
    byte_level = [n for n in pre if n.get("type") == "ByteLevel"]
    prepends = any(n.get("type") in ("Prepend", "Metaspace") for n in [*nodes(spec.get("normalizer")), *pre])
    return bool(byte_level) and not any(n.get("add_prefix_space") for n in byte_level) and not prepends


def text_pieces(text: str, size: int = 8192) -> list[str]:
    """`text` in pieces of about `size` characters, each cut after a newline between two
    characters that are not blank (where a byte-level pre-tokenizer splits anyway)."""
    pieces, start = [], 0
    while start < len(text):
        end = start + size
        while end < len(text) and not (text[end - 1] == "\n" and not text[end - 2].isspace()
                                       and not text[end].isspace()):
            end = text.find("\n", end) + 1 or len(text)
        pieces.append(text[start:end])
        start = end
    return pieces


def _chunks(text: str, size: int = 1 << 16):
    """Pieces of about `size` characters cut after a newline: what a BPE is trained on here."""
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
