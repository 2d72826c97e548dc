"""The errors a user's mistake raises, and how every fastpt command reports them.

Library code raises these (never SystemExit); each message names the file, key or value at
fault. Only a command's `main` turns them into one `fastpt: error: ...` line and exit code 2
(1 for a write the OS refused).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
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


class DiskError(FastptError):
    """The OS refused a write (a full disk, a read-only folder, a file-size limit); the message names
    the path and the OS's reason. Exit 1: the command line was right, the machine said no."""

    exit_code = 1


class MissingPackage(FastptError, ImportError):
    """An optional package that a requested feature needs; the message says what to install."""


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
        how = f"pip install 'fastpt[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
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
