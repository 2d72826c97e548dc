"""The kernels against the reference on a small random probe, forward and backward, where they are
about to run: a kernel that computes wrong on this device, dtype or shape, or fails to compile, is
found before it trains anything. Triton's interpreter cannot check a GPU's bf16 code, so the first
GPU run checks it itself (a trainer calls `failures` before its first step).

What is probed is what the run launches: `recording()` notes each call of the public ops (OPS) as
a `Launch` (the op, each tensor's dtype and its shape past the rows, every other argument by name,
the autocast dtype around the call and whether it runs with gradients), so a caller records its
model's calls (over fake tensors: fastpt.selfcheck) and probes each distinct launch, forward and,
with gradients, backward; an argument an op gains later is recorded and probed with no edit here.
A probe keeps what picks the kernels' code: the trailing sizes, the dtypes, the options, and so
each kernel's tile; it narrows the rest, keeping the program structure the run's launch has
(`probe_rows`): a loss's rows in several chunks of linear + cross-entropy's fp32 weight-gradient
accumulation, each several programs of the cross-entropy kernel; a norm's rows filling every
program of the RMSNorm backward with several tiles, summed into its weight gradient. On a GPU in
multiples of ROWS, as a run's rows are a multiple of 16, so that Triton specializes the integer
arguments as for the run (all but the RMSNorm backward's rows per program); fewer under the
interpreter. A loss's vocabulary is cut to two tiles of the cross-entropy kernel's sweep, a full one
and then one as long as the run's last (ragged when the run's is, with the same padding), and one
row's largest logit comes in the last, so that the sweep's carry from tile to tile is checked too.
What a run's coefficients keep below bf16's precision is probed where it shows: logits as large as
the soft-cap, where it bends; RMSNorm's eps and z-loss's coefficient raised (`probed_options`).

The oracle is the reference in float64 on the inputs as the op computes with them (those an
autocast matmul rounds, rounded first), with the kernel's upstream gradient. Each output is held to
the precision it is computed in (`precision`): the lower of its own dtype and, for an op whose
matmul autocast casts, that matmul's dtype. Two tests, each passed also within twice the
reference's own error in the run's dtype where that is larger:
- the largest difference, relative to the oracle's largest magnitude, within TOLERANCE (the
  kernels' documented accuracy: what a wrong region, a nan or a failed compile shows);
- the bias, the error's component along the oracle (sum((kernel - oracle) * oracle) /
  sum(oracle^2)), within `bias_tolerance`: the precision's unit roundoff u (bf16 3.9e-3) plus
  fp32's 1e-4. A largest difference cannot tell a 0.5% scale error from bf16 rounding (half an ulp
  is up to 0.39%); the bias can. An output rounded once from fp32 arithmetic (the norms' results
  and gradients, the weight gradients) errs by less than u in every element, so its bias, a
  weighted average of those errors, cannot pass u: no false alarm on any shape, where a 0.5% scale
  error reads 5e-3. The loss and its gradients come through bf16 logits, averages of many
  roundings: in bf16 the reference's own bias stays under u / 2 on a GPU's probe, capped at 30
  (logits up to 30, rounded by up to 0.06) or not (tests/test_selfcheck.py), where a loss 0.05 nat
  off reads 6e-3.
"""

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator

import torch

from . import api, reference

__all__ = [
    "Launch",
    "as_computed",
    "errors",
    "precision",
    "ROWS",
    "TOLERANCE",
    "bias_tolerance",
    "failures",
    "probe_inputs",
    "probe_rows",
    "probe_vocab",
    "probed_options",
    "recording",
    "run",
]

OPS = ("rms_norm", "cross_entropy", "linear_cross_entropy")
AUTOCAST_MATMUL = ("linear_cross_entropy",)  # ops whose matmul runs in the autocast dtype
# The largest difference, relative to the oracle's largest magnitude: fp32 kernels agree to ~1e-5
# (the margin covers the reductions' order), 16-bit ones to a rounding of their inputs and outputs.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# The probe's rows come in multiples of ROWS on a GPU, as a run's rows are a multiple of 16, so that
# Triton specializes the integer arguments as for the run (tests/test_aot.py), and enough that the
# rounding of a loss's bf16 logits averages out; Triton's interpreter compiles nothing and pays per
# row (a program each), so INTERPRETED_ROWS there. A loss's rows are CHUNKS chunks of linear +
# cross-entropy's fp32 weight-gradient accumulation, each two programs of the cross-entropy kernel;
# a norm's fill every program the RMSNorm backward runs on the device with TILES_PER_PROGRAM tiles,
# summed into its weight gradient. A loss ignores every other row (-100, as padding makes), so that
# the mean's 1 / rows counted is a power of two, exact in 16-bit floats (else rounding it scales
# every gradient alike: up to a unit roundoff of bias in the reference's own).
ROWS, INTERPRETED_ROWS = 32, 2
CHUNKS, TILES_PER_PROGRAM = 4, 2
# A loss's logits: LOGIT_SCALE standard deviations, a peaked softmax as a trained model's, whose
# targets (but the second row's) are drawn from it, so that the softmax's share of the gradient is as
# large as the target's and the loss a few nats; where the loss caps, at least a quarter of the cap,
# so that the largest logits (about 4 standard deviations) reach the cap, where cap * tanh(x / cap)
# bends. The second row targets the last logit, its largest: that row's maximum comes in the sweep's
# last tile, so that the running sum's rescaling from tile to tile shows.
LOGIT_SCALE = 2.0
# Terms a run keeps below bf16's precision are probed where they show (runtime arguments: the same
# compiled kernels): RMSNorm's eps against a mean square of about 1 (1e-6 changes nothing a bf16
# result can hold), and z-loss's coefficient where its gradient, 2 * z_loss * lse * softmax, is
# Z_LOSS_SHARE of the softmax's own (1e-4 at lse ~10 adds 0.2%, half a bf16 unit roundoff).
PROBE_EPS, Z_LOSS_SHARE = 0.5, 0.3


@dataclasses.dataclass(frozen=True)
class Arg:
    """A tensor argument of a launch: per row (its shape past the rows) or whole (a parameter's)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    per_row: bool
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kind of call of a public op, as a run makes it."""

    op: str
    tensors: tuple[Arg, ...]
    options: tuple[tuple[str, object], ...]  # every other argument, by name, defaults included
    autocast: torch.dtype | None  # the autocast dtype around the call, None when off
    grad: bool  # with gradients: training's call, whose backward is probed too

    def __str__(self) -> str:
        defaults = inspect.signature(getattr(api, self.op)).parameters
        shape = lambda a: "[" + ", ".join(["rows"] * a.per_row + [str(n) for n in a.shape]) + "]"  # noqa: E731
        tensors = [f"{a.name} {shape(a)} {_name(a.dtype)}" for a in self.tensors]
        options = [f"{k}={v!r}" for k, v in self.options if defaults[k].default != v]
        how = [f"under {_name(self.autocast)} autocast"] if self.autocast else []
        how.append("with gradients" if self.grad else "without gradients")
        return f"{self.op}({', '.join(tensors + options)}) {' '.join(how)}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _launch_of(op: str, bound: inspect.BoundArguments) -> Launch:
    """The launch of a call: the rows are its first tensor's leading dims, every tensor that starts
    with them and is no parameter is per row."""
    bound.apply_defaults()
    args = {k: v for k, v in bound.arguments.items() if k != "backend"}
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    first = next(iter(tensors.values()))
    rows = first.shape[:-1]

    def arg(name: str, t: torch.Tensor) -> Arg:
        per_row = not isinstance(t, torch.nn.Parameter) and t.shape[: len(rows)] == rows
        return Arg(name, tuple(t.shape[len(rows) :] if per_row else t.shape), t.dtype, per_row, t.requires_grad)

    device = first.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values())
    options = tuple((k, v) for k, v in args.items() if k not in tensors)
    return Launch(op, tuple(arg(k, t) for k, t in tensors.items()), options, autocast, grad)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """While inside, each call of a public op is noted, then made as called: yields the distinct
    launches, in the order first made."""
    seen: list[Launch] = []
    real = {name: getattr(api, name) for name in OPS}

    def recorded(name: str) -> Callable:
        signature = inspect.signature(real[name])

        @functools.wraps(real[name])
        def op(*args, **kwargs):
            if (launch := _launch_of(name, signature.bind(*args, **kwargs))) not in seen:
                seen.append(launch)
            return real[name](*args, **kwargs)

        return op

    try:
        for name in OPS:
            setattr(api, name, recorded(name))
        yield seen
    finally:
        for name, fn in real.items():
            setattr(api, name, fn)


def probe_vocab(vocab: int, dtype: torch.dtype) -> int:
    """The probe's vocabulary for a run's `vocab` whose logits are `dtype`: at most two tiles of the
    cross-entropy kernel's sweep, a full tile and then one as long as the run's last."""
    from .ops.cross_entropy import launch_plan  # imports triton: only where the kernels run

    block = launch_plan(vocab, dtype.itemsize)[1]
    return vocab if vocab <= 2 * block else block + (vocab - 1) % block + 1


def _matmul_dtype(launch: Launch) -> torch.dtype:
    """The dtype an op's matmul runs in: autocast's, else its floating inputs' promoted dtype."""
    if launch.autocast:
        return launch.autocast
    floats = [a.dtype for a in launch.tensors if a.dtype.is_floating_point]
    return functools.reduce(torch.promote_types, floats)


def _logit_scale(launch: Launch) -> float:
    """The standard deviation of the probe's logits: LOGIT_SCALE, or a quarter of the cap if more."""
    return max(LOGIT_SCALE, dict(launch.options).get("softcap", 0.0) / 4)


def probed_options(launch: Launch) -> dict:
    """The launch's options as probed: eps raised to PROBE_EPS, and a z-loss in use to where its
    gradient is Z_LOSS_SHARE of the softmax's (the log-sum-exp of the probe's logits is about their
    largest, 4 standard deviations)."""
    options = dict(launch.options)
    if launch.op == "rms_norm":
        options["eps"] = max(options["eps"], PROBE_EPS)
    if options.get("z_loss"):
        options["z_loss"] = max(options["z_loss"], Z_LOSS_SHARE / (2 * 4 * _logit_scale(launch)))
    return options


def probe_rows(launch: Launch, device: torch.device, gpu: bool | None = None) -> int:
    """The probe's rows of `launch`: a loss's CHUNKS chunks of two cross-entropy programs each, a
    norm's TILES_PER_PROGRAM tiles for each program its backward runs on `device`; in multiples of
    ROWS where it runs compiled (`gpu`, by default on CUDA), INTERPRETED_ROWS elsewhere."""
    from .ops import _launch, rms_norm  # imports triton: only where the kernels run
    from .ops.cross_entropy import launch_plan

    gpu = device.type == "cuda" if gpu is None else gpu
    multiple = ROWS if gpu else INTERPRETED_ROWS
    args = {a.name: a for a in launch.tensors}
    if launch.op == "rms_norm":
        block_rows = rms_norm._tile(args["x"].shape[-1], rms_norm.BWD_TILE)[0]
        rows = _launch.max_programs(device) * TILES_PER_PROGRAM * block_rows
        return -(-rows // multiple) * multiple
    vocab, dtype = _logits(launch)
    rows_per_program = launch_plan(probe_vocab(vocab, dtype), dtype.itemsize)[0]
    return CHUNKS * max(multiple, 2 * rows_per_program)


def _logits(launch: Launch) -> tuple[int, torch.dtype]:
    """A loss's vocabulary and the dtype of its logits as the kernel reads them."""
    args = {a.name: a for a in launch.tensors}
    if launch.op == "cross_entropy":
        return args["logits"].shape[-1], args["logits"].dtype
    return args["weight"].shape[0], _matmul_dtype(launch)


def probe_inputs(launch: Launch, device: torch.device, seed: int = 0, gpu: bool | None = None) -> dict:
    """The probe's inputs of `launch` on `device`, random from `seed`: `probe_rows` rows, a loss's
    vocabulary cut to two tiles of the sweep, its logits of `_logit_scale` and targets drawn from them."""
    rows = probe_rows(launch, device, gpu)
    gen = torch.Generator(device).manual_seed(seed)
    args = {a.name: a for a in launch.tensors}
    options = dict(launch.options)
    scale = _logit_scale(launch)

    def randn(a: Arg, *shape: int, scale: float = 1.0) -> torch.Tensor:
        shape = shape or ((rows,) if a.per_row else ()) + a.shape
        return (scale * torch.randn(shape, generator=gen, device=device)).to(a.dtype)

    def target(logits: torch.Tensor) -> torch.Tensor:
        capped = reference.soft_cap(logits.float(), options.get("softcap", 0.0))
        gumbel = -(-torch.rand(capped.shape, generator=gen, device=device).log()).log()
        t = (capped + gumbel).argmax(-1)  # a draw from the softmax (the Gumbel-max trick)
        t[::2], t[1] = options["ignore_index"], logits.shape[1] - 1
        return t

    if launch.op == "rms_norm":
        return {"x": randn(args["x"]), "weight": 1 + 0.1 * randn(args["weight"])}
    if launch.op == "linear_cross_entropy":
        vocab, dim = probe_vocab(*_logits(launch)), args["weight"].shape[1]
        x, weight = randn(args["input"]), randn(args["weight"], vocab, dim, scale=scale / dim**0.5)
        # The last logit of the second row its largest, by one.
        x1 = x[1].float()
        weight[-1] = x1 * ((x1 @ weight[:-1].float().T).max() + 1) / x1.square().sum()
        return {"input": x, "weight": weight, "target": target(x.float() @ weight.float().T)}
    if launch.op == "cross_entropy":
        logits = randn(args["logits"], rows, probe_vocab(*_logits(launch)), scale=scale)
        logits[1, -1] = logits[1, :-1].max() + 1
        return {"logits": logits, "target": target(logits)}
    raise NotImplementedError(f"no probe for the op {launch.op!r}: add its inputs to kernels/selftest.py")


def _chunks(launch: Launch, inputs: dict) -> contextlib.AbstractContextManager:
    """Linear + cross-entropy's chunks as the probe has them: CHUNKS of its rows."""
    if launch.op != "linear_cross_entropy":
        return contextlib.nullcontext()
    from .scratch import ROW_ALIGN, chunk_limit

    rows, vocab = inputs["input"].shape[0], inputs["weight"].shape[0]
    return chunk_limit(rows // CHUNKS * (vocab + -vocab % ROW_ALIGN) * _matmul_dtype(launch).itemsize)


def run(launch: Launch, inputs: dict, backend: str, upstream: list) -> list[torch.Tensor]:
    """The op's results as `launch` makes it (its autocast, with or without gradients, its options as
    probed) on `inputs`, then with gradients each input's gradient where the launch's requires one,
    for the upstream gradients in `upstream` (made on the first call)."""
    device = next(iter(inputs.values())).device.type
    wants_grad = {a.name: launch.grad and a.requires_grad for a in launch.tensors}
    leaves = {k: t.detach().requires_grad_(wants_grad[k]) for k, t in inputs.items()}
    autocast = torch.autocast(device, launch.autocast or torch.float32, enabled=launch.autocast is not None)
    with torch.set_grad_enabled(launch.grad), autocast, _chunks(launch, inputs):
        out = getattr(api, launch.op)(**leaves, **probed_options(launch), backend=backend)
    outs = list(out) if isinstance(out, tuple) else [out]
    if not launch.grad:
        return [o.detach() for o in outs]
    wanted = [o for o in outs if o.requires_grad]
    # bf16 values, exact in every dtype: with 1 / rows counted a power of two, the scale a mean's
    # gradient shares is exact in 16 bits (a rounded one would bias every element alike).
    gen = torch.Generator().manual_seed(1)
    upstream += [torch.randn(o.shape, generator=gen).bfloat16() for o in wanted[len(upstream) :]]
    torch.autograd.backward(wanted, [g.to(o.device, o.dtype) for g, o in zip(upstream, wanted)])
    return [o.detach() for o in outs] + [leaves[a.name].grad for a in launch.tensors if wants_grad[a.name]]


def precision(launch: Launch, dtype: torch.dtype) -> torch.dtype:
    """The precision an output of `dtype` is computed in: its own, or the matmul's of an op whose
    matmul autocast casts (linear + cross-entropy's fp32 loss comes from bf16 logits), the lower."""
    dtypes = [dtype] + ([_matmul_dtype(launch)] if launch.op in AUTOCAST_MATMUL else [])
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def bias_tolerance(dtype: torch.dtype) -> float:
    """The bias an output computed in `dtype` may show: its unit roundoff, plus fp32's 1e-4 (the
    reductions' order)."""
    return torch.finfo(dtype).eps / 2 + TOLERANCE[torch.float32]


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(the largest difference relative to the oracle's largest magnitude, the bias), inf for a nan."""
    diff = actual.double() - expected
    tiny = torch.finfo(torch.float64).tiny
    worst = diff.abs().max() / expected.abs().max().clamp_min(tiny)
    bias = (diff * expected).sum() / expected.square().sum().clamp_min(tiny)
    return tuple(v.nan_to_num(float("inf"), float("inf"), float("inf")).item() for v in (worst, bias))


def as_computed(launch: Launch, inputs: dict) -> dict:
    """The inputs in float64 as the op computes with them: an autocast matmul's rounded to its dtype."""
    rounds = launch.op in AUTOCAST_MATMUL and launch.autocast

    def computed(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        return (t.to(launch.autocast) if rounds else t).double()

    return {k: computed(t) for k, t in inputs.items()}


def _said(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _check(launch: Launch, device: torch.device, seed: int) -> str | None:
    """What of the launch's outputs differs from the oracle beyond its tolerance, or beyond twice the
    reference's own error in the run's dtype where that is larger; or why the kernel did not run, or
    why the probe could not (its inputs or its oracle raised: a rank that raised would leave the
    others waiting for its result)."""
    try:
        inputs, upstream = probe_inputs(launch, device, seed), []
    except Exception as e:
        return f"the probe's inputs could not be made: {_said(e)}"
    try:
        ours = run(launch, inputs, "triton", upstream)
    except Exception as e:  # a kernel that fails to compile or launch here: any error Triton raises
        return _said(e)
    try:
        return _compare(launch, inputs, upstream, ours)
    except Exception as e:
        return f"the probe's oracle failed: {_said(e)}"


def _compare(launch: Launch, inputs: dict, upstream: list, ours: list[torch.Tensor]) -> str | None:
    """_check's verdict on the kernel's outputs `ours`, against the oracle and the reference."""
    oracle = run(dataclasses.replace(launch, autocast=None), as_computed(launch, inputs), "torch", upstream)
    results = len(ours) - sum(a.requires_grad for a in launch.tensors if launch.grad)
    whats = ["the result"] if results == 1 else [f"result {i + 1} of {results}" for i in range(results)]
    whats += [f"the gradient of {a.name}" for a in launch.tensors if launch.grad and a.requires_grad]
    reference = None
    for i, (what, actual, want) in enumerate(zip(whats, ours, oracle)):
        worst, bias = errors(actual, want)
        computed_in = precision(launch, actual.dtype)
        limits = (TOLERANCE[computed_in], bias_tolerance(computed_in))
        if worst <= limits[0] and abs(bias) <= limits[1]:
            continue
        # Only now: what the dtype's rounding alone costs the reference, on the same inputs.
        reference = reference or run(launch, inputs, "torch", upstream)
        own = errors(reference[i], want)
        if worst > (limit := max(limits[0], 2 * own[0])):
            return f"{what} differs from the reference by {worst:.1e} of its largest value (tolerance {limit:.0e})"
        if abs(bias) > (limit := max(limits[1], 2 * abs(own[1]))):
            return f"{what} is off the reference by {bias:+.1e} of its size on average (tolerance {limit:.1e})"
    return None


def failures(launches: list[Launch], device: torch.device, seed: int = 0) -> dict[str, str]:
    """Each op whose kernel fails its probe (random from `seed`) of one of `launches` on `device`: the
    launch and what went wrong; empty when all pass."""
    found: dict[str, str] = {}
    for launch in launches:
        if launch.op not in found and (why := _check(launch, device, seed)):
            found[launch.op] = f"{launch}: {why}"
    return found
