"""Generate text from a run's newest checkpoint: python -m fastpt.sample --ckpt RUN_DIR [--prompt TEXT]

The prompt is prefilled into the model's KV cache in one forward pass, then tokens are decoded
one at a time, each step attending to the cached keys and values instead of the whole text.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fastpt import checkpoint, distributed
from fastpt.checkpoint import CheckpointError
from fastpt.config import ModelConfig
from fastpt.model import Transformer
from fastpt.tokenizer import load_tokenizer


def pick(logits: torch.Tensor, temperature: float, top_k: int) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature) over the top_k (0 = all)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1))


@torch.no_grad()
def generate(model: Transformer, ids: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 200) -> list[int]:
    """Return ids followed by max_new_tokens generated tokens (model may be torch.compile'd)."""
    device = model.output_weight.device
    window = model.cfg.max_seq_len
    out = list(ids)
    cache = None
    for _ in range(max_new_tokens):
        if cache is None or cache[0][0].shape[2] == window:
            # RoPE positions are absolute, so a full cache cannot slide: refill it from the last half window.
            context = out[-(window if cache is None else window // 2):]
            logits, _, cache = model(torch.tensor([context], device=device), kv_cache=[])
        else:
            logits, _, cache = model(torch.tensor([out[-1:]], device=device), kv_cache=cache)
        out.append(pick(logits[0, -1], temperature, top_k))
    return out


def find_tokenizer(run_dir: Path, train_config: dict) -> Path:
    """The run's own copy of tokenizer.json, else the one in the data folder it trained on."""
    candidates = [run_dir / "tokenizer.json"]
    if train_config.get("data"):
        candidates.append(Path(train_config["data"]) / "tokenizer.json")
    for path in candidates:
        if path.is_file():
            return path
    raise SystemExit(f"fastpt.sample: no tokenizer.json in {' or '.join(str(p.parent) for p in candidates)}; "
                     "pass --tokenizer FILE (a tokenizer.json from fastpt.prepare or Hugging Face)")


def load_model(path: Path, device: torch.device) -> tuple[Transformer, dict]:
    """The model of a checkpoint (a file, or an FSDP shard directory gathered whole) and its state.
    Kernels follow this device ("auto"): a run that forced Triton on a GPU still samples on a CPU."""
    ckpt = checkpoint.load(path, device)
    model = Transformer(ModelConfig.from_dict(ckpt["model_config"])).to(device)
    distributed.load_state(path, ckpt, model)
    return model.eval(), ckpt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fastpt.sample", description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, metavar="RUN_DIR", help="run folder (its newest checkpoint is used)")
    ap.add_argument("--prompt", default="", help="text to continue; '' = start a new document (default: %(default)r)")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default: %(default)r)")
    ap.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default: %(default)r)")
    ap.add_argument("--top-k", type=int, default=200,
                    help="sample among the k most likely tokens; 0 = all (default: %(default)r)")
    ap.add_argument("--tokenizer", default="",
                    help="a tokenizer.json; '' = the run's, else its data folder's (default: %(default)r)")
    ap.add_argument("--device", choices=("", "cpu", "cuda"), default="",
                    help="'' = cuda if available, else cpu (default: %(default)r)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (default: %(default)r)")
    ap.add_argument("--seed", type=int, default=1337, help="random seed for sampling (default: %(default)r)")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        ap.error("--max-new-tokens must be >= 1, --temperature and --top-k >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_dir = Path(args.ckpt)
    path = checkpoint.latest(run_dir)
    if path is None:
        raise SystemExit(f"fastpt.sample: no checkpoint in {run_dir} (train with --out {run_dir} first)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        model, ckpt = load_model(path, device)
    except CheckpointError as e:
        raise SystemExit(f"fastpt.sample: {e}") from None
    tokenizer = load_tokenizer(args.tokenizer or find_tokenizer(run_dir, ckpt.get("train_config", {})))
    print(f"{path}: step {ckpt['step']}, {model.num_params():,} params, on {device}", file=sys.stderr)

    # Training documents start with end-of-text, so a prompt continues from one as well.
    ids = ([tokenizer.eot_id] if tokenizer.eot_id is not None else []) + tokenizer.encode_batch([args.prompt])[0]
    if not ids:
        raise SystemExit("fastpt.sample: empty prompt and the tokenizer has no end-of-text token; give --prompt")
    torch.manual_seed(args.seed)
    # Every decode step has a new cache length: dynamic shapes compile once instead of once per length.
    forward = torch.compile(model, dynamic=True) if args.compile else model
    out = generate(forward, ids, args.max_new_tokens, args.temperature, args.top_k)
    print(tokenizer.decode(out))


if __name__ == "__main__":
    main()
