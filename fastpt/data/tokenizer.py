"""Tokenizers: trained here (byte-level BPE, characters), raw bytes, or pretrained (any Hugging Face
tokenizer.json, a Hub name, tiktoken). Each saves itself as a tokenizer.json that load_tokenizer
reads back, so a data folder, and a run folder, are enough to decode.

Every kind has the same interface: `encode_batch(list[str]) -> list[list[int]]` (no special
tokens added), `decode(ids) -> str` (special ids and ids outside the vocab are skipped, never an
error), `eot_id` (the token that starts every document, or None), `vocab_size` and
`token_bytes()` (the UTF-8 bytes of each id's text, 0 for special ids: what bits per byte divide by).
"""

from __future__ import annotations

import json
import pickle
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from fastpt.errors import DataError, FastptError, require

EOT = "<|endoftext|>"
# The token put before every document: the tokenizer's BOS when it has one (what Llama-style models
# see at a document's start), else its end-of-text (GPT-2, Qwen); the first one present wins.
DOC_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", EOT, "<|end_of_text|>", "</s>", "<eos>")
KINDS = "bpe, bytes, char, a tokenizer.json (file or folder), hf:NAME or tiktoken:NAME"


def _json(config: dict) -> bytes:
    return json.dumps(config, ensure_ascii=False).encode()


def _save_json(path: Path, config: dict) -> None:
    path.write_bytes(_json(config))


class ByteTokenizer:
    """ids 0..255 are bytes, 256 is the end-of-text separator."""

    vocab_size = 257
    eot_id = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[int]:
        return [1] * 256 + [0]

    def save(self, path: Path) -> None:
        _save_json(path, {"type": "bytes", "vocab_size": self.vocab_size})


class CharTokenizer:
    """One id per character, as nanoGPT's shakespeare_char; plus an end-of-text id after them
    when made here (nanoGPT's own meta.pkl vocabularies have none)."""

    def __init__(self, chars: str, eot: bool = True):
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}
        self.eot_id = len(chars) if eot else None
        self.vocab_size = len(chars) + eot

    @classmethod
    def train(cls, texts: Iterable[str]) -> CharTokenizer:
        seen: set[str] = set()
        for t in texts:
            seen.update(t)
        return cls("".join(sorted(seen)))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            return [[self.index[c] for c in t] for t in texts]
        except KeyError as e:
            raise DataError(
                f"character {e.args[0]!r} (U+{ord(e.args[0]):04X}) is not in the char vocabulary, "
                "which was built from a sample of the corpus: raise --tokenizer-sample"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids if 0 <= i < len(self.chars))

    def token_bytes(self) -> list[int]:
        return [len(c.encode("utf-8")) for c in self.chars] + [0] * (self.eot_id is not None)

    def config(self) -> dict:
        return {"type": "char", "chars": self.chars, "eot": self.eot_id is not None}

    def save(self, path: Path) -> None:
        _save_json(path, self.config())


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer: trained here (byte-level BPE) or any tokenizer.json."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = next((i for t in DOC_TOKENS if (i := tok.token_to_id(t)) is not None), None)
        # encode_batch_fast (tokenizers >= 0.21) skips the offsets nobody here reads
        self._encode = getattr(tok, "encode_batch_fast", tok.encode_batch)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> HFTokenizer:
        """Byte-level BPE: every byte is in the alphabet, so no text is ever out of vocabulary."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            show_progress=show_progress,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([i for i in ids if 0 <= i < self.vocab_size])

    def token_bytes(self) -> list[int]:
        """Byte-level BPE (GPT-2, Llama 3, ours) spells each byte as one character of its pieces;
        SentencePiece-style vocabularies use <0xNN> byte pieces and U+2581 for a space."""
        special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        byte_level = "ByteLevel" in json.dumps(json.loads(self.tok.to_str()).get("decoder"))
        out = []
        for i in range(self.vocab_size):
            piece = self.tok.id_to_token(i)
            if piece is None or i in special:
                out.append(0)
            elif byte_level or re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                out.append(len(piece) if byte_level else 1)
            else:
                out.append(len(piece.replace("\u2581", " ").encode("utf-8")))
        return out

    def save(self, path: Path) -> None:
        self.tok.save(str(path))


class TiktokenTokenizer:
    """An OpenAI tiktoken encoding by name (gpt2, cl100k_base, ...); its file comes from tiktoken's cache
    or the internet."""

    def __init__(self, name: str):
        tiktoken = require("tiktoken", f"the tokenizer tiktoken:{name}", extra="data")
        try:
            self.enc = tiktoken.get_encoding(name)
        except Exception as e:  # an unknown name, or no network and no cached file
            raise DataError(f"tiktoken:{name}: cannot load the encoding ({e})") from None
        self.name = name
        self.vocab_size = self.enc.n_vocab
        self.eot_id = self.enc.eot_token

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([i for i in ids if 0 <= i < self.vocab_size and i != self.eot_id])

    def token_bytes(self) -> list[int]:
        special = {self.enc.encode_single_token(t) for t in self.enc.special_tokens_set}
        out = []
        for i in range(self.vocab_size):
            try:
                out.append(0 if i in special else len(self.enc.decode_single_token_bytes(i)))
            except KeyError:  # an id the encoding leaves unused
                out.append(0)
        return out

    def save(self, path: Path) -> None:
        _save_json(path, {"type": "tiktoken", "name": self.name})


def build_tokenizer(spec: str, vocab_size: int, sample: Callable[[], Iterable[str]]):
    """The tokenizer `spec` names; `sample()` yields the texts that bpe and char learn from."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "char":
        return CharTokenizer.train(sample())
    if spec == "bpe":
        return HFTokenizer.train(sample(), vocab_size, show_progress=sys.stderr.isatty())  # bars, not a log's lines
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec.removeprefix("tiktoken:"))
    if spec.startswith("hf:"):
        return load_tokenizer(hub_tokenizer(spec))
    if not Path(spec).exists():
        raise DataError(f"--tokenizer {spec}: no such file; give {KINDS}")
    return load_tokenizer(spec)


def hub_tokenizer(spec: str) -> Path:
    """The tokenizer.json of the Hub repo `spec` (hf:NAME) names: the local cache's, else fetched. One
    request first says whether the Hub answers, so offline (or HF_HUB_OFFLINE) is one line at once,
    not the Hub client's retries (28 s of them)."""
    import huggingface_hub as hub

    name = spec.removeprefix("hf:")
    try:
        return Path(hub.hf_hub_download(name, "tokenizer.json", local_files_only=True))
    except Exception:  # not in the cache (or a cache it cannot read): ask the Hub
        pass
    try:
        hub.get_hf_file_metadata(hub.hf_hub_url(name, "tokenizer.json"), timeout=10)
        return Path(hub.hf_hub_download(name, "tokenizer.json"))
    except Exception as e:  # offline, a private repo, or no tokenizer.json in it
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"--tokenizer {spec}: cannot fetch it from the Hugging Face Hub ({reason})") from None


def pick_tokenizer_path(given: str | Path | None, found: Path | None) -> Path | None:
    """The tokenizer.json a command was given (a file, or a folder holding one), else `found`."""
    if not given:
        return found
    path = Path(given) / "tokenizer.json" if Path(given).is_dir() else Path(given)
    if not path.is_file():
        raise DataError(f"'--tokenizer' {path}: no such file")
    return path


def load_tokenizer(path: str | Path):
    """Load any tokenizer.json that fastpt writes (every kind above) or a Hugging Face tokenizer.json;
    a folder means the tokenizer.json inside it."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such tokenizer file (was the data made by fastpt.prepare?)") from None
    except (OSError, UnicodeError) as e:
        raise DataError(f"{path}: not a readable tokenizer.json ({e})") from None
    return tokenizer_from_json(text, str(path))


def tokenizer_from_json(text: str, where: str = "tokenizer.json"):
    """The tokenizer a tokenizer.json's text describes; `where` names it in errors."""
    try:
        config = json.loads(text)
    except ValueError as e:
        raise DataError(f"{where}: not a readable tokenizer.json ({e})") from None
    kind = config.get("type") if isinstance(config, dict) else None
    try:
        if kind == "bytes":
            return ByteTokenizer()
        if kind == "char":
            return CharTokenizer(config["chars"], config["eot"])
        if kind == "tiktoken":
            return TiktokenTokenizer(config["name"])
        from tokenizers import Tokenizer

        return HFTokenizer(Tokenizer.from_str(text))
    except FastptError:
        raise
    except (KeyError, TypeError) as e:
        raise DataError(f"{where}: a {kind} tokenizer.json without a valid {e}") from None
    except Exception as e:  # tokenizers' own parse error: not a Hugging Face tokenizer.json either
        raise DataError(
            f"{where}: not a tokenizer.json that fastpt or Hugging Face tokenizers can read ({e})"
        ) from None


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        """nanoGPT's meta.pkl holds only dicts, strings and ints: refuse any class, as loading
        one can run code."""
        raise pickle.UnpicklingError(f"it names {module}.{name}, a meta.pkl holds only dicts, strings and ints")


def read_nanogpt_meta(path: Path) -> dict:
    """nanoGPT's meta.pkl ({'vocab_size', 'itos', 'stoi'} for char-level data), read safely."""
    try:
        with open(path, "rb") as f:
            meta = _PlainUnpickler(f).load()
        if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int) or meta["vocab_size"] < 1:
            raise ValueError("no integer vocab_size")
        return meta
    except Exception as e:  # damaged bytes fail anywhere in the unpickler: OverflowError, MemoryError, ...
        raise DataError(f"{path}: not a nanoGPT meta.pkl ({str(e) or type(e).__name__})") from None


def char_tokenizer_from_meta(meta: dict, path: Path) -> CharTokenizer:
    """nanoGPT's char vocabulary (itos: id -> character), without an end-of-text id."""
    try:
        return CharTokenizer("".join(meta["itos"][i] for i in range(meta["vocab_size"])), eot=False)
    except (KeyError, TypeError) as e:
        raise DataError(f"{path}: a char meta.pkl needs itos for every id below vocab_size (missing {e})") from None


PROBE = "The quick brown fox, 1234 émigrés: def f(x):\n    return x ** 2  # 日本語\n"


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two tokenizer files give text the same ids (same vocab size and ids on a probe)."""
    ta, tb = load_tokenizer(a), load_tokenizer(b)
    return ta.vocab_size == tb.vocab_size and ta.encode_batch([PROBE]) == tb.encode_batch([PROBE])


def run_tokenizer(data_dir: Path) -> bytes | None:
    """What a run folder's tokenizer.json holds, what fastpt.sample needs to decode this data: the
    data's own tokenizer.json; the char vocabulary of nanoGPT's meta.pkl; or, for headerless nanoGPT
    data without one, GPT-2's (tiktoken), which is what nanoGPT assumes there. None when unknown.
    (The run writes it with its other files, atomically: metrics.write_run_folder.)"""
    data_dir = Path(data_dir)
    if (data_dir / "tokenizer.json").is_file():
        return (data_dir / "tokenizer.json").read_bytes()
    if (data_dir / "meta.pkl").is_file():
        meta = read_nanogpt_meta(data_dir / "meta.pkl")
        return _json(char_tokenizer_from_meta(meta, data_dir / "meta.pkl").config()) if "itos" in meta else None
    if (data_dir / "train.bin").is_file():
        return _json({"type": "tiktoken", "name": "gpt2"})
    return None
