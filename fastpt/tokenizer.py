"""Tokenizers trained or built locally: byte-level BPE (Hugging Face `tokenizers`) or raw bytes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

EOT = "<|endoftext|>"


class ByteTokenizer:
    """ids 0..255 are bytes, 256 is the end-of-text separator."""

    vocab_size = 257
    eot_id = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"type": "bytes", "vocab_size": self.vocab_size}))


class BPETokenizer:
    """Byte-level BPE; every byte is in the alphabet, so no text is ever out of vocabulary."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, show_progress: bool = True) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOT], show_progress=show_progress,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))

    def save(self, path: Path) -> None:
        self.tok.save(str(path))


def load_tokenizer(path: str | Path):
    """Load a tokenizer.json written by fastpt.prepare."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json (was the data made by fastpt.prepare?)")
    if json.loads(path.read_text()).get("type") == "bytes":
        return ByteTokenizer()
    from tokenizers import Tokenizer

    return BPETokenizer(Tokenizer.from_file(str(path)))
