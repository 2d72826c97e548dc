"""A run's data: token shards found and checked, the sources of --data (mixtures), the data's
vocab and document token, and build_data: the windows, the loader and the model shape that fits."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fastpt.checkpoint import latest, resumed_model
from fastpt.config import TrainConfig
from fastpt.data.loader import TrainLoader
from fastpt.data.shards import INCOMPLETE, MAX_VOCAB, content_key, read_shard, shard_vocab
from fastpt.data.tokenizer import load_tokenizer, read_nanogpt_meta, same_tokenizer
from fastpt.data.windows import BosWindows, Mixture, Windows, WindowSet
from fastpt.distributed import Dist, barrier
from fastpt.errors import ConfigError, DataError, closest
from fastpt.files import write_atomic
from fastpt.hf import hf_tokenizer_path, load_hf
from fastpt.presets import PRESETS, ModelConfig, model_config

GPT2_VOCAB = 50257  # what nanoGPT assumes for headerless data without a meta.pkl


def prepare_hint(path: Path) -> str:
    return f"prepare it first with `python -m fastpt.prepare {path} --out DIR`, then train with --data DIR"


def nearest_folder(path: Path) -> str:
    """' (did you mean 'DIR'?)' for a folder that does not exist: at the first part of `path` that is
    missing, the closest name among the folders there (the rest of the path kept when it exists)."""
    parts = path.parts
    at = next(i for i in range(len(parts), -1, -1) if Path(*parts[:i]).is_dir())
    try:
        there = [p.name for p in Path(*parts[:at]).iterdir() if p.is_dir()]
    except OSError:
        return ""
    if not (name := closest(parts[at], there)):
        return ""
    guess = Path(*parts[:at], name)
    whole = guess.joinpath(*parts[at + 1 :])
    return f" (did you mean '{whole if whole.is_dir() else guess}'?)"


def find_shards(folder: str | Path, split: str, data_format: str = "llmc") -> list[Path]:
    """train_*.bin / val_*.bin (llm.c and ours), or nanoGPT's train.bin / val.bin; an error that
    says what to do for anything else (a text file, a folder of text, an interrupted prepare)."""
    folder = Path(folder)
    if folder.is_file():
        raise DataError(
            f"--data {folder} is a file, not a folder of token shards: "
            + (prepare_hint(folder) if folder.suffix != ".bin" else "give the folder that holds it")
        )
    if not folder.is_dir():
        raise DataError(f"data folder {folder} does not exist{nearest_folder(folder)}")
    if (folder / INCOMPLETE).exists():
        raise DataError(f"{folder} is an unfinished fastpt.prepare output (interrupted): run the prepare again")
    pattern = f"{split}.bin" if data_format == "nanogpt" else f"*{split}_*.bin"
    shards = sorted(folder.glob(pattern))
    if shards:
        return shards
    raise DataError(no_shards(folder, split, pattern, data_format))


def no_shards(folder: Path, split: str, pattern: str, data_format: str) -> str:
    """Why `folder` holds no `pattern` shards, and what to give instead."""
    if (folder / "config.toml").is_file() or latest(folder):
        return (
            f"--data {folder} is a training run's folder (config.toml, checkpoints), not data: give the "
            "prepared data it trained on (its config.toml's data)"
        )
    if data_format == "nanogpt" and any(folder.glob(f"*{split}_*.bin")):
        return f"data folder {folder} holds llm.c-format shards ({split}_*.bin): drop --data-format nanogpt"
    if data_format == "llmc" and (folder / f"{split}.bin").exists():
        return f"data folder {folder} has nanoGPT's {split}.bin: add --data-format nanogpt"
    if holds_files(folder):
        return f"data folder {folder} holds text but no {pattern} token shards: {prepare_hint(folder)}"
    return f"data folder {folder} has no {pattern} files"


def holds_files(folder: Path, most: int = 10_000) -> bool:
    """A file that is no shard in `folder` or a folder inside it (what fastpt.prepare reads), hidden
    ones aside; at most about `most` entries are looked at, so a huge tree is not walked whole."""
    seen = 0
    for _, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(not n.startswith(".") and not n.endswith(".bin") for n in names):
            return True
        seen += len(dirs) + len(names)
        if seen > most:
            break
    return False


def data_vocab(folder: Path, shards: list[Path], headerless: bool) -> int:
    """The data's vocab size, from the first that has one: meta.json (fastpt.prepare), nanoGPT's
    meta.pkl, the shard headers, a tokenizer.json beside the shards; else GPT-2's for headerless
    data (nanoGPT's own rule without a meta.pkl), else the largest token id + 1."""
    folder = Path(folder)
    if (folder / "meta.json").is_file():
        return _meta_json_vocab(folder / "meta.json")
    if (folder / "meta.pkl").is_file():
        return read_nanogpt_meta(folder / "meta.pkl")["vocab_size"]
    recorded = 0 if headerless else max(shard_vocab(p) for p in shards)
    if recorded:
        return recorded
    if (folder / "tokenizer.json").is_file():
        return load_tokenizer(folder / "tokenizer.json").vocab_size
    largest = max(max_token_id(p, headerless) for p in shards)
    return max(GPT2_VOCAB, largest + 1) if headerless else largest + 1


def _read_meta(path: Path, key: str):
    try:
        return json.loads(path.read_text())[key]
    except (OSError, UnicodeError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a readable fastpt meta.json ({type(e).__name__}: {e})") from None


def _meta_json_vocab(path: Path) -> int:
    vocab = _read_meta(path, "vocab_size")
    if not isinstance(vocab, int) or not 0 < vocab <= MAX_VOCAB:
        raise DataError(f"{path}: vocab_size {vocab!r} is not a vocabulary size (1 to {MAX_VOCAB:,})")
    return vocab


def max_token_id(path: Path, headerless: bool) -> int:
    """Largest id in a shard, scanned in chunks; cached beside the shard, keyed by its content
    (shards.content_key). A damaged or stale cache is recomputed, never trusted or fatal."""
    cache = path.with_name(f".{path.name}.maxid")
    key = content_key(path)  # a dangling symlink or unreadable shard is one line here
    with contextlib.suppress(OSError, UnicodeError, ValueError):
        saved_key, value = cache.read_text().split(" ")
        if saved_key == key:
            return int(value)
    tokens = read_shard(path, headerless)
    chunk = 1 << 24
    largest = max((int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)
    with contextlib.suppress(OSError):  # a read-only data folder just isn't cached
        write_atomic(cache, lambda f: f.write(f"{key} {largest}".encode()))
    return largest


def check_token_ids(shards: list[Path], vocab_size: int, headerless: bool) -> None:
    """Fail before training, naming the file and id, instead of a device-side assert in CUDA."""
    for p in shards:
        largest = max_token_id(p, headerless)
        if largest >= vocab_size:
            raise DataError(f"{p}: token id {largest} is out of range for vocab size {vocab_size}")


def doc_token(folder: str | Path, option: str) -> int:
    """The id of the token that starts every document of a prepared dataset (meta.json's eot_id,
    else its tokenizer.json's); a DataError naming the folder and the `option` that needs it
    when the data has none (headerless nanoGPT bins, a tokenizer without one)."""
    folder = Path(folder)
    if (folder / "meta.json").is_file():
        token = _read_meta(folder / "meta.json", "eot_id")
    elif (folder / "tokenizer.json").is_file():
        token = load_tokenizer(folder / "tokenizer.json").eot_id
    else:
        token = None
    if not isinstance(token, int) or isinstance(token, bool):
        raise DataError(
            f"{option} needs data whose documents start with a document token, and {folder} has "
            "none (no meta.json with an eot_id): prepare its text with fastpt.prepare"
        )
    return token


@dataclass
class Source:
    """One prepared dataset of --data and its sampling weight."""

    folder: Path
    weight: float = 1.0


def data_sources(spec: str) -> list[Source]:
    """--data: '' (the default corpus) -> []; DIR -> one source; DIR:W,DIR:W,... -> a weighted mixture."""
    if not spec or Path(spec).is_dir() or ":" not in spec:
        return [Source(Path(spec))] if spec else []
    sources = []
    for item in spec.split(","):
        name, _, weight = item.strip().rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not name:
            raise DataError(f"'data' = {spec!r}: {item.strip()!r} is not DIR:WEIGHT")
        if not (value > 0 and math.isfinite(value)):
            raise DataError(f"'data': the weight {weight!r} of {name} is not a positive number")
        if not Path(name).is_dir():
            raise DataError(
                f"'data': {name} is not a folder of prepared data (weight {weight}){nearest_folder(Path(name))}"
            )
        sources.append(Source(Path(name), value))
    return sources


def check_out_of_data(out: str, data: str) -> None:
    """--out is neither a --data folder nor inside one: the run's files and checkpoints would lie among
    the shards (a prepare --overwrite of the data would delete the run)."""
    run = Path(out).resolve()
    for source in data_sources(data):
        folder = source.folder.resolve()
        if run == folder or folder in run.parents:
            where = "is" if run == folder else "is inside"
            raise ConfigError(f"--out {out} {where} the data folder {source.folder}: give the run a folder of its own")


def source_names(sources: list[Source]) -> list[str]:
    """What metrics call each source (val_loss/NAME): its folder's name, or the folder as given
    when two sources share a name."""
    names = [s.folder.name or str(s.folder) for s in sources]
    return names if len(set(names)) == len(names) else [str(s.folder) for s in sources]


def common_vocab(sources: list[Source], data_format: str) -> int:
    """The data's vocab size; the sources of a mixture must share one tokenizer (and so their ids)."""
    headerless = data_format == "nanogpt"
    vocabs = [
        data_vocab(
            s.folder,
            find_shards(s.folder, "train", data_format) + find_shards(s.folder, "val", data_format),
            headerless,
        )
        for s in sources
    ]
    first = sources[0].folder / "tokenizer.json"
    for s, vocab in zip(sources[1:], vocabs[1:]):
        other = s.folder / "tokenizer.json"
        same = (
            vocab == vocabs[0]
            and first.is_file() == other.is_file()
            and (not first.is_file() or same_tokenizer(first, other))
        )
        if not same:
            raise DataError(
                f"'data' mixes {sources[0].folder} and {s.folder}, which were not prepared with the same "
                f"tokenizer (vocab {vocabs[0]} and {vocab}): prepare every source with one --tokenizer"
            )
    return vocabs[0]


def open_windows(
    sources: list[Source], seq_len: int, packing: str, data_format: str, vocab_size: int
) -> tuple[WindowSet, WindowSet]:
    """Train and validation windows of every source (token ids checked against the vocab); a mixture
    of them when there are several. Validation is always concat, so val_loss compares across --packing."""
    headerless = data_format == "nanogpt"
    train, val = [], []
    for s in sources:
        train_shards, val_shards = (find_shards(s.folder, split, data_format) for split in ("train", "val"))
        check_token_ids(train_shards + val_shards, vocab_size, headerless)
        train.append(
            BosWindows(train_shards, seq_len, doc_token(s.folder, "'packing' = 'bos'"), headerless)
            if packing == "bos"
            else Windows(train_shards, seq_len, headerless)
        )
        val.append(Windows(val_shards, seq_len, headerless))
    if len(sources) == 1:
        return train[0], val[0]
    weights = [s.weight for s in sources]
    return Mixture(train, weights), Mixture(val, weights)


def describe_data(sources: list[Source], train: WindowSet, val: WindowSet) -> str:
    """The summary line's data part: each source's folder (and share), shards and tokens; what bos drops."""
    parts = getattr(train, "parts", [train])
    vals = getattr(val, "parts", [val])
    shares = getattr(train, "shares", [1.0])
    out = []
    for s, t, v, share in zip(sources, parts, vals, shares):
        mix = f" {share:.1%}" if len(sources) > 1 else ""
        drop = f", bos drops {t.dropped:.1%}" if isinstance(t, BosWindows) else ""
        out.append(
            f"{s.folder}{mix}: {len(t.shards)} train shards ({sum(map(len, t.tokens)):,} tokens{drop}), "
            f"{len(v.shards)} val ({sum(map(len, v.tokens)):,} tokens)"
        )
    return " + ".join(out)


MANY_EPOCHS = 4  # a run that reads its training windows more often than this mostly memorizes them


def packing_warning(train: WindowSet, windows_per_step: int, max_steps: int) -> str | None:
    """One line when --packing bos leaves the run little to learn from: it drops more than half of a
    source's tokens, or the run reads its windows more than MANY_EPOCHS times."""
    bos = [part for part in getattr(train, "parts", [train]) if isinstance(part, BosWindows)]
    if not bos:
        return None
    worst = max(bos, key=lambda part: part.dropped)
    epochs = windows_per_step * max_steps / len(train)
    if worst.dropped <= 0.5 and epochs <= MANY_EPOCHS:
        return None
    return (
        f"fastpt: warning: --packing bos drops {worst.dropped:.1%} of {worst.shards[0].parent}'s tokens "
        f"(documents longer than seq_len + 1 keep only their first window) and leaves {len(train):,} windows, "
        f"which {max_steps:,} steps read {epochs:.1f} times: expect the validation loss to climb; "
        "--packing concat keeps every token"
    )


# ---- a training run's data


@dataclass
class Data:
    sources: list[Source]  # the prepared folders of --data (several for a mixture)
    train: WindowSet
    val: WindowSet
    loader: TrainLoader
    model_config: ModelConfig  # the preset (or --init-from's shape) fitted to the data's vocab and seq_len
    init_weights: dict | None  # --init-from's weights, fastpt-named

    @property
    def dir(self) -> Path:  # the first source: its tokenizer is the run's
        return self.sources[0].folder


def default_vocab(cfg: TrainConfig) -> int:
    """The BPE size the default corpus is prepared with (tiny takes the data's)."""
    return cfg.vocab_size or PRESETS[cfg.preset].vocab_size or 4096


def default_data(cfg: TrainConfig, d: Dist, init_tokenizer: Path | None) -> Path:
    """The default corpus, prepared once by rank 0 (the others wait, then find it complete)."""
    from fastpt.prepare import default_corpus

    vocab_hint = default_vocab(cfg)
    if cfg.init_from and init_tokenizer is None:  # a BPE of our own would give its ids another meaning
        raise ConfigError(
            f"{cfg.init_from} has no tokenizer.json to prepare the default corpus with: "
            "give --data prepared with the model's tokenizer"
        )
    if d.is_main:
        default_corpus(vocab_hint, init_tokenizer)
    barrier(d)
    return default_corpus(vocab_hint, init_tokenizer)


def warn_if_other_tokenizer(data_dir: Path, init_tokenizer: Path) -> None:
    data_tokenizer = data_dir / "tokenizer.json"
    if data_tokenizer.is_file() and not same_tokenizer(init_tokenizer, data_tokenizer):
        print(
            f"fastpt: warning: {data_dir} was not prepared with {init_tokenizer}: its ids mean other tokens "
            f"to the model of --init-from (prepare it with --tokenizer {init_tokenizer})",
            file=sys.stderr,
        )


def init_model(cfg: TrainConfig) -> tuple[tuple[ModelConfig, dict | None], Path | None]:
    """--init-from's (ModelConfig, fastpt-named weights) and tokenizer. A resume with a checkpoint
    takes the checkpoint's model config and no weights (it holds the whole model), and the run
    folder's tokenizer copy: the init folder may be gone by then."""
    if resumed := resumed_model(cfg.out, cfg.resume):
        return (resumed, None), hf_tokenizer_path(cfg.init_from) or hf_tokenizer_path(cfg.out)
    return load_hf(cfg.init_from), hf_tokenizer_path(cfg.init_from)


def build_data(cfg: TrainConfig, d: Dist, device: torch.device) -> Data:
    """Memory-mapped shards (the default corpus without --data), token ids checked against the
    vocab once, the model config that fits them (with --init-from: that model's, and its weights)."""
    init, init_tokenizer = init_model(cfg) if cfg.init_from else (None, None)
    sources = data_sources(cfg.data) or [Source(default_data(cfg, d, init_tokenizer))]
    vocab = common_vocab(sources, cfg.data_format)
    if d.is_main and init_tokenizer:
        warn_if_other_tokenizer(sources[0].folder, init_tokenizer)
    document = doc_token(sources[0].folder, "'attention' = 'document'") if cfg.attention == "document" else None
    mcfg = model_config(cfg, vocab, init[0] if init else None, document)
    seq_len = cfg.seq_len or mcfg.max_seq_len
    train, val = open_windows(sources, seq_len, cfg.packing, cfg.data_format, mcfg.vocab_size)
    loader = TrainLoader(train, cfg.micro_batch, cfg.seed, device, d.rank, d.world_size)
    return Data(sources, train, val, loader, mcfg, init[1] if init else None)
