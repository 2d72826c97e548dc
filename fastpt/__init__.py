"""fastpt: a compile-first pretraining engine for small Llama-style language models."""

import sys
from importlib.util import find_spec
from pathlib import Path


def _kernels_home() -> None:
    """fastpt.kernels is the kernels/ folder beside this fastpt/ (the link fastpt/kernels -> ../kernels
    in a checkout, a copy in an installed wheel). A checkout without the link (cloned with symlinks
    off) finds none, or another install's through its editable finder: say so before any of it runs."""
    here = Path(__file__).resolve().parent
    spec = find_spec(f"{__name__}.kernels")
    found = [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
    if not found:
        raise ImportError(
            f"fastpt's kernels are missing: {here / 'kernels'} should link to ../kernels "
            "(a clone made with symlinks off: `git config core.symlinks true && git checkout -- fastpt/kernels`)"
        )
    if (here / "kernels").resolve() not in found:
        print(
            f"fastpt: WARNING: fastpt's kernels come from another tree: {found[0]}, not {here / 'kernels'}; "
            f"this fastpt ({here}) runs with kernels it was not tested with. Make {here / 'kernels'} the link "
            "to ../kernels (`git checkout -- fastpt/kernels`) or run from the tree you installed.",
            file=sys.stderr,
        )


_kernels_home()

if sys.argv[:1] == ["-m"]:  # `python -m fastpt.<command>` is starting (argv[0] is "-m" until the module is found)
    from fastpt.errors import _interrupt_hook

    # A Ctrl-C while the command imports torch is one line and exit 130; `import fastpt` in a
    # program of its own leaves sys.excepthook alone.
    sys.excepthook = _interrupt_hook(sys.excepthook)
