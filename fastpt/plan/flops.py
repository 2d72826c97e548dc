"""What one op of a traced step asks of a GPU: its matmuls (M, N, K, batch) or attention FLOPs, the
bytes it reads and writes, its launches and its collectives. From the op and its (fake) tensors
alone; plan.timing turns a Cost into time on a card.

- views and allocations are free (no kernel); `_local_scalar_dense` (.item()) is a sync;
- bytes: every tensor argument read once, every output and mutated argument written once;
- matmuls: 2 M N K per product (mm, addmm, bmm, baddbmm); attention (flash, memory-efficient,
  cuDNN): 4 B H Tq Tk hd forward, half of it causal, and 2.5 x that in the backward (FlashAttention's
  five matmuls, the forward's scores recomputed);
- fastpt's fused linear + cross-entropy: its chunked matmuls (logits; with the gradient also
  dinput and dweight) and the logits' own traffic (written, read and overwritten by the
  cross-entropy kernel, read by the gradient matmuls), which the fake never shows;
- multi-tensor kernels (fused AdamW, foreach ops): one launch per 36 tensors or per 320 blocks of
  65,536 elements, whichever is more (PyTorch's multi_tensor_apply for four lists);
- collectives (c10d and functional): the bytes a ring moves through each GPU's link.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MATMULS = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1}  # op -> index of its first factor
ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}
FREE = {
    "_unsafe_view",
    "alias",
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "set_",
    "resize_",
}
SYNCS = {"_local_scalar_dense", "item"}
MULTI_TENSOR_CHUNK, MULTI_TENSOR_BLOCKS, MULTI_TENSOR_LIST = 65536, 320, 36
BACKWARD_ATTENTION = 2.5  # FlashAttention's backward FLOPs per forward FLOP
COLLECTIVES = {  # name fragment -> (kind, ring factor on the full tensor's bytes)
    "all_reduce": ("all-reduce", 2.0),
    "allreduce": ("all-reduce", 2.0),
    "all_gather": ("all-gather", 1.0),
    "allgather": ("all-gather", 1.0),
    "reduce_scatter": ("reduce-scatter", 1.0),
}


@dataclass(slots=True)
class Cost:
    """One op's demand on a GPU."""

    kind: str  # free | sync | memory | matmul | attention | comm
    bytes: int = 0  # read + written
    matmuls: list[tuple[int, int, int, int]] = field(default_factory=list)  # (M, N, K, batch)
    dtype: torch.dtype | None = None  # the matmuls' inputs
    flops: float = 0.0  # matmul and attention FLOPs
    backward: bool = False  # attention: the backward kernel
    serial: bool = False  # its matmuls and its memory traffic one after the other (separate kernels)
    launches: int = 1
    comm: str = ""  # all-reduce | all-gather | reduce-scatter
    comm_bytes: int = 0  # the full tensor's bytes x the ring factor


def size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensors(tree: object) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs, each once: aten's are nested only in tuples,
    lists and dicts, which this walks directly (pytree's generic walk is a fifth of a plan's time)."""
    seen, out, stack = set(), [], [tree]
    while stack:
        t = stack.pop()
        if isinstance(t, torch.Tensor):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        elif isinstance(t, (tuple, list)):
            stack.extend(reversed(t))
        elif isinstance(t, dict):
            stack.extend(reversed(list(t.values())))
    return out


def argument(func: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str, default: object) -> object:
    """An op's argument by its schema name, passed by position or keyword."""
    if name in kwargs:
        return kwargs[name]
    names = [a.name for a in func._schema.arguments]
    i = names.index(name) if name in names else len(args)
    return args[i] if i < len(args) else default


def written(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> list[torch.Tensor]:
    """The tensors an op writes: its mutated arguments and its outputs (each once)."""
    mutated = [
        argument(func, args, kwargs, a.name, None)
        for a in func._schema.arguments
        if a.alias_info is not None and a.alias_info.is_write
    ]
    return tensors((mutated, out))


def op_cost(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> Cost:
    """What one dispatched op costs (module docstring)."""
    name = func._overloadpacket.__name__
    if name in SYNCS:
        return Cost("sync")
    if func.is_view or name in FREE or func.namespace == "prim":
        return Cost("free")
    if func.namespace in ("c10d", "_c10d_functional"):
        return collective(name, args, kwargs, out) or Cost("free")
    writes = written(func, args, kwargs, out)
    if not writes:  # metadata (sizes, devices): no kernel
        return Cost("free")
    moved = sum(size(t) for t in tensors((args, kwargs))) + sum(size(t) for t in writes)
    if name in MATMULS:
        a, b = args[MATMULS[name]], args[MATMULS[name] + 1]
        batch = a.shape[0] if a.dim() == 3 else 1
        mm = (a.shape[-2], b.shape[-1], a.shape[-1], batch)
        return Cost("matmul", moved, [mm], a.dtype, 2.0 * mm[0] * mm[1] * mm[2] * batch)
    base = name.removesuffix("_backward")
    if base in ATTENTION:
        backward = base != name
        q, k = args[1 if backward else 0], args[2 if backward else 1]
        b, h, tq, hd = q.shape
        causal = bool(argument(func, args, kwargs, "is_causal", False))
        flops = 4.0 * b * h * tq * k.shape[-2] * hd * (0.5 if causal else 1.0)
        return Cost(
            "attention",
            moved,
            dtype=q.dtype,
            flops=flops * (BACKWARD_ATTENTION if backward else 1.0),
            backward=backward,
        )
    if func.namespace == "fastpt" and name.startswith("linear_cross_entropy"):
        return linear_cross_entropy(name, args, moved)
    if func.namespace == "fastpt" and name == "rms_norm_backward":
        return Cost("memory", moved, launches=2)  # its kernel, then the sum of the weight's partials
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if lists:  # a multi-tensor kernel
        chunks = sum(-(-t.numel() // MULTI_TENSOR_CHUNK) for t in lists[0])
        return Cost(
            "memory", moved, launches=max(-(-len(lists[0]) // MULTI_TENSOR_LIST), -(-chunks // MULTI_TENSOR_BLOCKS))
        )
    return Cost("memory", moved)


def linear_cross_entropy(name: str, args: tuple, moved: int) -> Cost:
    """fastpt.linear_cross_entropy(_backward): input (N, D) @ weight (V, D).T in chunks, then the
    cross-entropy kernel over each chunk's logits, and with the gradient two more matmuls."""
    input, weight = args[0], args[1]
    n, d = input.shape
    v = weight.shape[0]
    compute_dtype = args[6]
    with_grad = name.endswith("backward") or (args[7] and args[4] != "none")
    logits = n * v * compute_dtype.itemsize
    passes = 4 if with_grad else 2  # matmul writes; CE reads (and overwrites with the gradient); two matmuls read
    mms = [(n, v, d, 1)] + ([(n, d, v, 1), (v, d, n, 1)] if with_grad else [])
    flops = sum(2.0 * m * nn * k for m, nn, k, _ in mms)
    return Cost("matmul", moved + passes * logits, mms, compute_dtype, flops, serial=True, launches=2 + 2 * with_grad)


def collective(name: str, args: tuple, kwargs: dict, out: object) -> Cost | None:
    """A collective's bytes over the ring: the full (gathered, or to-be-scattered) tensor's."""
    kind = next((v for k, v in COLLECTIVES.items() if k in name), None)
    if kind is None:
        return None
    # the gathered output, the scattered input, the reduced tensor (coalesced: the larger list's sum)
    groups = [a for a in args if isinstance(a, (list, tuple))] or [[t] for t in tensors((args, kwargs, out))]
    full = max((sum(size(t) for t in tensors(g)) for g in groups), default=0)
    return Cost("comm", comm=kind[0], comm_bytes=int(full * kind[1]))
