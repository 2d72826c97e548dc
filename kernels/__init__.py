"""fastpt kernels: fused RMSNorm and (linear +) cross-entropy, with pure-PyTorch references.

Knows nothing about fastpt (its imports are relative). The folder installs as ``fastpt.kernels``;
the top-level name ``kernels`` is Hugging Face's kernel-hub package (transformers imports it). A
checkout's root is on sys.path whenever Python starts there, so this file is also what ``import
kernels`` finds first: imported under any name but ``fastpt.kernels`` it stands aside, handing the
import to the next ``kernels`` on sys.path, or failing as if this folder were not there.
"""

if __name__ == "fastpt.kernels":
    from .api import available, cross_entropy, interpreting, linear_cross_entropy, rms_norm, tracing_only

    __all__ = ["rms_norm", "cross_entropy", "linear_cross_entropy", "available", "interpreting", "tracing_only"]
else:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is None:
        raise ModuleNotFoundError(f"No module named {__name__!r}", name=__name__)
    # The import statement returns whatever sys.modules holds once this file has run.
    sys.modules[__name__] = _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
