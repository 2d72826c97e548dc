"""fastpt kernels: fused RMSNorm and (linear +) cross-entropy, with pure-PyTorch references.

Knows nothing about fastpt. The import name is shared with an unrelated PyPI package,
so fastpt checks ``kernels.__fastpt_kernels__`` after importing.
"""
from kernels import reference

__fastpt_kernels__ = True
__all__ = ["rms_norm", "cross_entropy", "linear_cross_entropy"]


def rms_norm(x, weight, eps=1e-6, *, backend="auto"):
    return reference.rms_norm(x, weight, eps)


def cross_entropy(logits, target, ignore_index=-100, reduction="mean", *, backend="auto"):
    return reference.cross_entropy(logits, target, ignore_index, reduction)


def linear_cross_entropy(input, weight, target, ignore_index=-100, reduction="mean", *, backend="auto"):
    return reference.linear_cross_entropy(input, weight, target, ignore_index, reduction)
