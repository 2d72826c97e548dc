"""fastpt: a compile-first pretraining engine for small Llama-style language models."""

import sys

if sys.argv[:1] == ["-m"]:  # `python -m fastpt.<command>` is starting (argv[0] is "-m" until the module is found)
    from fastpt.errors import _interrupt_hook

    # A Ctrl-C while the command imports torch is one line and exit 130; `import fastpt` in a
    # program of its own leaves sys.excepthook alone.
    sys.excepthook = _interrupt_hook(sys.excepthook)
