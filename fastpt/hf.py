"""Hugging Face Llama folders <-> fastpt: config.json, weight names, the RoPE layout, tokenizer files.
A model with QK-norm is a Qwen3ForCausalLM folder (Llama's layers plus q_norm / k_norm per head).

fastpt's RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... of each head; HF's LlamaForCausalLM
rotates halves (x_i, x_{i + hd/2}). Export reorders each head's rows of wq and wk (the even rows,
then the odd ones), so that HF's rotation meets exactly the features fastpt's rotates together:
q.k is unchanged when q and k are permuted alike, and v and wo are untouched (QK-norm's per-feature
scales move with their features; the norm itself is blind to the order). Import undoes it.
fastpt's own layout never changes. Reading and writing need only `safetensors`, not `transformers`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from fastpt.data.tokenizer import EOT
from fastpt.errors import CheckpointError, ConfigError, require
from fastpt.files import write_error, write_output
from fastpt.model import Transformer
from fastpt.presets import ModelConfig

__all__ = [
    "from_hf_config",
    "from_hf_state_dict",
    "hf_tokenizer_path",
    "is_hf_dir",
    "load_hf",
    "save_hf",
    "to_hf_config",
    "to_hf_state_dict",
]

BLOCK_NAMES = {  # fastpt name in a block -> HF name in a decoder layer
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
ARCHITECTURES = {False: ("llama", "LlamaForCausalLM"), True: ("qwen3", "Qwen3ForCausalLM")}  # by qk_norm
# ModelConfig options Llama and Qwen3 cannot express, at their plain values. Gemma 2 has a logit
# soft-cap, but also sandwich norms, (1 + w) RMSNorm scales, a scaled embedding and GeGLU: no fastpt model maps to it.
NOT_EXPORTABLE = {
    "mlp": "swiglu",
    "logit_softcap": 0.0,
    "unet_skips": False,
    "parameter_free_norms": False,  # Llama's norms have weights; a fastpt checkpoint has none to give
    "embed_norm": False,
    "layer_scalars": False,
    "backout": False,
    "qk_norm_scale": 0.0,
    "value_embeds": False,
    "smear": False,  # Qwen3 norms before RoPE, with a weight
}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# Every file an export writes: an --out holding anything else is a user's folder, never replaced.
EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    SINGLE_FILE,
    "model-*-of-*.safetensors",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
# A tokenizer's end of text, first found wins; fastpt's own tokenizers have only EOT, both BOS and EOS.
END_TOKENS = (EOT, "<|end_of_text|>", "</s>", "<eos>")


def name_map(cfg: ModelConfig) -> dict[str, str]:
    """fastpt parameter name -> HF name, for every parameter of cfg's model."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    block = {**BLOCK_NAMES, **(QK_NORM_NAMES if cfg.qk_norm else {})}
    for i in range(cfg.n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in block.items()})
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def relayout(name: str, w: torch.Tensor, cfg: ModelConfig, to_hf: bool) -> torch.Tensor:
    """wq and wk with each head's rows moved between fastpt's RoPE pairs (0, 1), (2, 3), ... and HF's
    halves (0, 2, 4, ..., 1, 3, 5, ...), and the q_norm / k_norm scales (one head) alike; every other
    weight as it is. w (heads * hd, dim) or (hd,)."""
    heads = {
        "attention.wq.weight": cfg.n_heads,
        "attention.wk.weight": cfg.kv_heads,
        "attention.q_norm.weight": 1,
        "attention.k_norm.weight": 1,
    }.get(name.split(".", 2)[-1])
    if heads is None:
        return w
    hd, dim = w.shape[0] // heads, w[0].numel()
    pairs_first = (heads, hd // 2, 2, dim) if to_hf else (heads, 2, hd // 2, dim)
    return w.reshape(pairs_first).transpose(1, 2).reshape(w.shape)


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """fastpt's state dict as LlamaForCausalLM's (a tied head is the embedding, stored once)."""
    return {theirs: relayout(ours, state[ours], cfg, to_hf=True).contiguous() for ours, theirs in name_map(cfg).items()}


def from_hf_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's tensors as fastpt's fp32 state dict; a missing, misshapen or unknown
    tensor is one line naming it."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    names = name_map(cfg)
    # Old HF checkpoints store the RoPE table; a tied model may store its head twice.
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unknown = [
        k for k in tensors if k not in names.values() and k not in ignored and not k.endswith("rotary_emb.inv_freq")
    ]
    if unknown:
        raise CheckpointError(f"{source}: unexpected tensor '{unknown[0]}' for a Llama of this config.json")
    state = {}
    for ours, theirs in names.items():
        if theirs not in tensors:
            raise CheckpointError(f"{source}: no tensor '{theirs}'")
        w = tensors[theirs]
        if w.shape != shapes[ours]:
            raise CheckpointError(
                f"{source}: '{theirs}' has shape {list(w.shape)}, config.json says {list(shapes[ours])}"
            )
        state[ours] = relayout(ours, w, cfg, to_hf=False).float().contiguous()
    return state


def check_exportable(cfg: ModelConfig) -> None:
    """One line naming the first option of cfg that no Hugging Face architecture computes."""
    for key, plain in NOT_EXPORTABLE.items():
        if getattr(cfg, key) != plain:
            raise ConfigError(
                f"'{key}' = {getattr(cfg, key)!r}: no Hugging Face architecture computes this model "
                f"(Llama and Qwen3 need {key} = {plain!r}); it stays a fastpt checkpoint"
            )


def to_hf_config(cfg: ModelConfig, dtype: torch.dtype, bos_id: int | None, eos_id: int | None) -> dict:
    """LlamaForCausalLM's config.json for cfg (Qwen3ForCausalLM's with QK-norm: full attention in
    every layer, no sliding window), in the long-standing layout (top-level rope_theta, torch_dtype)
    that transformers 4.x and 5.x, vLLM and lm-evaluation-harness all read."""
    check_exportable(cfg)
    model_type, architecture = ARCHITECTURES[cfg.qk_norm]
    qwen3 = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": DTYPE_NAMES[dtype],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        **(qwen3 if cfg.qk_norm else {}),
    }


def from_hf_config(c: dict, source: str) -> ModelConfig:
    """The ModelConfig of a LlamaForCausalLM (or Qwen3ForCausalLM) config.json; anything that would make HF compute
    another function than fastpt's Llama is refused with one line naming the field.
    Absent optional fields take LlamaConfig's defaults."""

    def refuse(key: str, why: str):
        raise ConfigError(f"{source}: '{key}' = {json.dumps(c.get(key))} is not supported: {why}")

    def positive(key: str, default=None, kind: type | tuple = int):
        value = c.get(key, default)
        if not (isinstance(value, kind) and not isinstance(value, bool) and 0 < value < math.inf):
            refuse(key, f"a positive {'integer' if kind is int else 'number'} is required")
        return value

    kinds = {model_type: qk_norm for qk_norm, (model_type, _) in ARCHITECTURES.items()}
    if c.get("model_type") not in kinds:
        refuse("model_type", "fastpt imports Llama and Qwen3 models (model_type 'llama' or 'qwen3')")
    qk_norm = kinds[c["model_type"]]
    architecture = ARCHITECTURES[qk_norm][1]
    if c.get("architectures", [architecture]) != [architecture]:
        refuse("architectures", f"fastpt imports {architecture} for model_type {c['model_type']!r}")
    if qk_norm and c.get("use_sliding_window"):
        refuse("use_sliding_window", "fastpt's attention sees the whole window")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if c.get(key, want) != want:
            refuse(key, f"fastpt's Llama has {json.dumps(want)}")
    if c.get("quantization_config") is not None:
        refuse("quantization_config", "fastpt imports unquantized weights")
    # transformers 4.x writes rope_theta and rope_scaling; 5.x writes rope_parameters.
    rope_key = "rope_parameters" if c.get("rope_parameters") is not None else "rope_scaling"
    rope = c.get(rope_key) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        refuse(rope_key, "fastpt's RoPE has no scaling (rope_type 'default' only)")
    dim, heads = positive("hidden_size"), positive("num_attention_heads")
    kv_heads = positive("num_key_value_heads", heads)
    if dim % heads:
        refuse("num_attention_heads", f"hidden_size {dim} is not divisible by it")
    if heads % kv_heads:
        refuse("num_key_value_heads", f"num_attention_heads {heads} is not divisible by it")
    if c.get("head_dim") not in (None, dim // heads):
        refuse("head_dim", f"fastpt's head dim is hidden_size / num_attention_heads = {dim // heads}")
    cfg = ModelConfig(
        vocab_size=positive("vocab_size"),
        dim=dim,
        ffn_dim=positive("intermediate_size"),
        n_layers=positive("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=0 if kv_heads == heads else kv_heads,
        max_seq_len=positive("max_position_embeddings", 2048),
        norm_eps=positive("rms_norm_eps", 1e-6, (int, float)),
        rope_theta=positive("rope_theta", rope.get("rope_theta", 10000.0), (int, float)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qk_norm=qk_norm,
    )
    try:
        return cfg.check()  # what is left: a head dim RoPE cannot split in pairs
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model folder (fastpt run folders have config.toml, never config.json)."""
    return (Path(path) / "config.json").is_file()


def not_hf_dir(path: str | Path) -> ConfigError:
    """The error for an --init-from that is no Hugging Face model folder; a fastpt run folder (its
    config.toml) is named as one, with what the user likely meant."""
    if (Path(path) / "config.toml").is_file():
        return ConfigError(
            f"{path} is a fastpt run folder, not a Hugging Face model folder: continue it with "
            f"--resume --out {path}, or start from its weights after python -m fastpt.export {path} --out DIR "
            "(then --init-from DIR)"
        )
    return ConfigError(f"{path}: not a Hugging Face model folder (no config.json)")


def hf_tokenizer_path(hf_dir: str | Path) -> Path | None:
    """The folder's tokenizer.json (what fastpt's tokenizer loader reads), None when it has none."""
    path = Path(hf_dir) / "tokenizer.json"
    return path if path.is_file() else None


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value


def read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards its index names."""
    st = require("safetensors.torch", "importing Hugging Face weights", "safetensors")
    index = hf_dir / INDEX_FILE
    if index.is_file():
        files = sorted({hf_dir / name for name in read_json(index).get("weight_map", {}).values()})
    elif (hf_dir / SINGLE_FILE).is_file():
        files = [hf_dir / SINGLE_FILE]
    else:
        raise CheckpointError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE} (fastpt reads safetensors weights only)")
    tensors = {}
    for file in files:
        try:
            tensors.update(st.load_file(file))
        except Exception as e:  # safetensors reports a damaged file as its own SafetensorError
            raise CheckpointError(f"could not read {file}: {e}") from None
    return tensors


def load_hf(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The ModelConfig and fastpt-named fp32 state dict of a local LlamaForCausalLM folder
    (config.json + model.safetensors, or shards with model.safetensors.index.json)."""
    hf_dir = Path(hf_dir)
    if hf_dir.is_file():
        raise ConfigError(f"{hf_dir} is a file: give the Hugging Face model folder that holds it")
    if not is_hf_dir(hf_dir):
        raise not_hf_dir(hf_dir)
    cfg = from_hf_config(read_json(hf_dir / "config.json"), str(hf_dir / "config.json"))
    return cfg, from_hf_state_dict(read_safetensors(hf_dir), cfg, str(hf_dir))


def parse_size(text: str) -> int | str:
    """A --max-shard-size as huggingface_hub's shard split takes it: a byte count ('1000') as an int,
    else a size with its units ('5GB', '500MB', as transformers' save_pretrained), checked by the
    hub's own parser before any work starts."""
    hub = require("huggingface_hub", "exporting to Hugging Face", "huggingface_hub")
    size: int | str = int(text) if text.strip().isdigit() else text.strip()
    try:
        number = float(size[:-2]) if isinstance(size, str) else size  # the hub's units are two letters
        if math.isfinite(number):  # 1e400GB: the hub's int() of it overflows
            hub.split_torch_state_dict_into_shards({"probe": torch.zeros(1)}, max_shard_size=size)
    except ValueError:
        number = 0
    if not (number > 0 and math.isfinite(number)):
        raise ConfigError(f"'--max-shard-size' must be a size such as 5GB or 500MB, got {text!r}")
    return size


def save_readable(st, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with the permissions of any file this process writes (it makes its
    files owner-only: a server account could not read the weights of a shared export). A failed
    write (a full disk) is the OSError it wraps, so the caller reports the OS's reason."""
    try:
        st.save_file(tensors, path, metadata={"format": "pt"})
    except Exception as e:  # safetensors reports I/O failures as its own SafetensorError
        os_error = write_error(e)
        if os_error is None:
            raise
        raise OSError(os_error.errno, os_error.strerror, str(path)) from None
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def save_weights(tensors: dict[str, torch.Tensor], out: Path, max_shard_size: int | str) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors shards of at most max_shard_size bytes
    each (a larger tensor gets a shard of its own) with model.safetensors.index.json, split as
    huggingface_hub splits them for transformers."""
    st = require("safetensors.torch", "exporting to Hugging Face", "safetensors")
    hub = require("huggingface_hub", "exporting to Hugging Face", "huggingface_hub")
    split = hub.split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        save_readable(st, {name: tensors[name] for name in names}, out / file)
    if split.is_sharded:
        write_json(out / INDEX_FILE, {"metadata": split.metadata, "weight_map": split.tensor_to_filename})


def write_json(path: str | Path, value: dict) -> None:
    """value as indented JSON in path (its folder made if need be): the exports' files, bench's results
    (a user-named --json: files.write_output)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(value, indent=2) + "\n"
    write_output(path, lambda f: f.write(text.encode()))


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255: the alphabet of byte-level BPE."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def bytes_tokenizer():
    """fastpt's raw-bytes tokenizer as a Hugging Face `tokenizers` one: a byte-level BPE with no
    merges, so token b is byte b, and 256 is the end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in enumerate(byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok


def hf_tokenizer(tokenizer_json: Path):
    """A fastpt tokenizer.json as a Hugging Face `tokenizers` Tokenizer: a Hugging Face one as it is,
    raw bytes as a byte-level BPE; None for a kind that has no such twin (char, tiktoken)."""
    from tokenizers import Tokenizer

    text = tokenizer_json.read_text(encoding="utf-8")
    kind = json.loads(text).get("type")  # fastpt's own kinds; a Hugging Face tokenizer.json has no "type"
    if kind == "bytes":
        return bytes_tokenizer()
    return None if kind else Tokenizer.from_str(text)


def add_bos(tok, bos: str, bos_id: int) -> None:
    """Make `tok` put `bos` before every text it encodes with special tokens (transformers' default),
    as Llama's tokenizer.json does: a TemplateProcessing post-processor (after a ByteLevel one, which
    only trims offsets; any other, which would add its own tokens, is replaced)."""
    from tokenizers import processors

    template = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    kept = tok.post_processor if isinstance(tok.post_processor, processors.ByteLevel) else None
    tok.post_processor = processors.Sequence([kept, template]) if kept else template


def save_tokenizer(tok, doc_id: int | None, out: Path, max_seq_len: int) -> tuple[int | None, int | None]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json that AutoTokenizer loads and
    that encode text as fastpt trained on it: behind the document token, when there is one (as BOS,
    added by `tok(text)`, dropped by decode's skip_special_tokens). Returns the (BOS, EOS) ids: BOS
    is `doc_id`; EOS the tokenizer's end-of-text token, else the same one."""
    bos = tok.id_to_token(doc_id) if doc_id is not None else None
    if bos is not None:
        add_bos(tok, bos, doc_id)
    tok.save(str(out / "tokenizer.json"))
    eos = next((t for t in END_TOKENS if tok.token_to_id(t) is not None), bos)
    special = {name: t for name, t in (("bos_token", bos), ("eos_token", eos)) if t is not None}
    write_json(out / "special_tokens_map.json", special)
    # clean_up_tokenization_spaces would rewrite " ." to "." on decode: text must come back as it went in.
    # add_bos_token / add_eos_token say what the post-processor does, for readers of this file alone.
    # model_input_names: transformers 4.x's fast tokenizer would also return token_type_ids, which
    # generate() refuses for a Llama.
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": bos is not None,
            "add_eos_token": False,
            "model_max_length": max_seq_len,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
        },
    )
    return doc_id, None if eos is None else tok.token_to_id(eos)


def save_hf(
    out: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    tokenizer=None,
    doc_id: int | None = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write a LlamaForCausalLM folder into `out` (created if missing): config.json,
    generation_config.json, safetensors weights in `dtype`, and the tokenizer files when given a
    `tokenizers` Tokenizer (see hf_tokenizer) and the id fastpt starts documents with."""
    out.mkdir(parents=True, exist_ok=True)
    bos_id, eos_id = save_tokenizer(tokenizer, doc_id, out, cfg.max_seq_len) if tokenizer else (None, None)
    write_json(out / "config.json", to_hf_config(cfg, dtype, bos_id, eos_id))
    write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    tensors = {k: v.detach().to("cpu", dtype) for k, v in to_hf_state_dict(state, cfg).items()}
    save_weights(tensors, out, max_shard_size)
