"""fastpt: a compile-first pretraining engine for small Llama-style language models."""
import sys

from fastpt.errors import _interrupt_hook

sys.excepthook = _interrupt_hook(sys.excepthook)
