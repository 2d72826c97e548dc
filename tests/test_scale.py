"""The scale levers: activation checkpointing, compile modes and recompiles, per-block compile under
FSDP, --profile traces, --float8 (its refusals here; its numerics where a capable GPU is)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist

from conftest import read_metrics, run_main, run_train, tiny_args, train_refuses
from fastpt import float8, train
from fastpt.config import PRESETS
from fastpt.data.dataset import Windows, find_shards
from fastpt.distributed import Dist, parallelize
from fastpt.evaluate import evaluate
from fastpt.model import Transformer
from fastpt.plan.memory import MemoryTrace
from fastpt.profiling import compiled_graphs

SMALL = dataclasses.replace(PRESETS["tiny"], vocab_size=64, dim=32, n_heads=2, ffn_dim=64, n_layers=4, max_seq_len=16)


def model_of(ac: str, compile: bool = False, cfg=SMALL) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg, "torch", activation_checkpointing=ac)
    if compile:
        model.compile(dynamic=False)
    return model


def train_steps(model: Transformer, steps: int = 3) -> tuple[list[float], dict, int]:
    """`steps` AdamW steps on fixed batches: the losses, the last step's gradients, and the bytes
    the last forward left alive for its backward (what activation checkpointing is meant to shrink):
    eager, the storages its ops made that outlive it (selective checkpointing keeps its outputs apart
    from autograd's saved tensors); compiled, what the graph saves for its backward (Inductor's
    buffers are no dispatched ops)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(
        0, SMALL.vocab_size, (steps, 2, SMALL.max_seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    losses, saved = [], [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    compiled = model._compiled_call_impl is not None
    for batch in data:
        optimizer.zero_grad()
        saved[0] = 0
        with MemoryTrace() as mem, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mem.add([*model.parameters(), *model.buffers()], "parameters")
            _, loss, _ = model(batch[:, :-1], labels=batch[:, 1:])
        kept = saved[0] if compiled else sum(life.nbytes for life in forward_made(mem, mem.event))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, kept


def forward_made(mem: MemoryTrace, event: int) -> list:
    """The storages the forward's ops made (not the parameters' views) that are alive at `event`."""
    return [life for life in mem.lives if life.phase == "forward" and life.alive_at(event)]


def assert_same_training(got, want) -> None:
    losses, grads = got[0], got[1]
    assert losses == pytest.approx(want[0], rel=1e-6)
    for name, g in grads.items():
        assert (g - want[1][name]).norm() <= 1e-6 * want[1][name].norm(), name


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_activation_checkpointing_same_losses_and_gradients_less_saved(compile):
    """The same training under each policy, keeping less: full less than selective, selective less
    than none (compiled: on 2 blocks, half the graph Inductor builds for 4)."""
    cfg = dataclasses.replace(SMALL, n_layers=2) if compile else SMALL
    none, full, selective = (train_steps(model_of(ac, compile, cfg)) for ac in ("none", "full", "selective"))
    assert_same_training(full, none)
    assert_same_training(selective, none)
    assert full[2] < selective[2] < none[2]  # bytes kept for the backward
    if not compile:  # eager keeps each block's activations, so the saving is most of them
        assert full[2] < 0.3 * none[2]


def test_selective_keeps_matmul_and_attention_outputs_and_recomputes_the_rest():
    """Every block checkpointed by the op policy: its forward keeps attention's output (and its
    logsumexp) and every other matmul's (a SwiGLU block's 1st, 3rd, 5th and 7th) and no pointwise result; the recompute
    in the backward makes only what was not kept."""
    from fastpt.checkpointing import KEPT_OPS

    model = model_of("selective")
    assert {b.checkpointing for b in model.layers} == {"selective"}
    x = torch.randint(0, SMALL.vocab_size, (2, SMALL.max_seq_len))
    with MemoryTrace() as mem:
        mem.add([*model.parameters(), *model.buffers()], "parameters")
        loss = model(x, labels=x).loss
        forward_end = mem.event
        loss.backward()
    kept = [life.op for life in forward_made(mem, forward_end)]
    per_block = {op: kept.count(op) / SMALL.n_layers for op in set(kept) if any(op == str(k) for k in KEPT_OPS)}
    assert per_block == {"aten.mm.default": 4, "aten._scaled_dot_product_flash_attention_for_cpu.default": 2}
    recomputed = [life.op for life in mem.lives if life.phase == "backward" and life.born >= forward_end]
    assert recomputed.count("aten.mm.default") >= 3 * SMALL.n_layers  # the other matmuls, then the gradients'
    assert "aten.silu.default" not in kept and kept.count("aten.rsqrt.default") == 1  # the final norm's alone
    assert not any(b.checkpointing != "none" for b in model_of("none").layers)
    with pytest.raises(ValueError, match="activation_checkpointing must be one of none, full, selective"):
        model_of("some")


def test_fsdp_compiles_each_block_and_one_process_the_whole_model(tmp_path):
    whole = parallelize(model_of("none"), Dist(), "fsdp", torch.float32, "default")
    assert whole._compiled_call_impl is not None
    assert all(b._compiled_call_impl is None for b in whole.layers)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:  # one real rank stands in for two: only the path parallelize takes is under test
        sharded = parallelize(model_of("full"), Dist(world_size=2), "fsdp", torch.float32, "default")
        assert sharded._compiled_call_impl is None
        assert all(b._compiled_call_impl is not None for b in sharded.layers)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--profile", "3"], "'profile' = '3' is not START:END (steps, e.g. 3:5)"),
        (["--profile", "a:b"], "'profile' = 'a:b' is not START:END"),
        (["--profile=-1:3"], "'profile' = '-1:3' is not START:END"),
        (["--profile", "0:2"], "'profile' = '0:2' must satisfy 1 <= START <= END <= max_steps (10)"),
        (["--profile", "5:3"], "'profile' = '5:3' must satisfy"),
        (["--profile", "3:11"], "'profile' = '3:11' must satisfy"),
        (["--compile-mode", "reduce-overhead"], "'compile_mode' = 'reduce-overhead' needs --compile"),
        (
            ["--compile", "--compile-mode", "max-autotune", "--grad-accum", "2"],
            "'compile_mode' = 'max-autotune' (CUDA graphs) needs 'grad_accum' = 1, got 2: raise micro_batch instead",
        ),
        (["--compile", "--compile-mode", "fast"], "'compile_mode' = 'fast' is not one of 'default'"),
        (["--activation-checkpointing", "half"], "'activation_checkpointing' = 'half' is not one of 'none'"),
        (["--float8"], "'float8' needs a CUDA GPU with compute capability >= 8.9 (got cpu)"),
        (["--parallel", "fsdp", "--dtype", "fp16"], "'parallel' = 'fsdp' supports bf16 and fp32, not fp16"),
    ],
)
def test_bad_lever_settings_are_one_line(tiny_data, tmp_path, capsys, extra, expected):
    train_refuses(capsys, tiny_args(tiny_data, tmp_path, *extra, max_steps=10), expected)


def test_float8_converts_the_blocks_linears_only():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    cfg = dataclasses.replace(SMALL, ffn_dim=72, tie_embeddings=False)  # 72: not a multiple of 16
    model = model_of("none", cfg=cfg)
    assert float8.convert(model) == 4 * cfg.n_layers
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert {f"layers.0.attention.{w}" for w in ("wq", "wk", "wv", "wo")} <= converted
    assert not any(n.startswith("output") or "feed_forward" in n for n in converted)  # the head; ffn 72
    assert model.state_dict().keys() == model_of("none", cfg=cfg).state_dict().keys()  # checkpoints unchanged


def test_profile_writes_a_trace_with_the_step_annotations(tiny_data, tmp_path, capsys):
    args = tiny_args(tiny_data, tmp_path, max_steps=6, log_every=2, eval_every=100, profile="3:5")
    code, _, err = run_main(train.main, args, capsys)
    assert code == 0, err
    (trace,) = (tmp_path / "profile").iterdir()
    assert trace.name == "rank0_steps3-5.pt.trace.json"
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    steps = {n for n in names if n and ("step " in n or n.startswith("ProfilerStep#"))}
    assert steps == {
        "fastpt step 3",
        "fastpt step 4",
        "fastpt step 5",
        "ProfilerStep#3",
        "ProfilerStep#4",
        "ProfilerStep#5",
    }
    assert "aten::mm" in names  # the ops themselves, with their shapes
    assert [r["recompiles"] for r in read_metrics(tmp_path)] == [0, 0, 0]


MODES_RUN = dict(n_layers=1, max_steps=4, log_every=2, eval_every=2, eval_tokens=192)


@pytest.fixture(scope="module")
def eager_records(tiny_data, tmp_path_factory) -> list[dict]:
    """The eager run every compile mode's run is compared with: one, not one per mode."""
    out = tmp_path_factory.mktemp("eager")
    eager = run_train(*tiny_args(tiny_data, out, **MODES_RUN))
    assert eager.returncode == 0, eager.stderr
    return read_metrics(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"])
def test_each_compile_mode_trains_without_recompiles(tiny_data, tmp_path, eager_records, mode):
    """Every mode compiles once and then never again, evals included (their last batch is partial:
    6 windows in batches of 4). CUDA graphs on a CPU: the run says in one line it goes without. One
    block: what is compiled per mode does not depend on the depth."""
    result = run_train(*tiny_args(tiny_data, tmp_path, "--compile", "--compile-mode", mode, **MODES_RUN), timeout=900)
    assert result.returncode == 0, result.stderr
    records = read_metrics(tmp_path)
    assert f"compile True{'' if mode == 'default' else f' ({mode})'}" in result.stdout
    assert [r["recompiles"] for r in records] == [0, 0] and "Recompiles: 0" in result.stdout
    skipped = "the compile mode asks for CUDA graphs, but torch.compile ran"
    assert (skipped in result.stderr) == (mode in ("reduce-overhead", "max-autotune")), result.stderr
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in eager_records], rel=1e-4)


@pytest.mark.slow
def test_evaluation_compiles_once_for_its_partial_batch(tiny_data):
    """eval's full and partial batches get a graph each on the first call, none on later calls."""
    cfg = train.resolve({"preset": "tiny", "seq_len": 32, "micro_batch": 4, "eval_tokens": 192}, None, "cpu")
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=257), "torch")
    model.compile(dynamic=False)
    windows = Windows(find_shards(tiny_data, "val"), 32)
    autocast = torch.autocast("cpu", enabled=False)
    first = evaluate(model, windows, cfg, torch.device("cpu"), autocast, Dist())  # {val_loss, val_bpb}
    graphs = compiled_graphs()
    assert evaluate(model, windows, cfg, torch.device("cpu"), autocast, Dist()) == first
    assert compiled_graphs() == graphs and math.isfinite(first["val_loss"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_and_profile_on_cuda(tiny_data, tmp_path):
    """reduce-overhead really replays CUDA graphs (none skipped, no recompiles, evals included), and
    --profile on CUDA writes the memory snapshot beside the trace."""
    on_cuda = dict(device="cuda", dtype="bf16", compile=True, compile_mode="reduce-overhead", profile="4:5")
    args = tiny_args(tiny_data, tmp_path, max_steps=6, log_every=2, eval_every=2, eval_tokens=192, **on_cuda)
    result = run_train(*args, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "without them" not in result.stderr
    assert [r["recompiles"] for r in read_metrics(tmp_path)] == [0, 0, 0]
    assert {p.name for p in (tmp_path / "profile").iterdir()} == {
        "rank0_steps4-5.pt.trace.json",
        "rank0_steps4-5.memory.pickle",
    }


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, torchao's compute_error."""
    return 20 * math.log10(ref.norm() / (ref - got).norm())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < float8.MIN_CAPABILITY,
    reason="needs a GPU with float8 tensor cores (compute capability >= 8.9)",
)
def test_float8_tracks_bf16():
    """20 steps from the same weights on the same batches: the float8 run's loss curve stays above the
    20 dB SQNR that torchao's own numerics tests require of float8 against bf16
    (test/float8/test_numerics_integration.py), every step within the bench's 2e-2 bf16 tolerance,
    and it falls as bf16's does (the sequences follow x -> 5x + 7 mod V, learnable in a few steps:
    bf16 on a CPU goes from 6.3 to 0.8). torchao emulating float8 on a CPU, 4 steps of 2 x 64: 63 dB, 0.13%."""
    pytest.importorskip("torchao.float8")
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=512, dim=256, n_heads=4, ffn_dim=768, max_seq_len=256)
    data = [torch.randint(0, cfg.vocab_size, (20, 8, 1), generator=torch.Generator().manual_seed(0))]
    for _ in range(cfg.max_seq_len):
        data.append((data[-1] * 5 + 7) % cfg.vocab_size)
    data = torch.cat(data, dim=-1).cuda()

    def losses(use_float8: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = Transformer(cfg).cuda()
        if use_float8:
            assert float8.convert(model) == 7 * cfg.n_layers
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for batch in data:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss, _ = model(batch[:, :-1], labels=batch[:, 1:])
            loss.backward()
            optimizer.step()
            out.append(loss.detach().float())
        return torch.stack(out).cpu()

    bf16, fp8 = losses(False), losses(True)
    assert sqnr_db(bf16, fp8) > 20
    torch.testing.assert_close(fp8, bf16, rtol=2e-2, atol=0)
    assert fp8[-1] < 0.5 * fp8[0]
