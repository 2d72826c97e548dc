"""The errors a user's mistake raises, and how every fastpt command reports them.

Library code raises these (never SystemExit); each message names the file, key or value at
fault. Only a command's `main` turns them into one `fastpt: error: ...` line and exit code 2
(1 for a write the OS refused).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn, TextIO

USAGE_EXIT = 2  # a user's mistake, as argparse exits
INTERRUPT_EXIT = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class FastptError(Exception):
    """A problem the user can fix; printed as one line, without a traceback."""

    exit_code = USAGE_EXIT


class ConfigError(FastptError, ValueError):
    """A bad option, config key or value."""


class DataError(FastptError, ValueError):
    """A problem with the user's data or tokenizer; the message names the file."""


class CheckpointError(FastptError, RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose bytes are proven wrong (a checksum mismatch, a file cut short or garbled,
    another program's file): --resume skips it. Any other failure to read one (the OS refused, it
    does not fit this code or config) is a plain CheckpointError, which stops and changes nothing."""


class DiskError(FastptError):
    """The OS refused a write (a full disk, a read-only folder, a file-size limit); the message names
    the path and the OS's reason. Exit 1: the command line was right, the machine said no."""

    exit_code = 1


class OutOfMemory(FastptError):
    """The run asked for more memory than the machine (or the GPU) has. Exit 1: the command line was
    valid, the machine said no."""

    exit_code = 1


def out_of_memory(e: BaseException) -> str:
    """The allocator's own line when `e` is a failed allocation (CPU or GPU), else ''."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError: CUDA's
        return line
    if isinstance(e, RuntimeError) and (at := text.find("can't allocate memory")) >= 0:  # CPU: from its own words on
        return text[at:].split(". Error code")[0]
    return ""


@contextlib.contextmanager
def memory_as_error(what: str) -> Iterator[None]:
    """A failed allocation while `what` runs is one OutOfMemory line saying what to change, not a traceback."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if not (reason := out_of_memory(e)):
            raise
        raise OutOfMemory(
            f"out of memory {what} ({reason}): --plan shows what the run needs; a smaller shape or --micro-batch, "
            "or --activation-checkpointing, fits in less"
        ) from None


class MissingPackage(FastptError, ImportError):
    """An optional package that a requested feature needs; the message says what to install."""


# What other trainers (Hugging Face's Trainer, nanoGPT, Megatron, torchtitan) call a fastpt key or
# value: difflib alone finds no 'lr' in 'learning_rate'.
ALIASES = {
    **dict.fromkeys(("learning_rate", "max_lr", "peak_lr"), "lr"),
    **dict.fromkeys(("batch_size", "micro_batch_size", "per_device_train_batch_size"), "micro_batch"),
    **dict.fromkeys(("gradient_accumulation_steps", "grad_accum_steps", "accumulate_grad_batches"), "grad_accum"),
    **dict.fromkeys(("max_iters", "train_iters", "max_train_steps", "num_steps", "total_steps", "steps"), "max_steps"),
    **dict.fromkeys(("warmup_iters", "warmup", "lr_warmup_steps", "num_warmup_steps"), "warmup_steps"),
    **dict.fromkeys(("wd", "weight_decay_rate", "adam_weight_decay", "decay"), "weight_decay"),
    **dict.fromkeys(("grad_clip", "clip_grad", "gradient_clipping", "clip_grad_norm", "max_norm"), "max_grad_norm"),
    **dict.fromkeys(("block_size", "context_length", "seq_length", "max_seq_length", "sequence_length"), "seq_len"),
    **dict.fromkeys(("n_layer", "num_layers", "num_hidden_layers", "depth"), "n_layers"),
    **dict.fromkeys(("n_head", "num_heads", "num_attention_heads"), "n_heads"),
    **dict.fromkeys(("n_embd", "hidden_size", "d_model", "model_dim", "width"), "dim"),
    **dict.fromkeys(("intermediate_size", "ffn_hidden_size", "d_ff", "hidden_dim"), "ffn_dim"),
    **dict.fromkeys(("adam_beta1", "beta_1"), "beta1"),
    **dict.fromkeys(("adam_beta2", "beta_2"), "beta2"),
    **dict.fromkeys(("adam_epsilon", "adam_eps", "epsilon"), "eps"),
    **dict.fromkeys(("eval_interval", "eval_steps", "val_every"), "eval_every"),
    **dict.fromkeys(("log_interval", "logging_steps"), "log_every"),
    **dict.fromkeys(("save_steps", "save_interval", "checkpoint_every", "save_every"), "ckpt_every"),
    **dict.fromkeys(("out_dir", "output_dir", "run_dir", "save_dir"), "out"),
    **dict.fromkeys(("dataset", "data_dir", "data_path", "train_data"), "data"),
    **dict.fromkeys(("lr_scheduler_type", "lr_schedule", "lr_decay_style", "scheduler"), "schedule"),
    **dict.fromkeys(("bfloat16", "torch.bfloat16"), "bf16"),
    **dict.fromkeys(("float16", "half", "torch.float16"), "fp16"),
    **dict.fromkeys(("float32", "float", "torch.float32"), "fp32"),
}


# The other commands' flags that fastpt.train has no key for, and the command each belongs to: given
# to fastpt.train (or in its TOML file) one is sent there, not to the train flag nearest in spelling
# (--tokenizer is not --optimizer).
ELSEWHERE = {
    **dict.fromkeys(
        ("tokenizer", "tokenizer_sample", "hf_dataset", "text_field", "val_fraction", "shard_tokens", "skip_binary"),
        "python -m fastpt.prepare, which makes the folder that --data trains on",
    ),
    **dict.fromkeys(
        ("ckpt", "prompt", "num_samples", "max_new_tokens", "temperature", "top_k"),
        "python -m fastpt.sample, which generates text from a run",
    ),
}


def elsewhere(name: str) -> str:
    """' (a flag of python -m fastpt.prepare, ...)' for another command's flag or key `name`, else ''."""
    command = ELSEWHERE.get(name.lstrip("-").replace("-", "_").lower())
    return f" (a flag of {command})" if command else ""


def closest(name: str, valid) -> str | None:
    """The valid name a user most likely meant by `name` (a --flag or a key): another trainer's
    name for it (ALIASES), else the first that starts with it, else difflib's nearest; None when none is near."""
    valid = list(valid)
    alias = ALIASES.get(name.lstrip("-").replace("-", "_").lower())
    forms = [alias, "--" + alias.replace("_", "-")] if alias else []
    started = [v for v in valid if len(name) > 1 and v.startswith(name)]  # 'h100' is h100-80, not h200
    return next((f for f in forms if f in valid), None) or next(
        iter(started or difflib.get_close_matches(name, valid, n=1)), None
    )


def suggest(name: str, valid) -> str:
    """' (did you mean 'X'?)' for the closest valid name, '' when none is near."""
    return f" (did you mean '{close}'?)" if (close := closest(name, valid)) else ""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A mistyped flag is a user's mistake: one line through ConfigError, not a usage dump."""
        raise ConfigError(f"command line: {message}")


def require(module: str, feature: str, pip_name: str | None = None, extra: str | None = None):
    """Import an optional package, or raise MissingPackage naming the feature and the pip command
    (fastpt's extra that brings it, when there is one)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = pip_name or module
        how = f'pip install -e ".[{extra}]" (or pip install {package})' if extra else f"pip install {package}"
        raise MissingPackage(f"{feature} needs the {package} package: {how}") from None


def fail(message: str) -> None:
    print(f"fastpt: error: {message}", file=sys.stderr, flush=True)


def run_command(main: Callable[[], int | None]) -> NoReturn:
    """Run a command's main: its return value is the exit code, a FastptError one line and exit 2
    (a DiskError exit 1), Ctrl-C one line and exit 130 (the command's own `finally` blocks clean up first)."""
    try:
        code = main() or 0
    except FastptError as e:
        fail(str(e))
        code = e.exit_code
    except KeyboardInterrupt:
        fail("interrupted")
        code = INTERRUPT_EXIT
    except BrokenPipeError:  # `| head` has read all it wants: stop quietly, as Unix tools do
        to_devnull(sys.stdout)
        code = 1
    sys.exit(code)


def to_devnull(stream: TextIO) -> None:
    """Point a stream whose reader is gone at /dev/null, so later prints (and the exit's flush)
    do not raise BrokenPipeError again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def print_or_drop(*args, **kwargs) -> None:
    """print; when the stream's reader is gone (`| head`, a closed terminal), drop this and all
    later output to it rather than stop the program: a training run outlives its log reader."""
    try:
        print(*args, **kwargs)
    except BrokenPipeError:
        to_devnull(kwargs.get("file") or sys.stdout)


def _interrupt_hook(previous):
    """A Ctrl-C that reaches the top of a fastpt command before its main runs (while `import torch`
    is loading, say) is one line and exit 130, not a traceback. Other programs keep `previous`."""

    def hook(exc_type, exc, tb):
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if issubclass(exc_type, KeyboardInterrupt) and spec is not None and spec.name.startswith("fastpt."):
            fail("interrupted")
            os._exit(INTERRUPT_EXIT)
        previous(exc_type, exc, tb)

    return hook
