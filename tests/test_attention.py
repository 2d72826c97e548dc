"""--attention document: a token sees only earlier tokens of its own document. Isolation and
one-document equality on both mask kinds (the dense SDPA mask the CPU trains with, the FlexAttention
BlockMask CUDA trains with, run here forward-only: FlexAttention has no CPU backward), eager and
compiled; the training loop's hooks; and the one-line refusal for data without a document token.
(Under FSDP, and with Muon under DDP: tests/test_distributed.py.)"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import pytest
import torch

from conftest import eager_and_compiled, read_metrics, run_main, run_train, tiny_args, train_refuses
from fastpt import attention, train
from fastpt import model as model_module
from fastpt.config import ModelConfig
from fastpt.errors import ConfigError
from fastpt.model import Transformer

DOC = 7  # the document token of these tests' made-up vocabulary
CFG = ModelConfig(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    max_seq_len=64,
    attention="document",
    doc_token=DOC,
)


def tokens(*lengths: int, seed: int = 0) -> torch.Tensor:
    """One row of documents of these lengths, each starting with DOC, other ids random (never DOC)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in lengths:
        body = torch.randint(8, CFG.vocab_size, (n - 1,), generator=g)
        parts.append(torch.cat((torch.tensor([DOC]), body)))
    return torch.cat(parts)


def models(cfg: ModelConfig = CFG) -> tuple[Transformer, Transformer]:
    """The same weights with document and with causal attention."""
    torch.manual_seed(0)
    doc = Transformer(cfg).eval()
    causal = Transformer(dataclasses.replace(cfg, attention="causal", doc_token=None)).eval()
    causal.load_state_dict(doc.state_dict())
    return doc, causal


# FlexAttention runs eagerly here, on purpose: forward only, on the CPU, to check its masks (training
# on a CPU takes the dense mask; on CUDA it is compiled).
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")


@pytest.fixture
def eager_block_mask(monkeypatch):
    """BlockMasks built by create_block_mask run eagerly: at these 64-token rows its dense
    intermediate is tiny, and no compile (the compiled builder, which a long row needs, is
    test_a_block_mask_built_outside_a_compiled_graph_allocates_no_dense_mask's)."""
    monkeypatch.setattr(attention, "_standalone_block_mask", lambda: attention.create_block_mask)


@pytest.fixture(params=["dense", "flex"])
def mask_kind(request, monkeypatch, eager_block_mask):
    """Run the model with either mask (flex forced here on the CPU, forward only)."""
    if request.param == "flex":
        monkeypatch.setattr(model_module, "document_mask", functools.partial(attention.document_mask, flex=True))
    return request.param


def test_document_ids_and_dense_mask_by_hand():
    idx = torch.tensor([[3, DOC, 4, 5, DOC, 6]])
    assert attention.document_ids(idx, DOC).tolist() == [[0, 1, 1, 1, 2, 2]]
    allowed = attention.document_mask(idx, DOC, flex=False)[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]


@torch.no_grad()
def test_flex_block_mask_attends_as_the_dense_mask(eager_block_mask):
    idx = torch.stack((tokens(5, 40, 19), tokens(64, seed=1), tokens(1, 1, 62, seed=2)))  # (3, 64)
    q, k, v = (torch.randn(3, 4, 64, 16) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped-query: 2 kv heads
    dense = attention.attend(q, k, v, attention.document_mask(idx, DOC, flex=False), enable_gqa=True)
    flex = attention.attend(q, k, v, attention.document_mask(idx, DOC, flex=True), enable_gqa=True)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_later_document_does_not_see_an_earlier_one(mask_kind):
    doc_model, causal = models()
    first, later = tokens(24, seed=1), tokens(40, seed=2)
    other_first = tokens(24, seed=3)  # the same length: the later document keeps its positions
    row_a, row_b = torch.cat((first, later))[None], torch.cat((other_first, later))[None]  # (1, 64)
    logits_a, logits_b = doc_model(row_a)[0], doc_model(row_b)[0]  # (1, 64, V)
    assert torch.equal(logits_a[:, 24:], logits_b[:, 24:])
    assert not torch.equal(logits_a[:, :24], logits_b[:, :24])
    # With the causal mask the earlier document does leak into the later one.
    assert not torch.allclose(causal(row_a)[0][:, 24:], causal(row_b)[0][:, 24:])


@torch.no_grad()
def test_a_row_of_one_document_gives_the_causal_result(mask_kind):
    doc_model, causal = models()
    rows = torch.stack((tokens(64, seed=4), tokens(64, seed=5)))  # (2, 64)
    rows[1, 0] = 9  # a row cut mid-document: no document token at all
    torch.testing.assert_close(doc_model(rows)[0], causal(rows)[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_decoding_with_a_kv_cache_attends_causally():
    """Sampling (prefill + one token with the cache) is a standard Llama's, whatever the training mask."""
    doc_model, causal = models()
    prompt = tokens(5, 10, seed=6)[None]  # two documents: the cache path ignores the boundary

    def decode(m: Transformer) -> torch.Tensor:
        _, _, cache = m(prompt, kv_cache=[])
        return m(prompt[:, -1:], kv_cache=cache)[0]

    torch.testing.assert_close(decode(doc_model), decode(causal))


def test_model_config_refuses_document_attention_without_a_token():
    with pytest.raises(ConfigError, match="doc_token None"):
        Transformer(dataclasses.replace(CFG, doc_token=None))
    with pytest.raises(ConfigError, match="doc_token 64"):
        Transformer(dataclasses.replace(CFG, doc_token=64))
    with pytest.raises(ConfigError, match="'attention' = 'sliding'"):
        Transformer(dataclasses.replace(CFG, attention="sliding"))


def test_document_attention_on_data_without_a_document_token_is_one_line(tiny_data, tmp_path, capsys):
    bare = tmp_path / "no-meta"
    bare.mkdir()
    for shard in tiny_data.glob("*.bin"):  # llm.c-style shards alone: no meta.json, no eot_id
        shutil.copy(shard, bare / shard.name)
    train_refuses(
        capsys,
        tiny_args(bare, tmp_path / "run", attention="document"),
        "'attention' = 'document'",
        str(bare),
    )


def test_training_with_document_attention_records_the_token(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_args(tiny_data, out, max_steps=4, log_every=2, eval_every=4, eval_tokens=256, attention="document")
    code, _, err = run_main(train.main, args, capsys)
    assert code == 0, err
    from fastpt import checkpoint

    saved = checkpoint.load(checkpoint.latest(out))["model_config"]
    eot = json.loads((tiny_data / "meta.json").read_text())["eot_id"]
    assert (saved["attention"], saved["doc_token"]) == ("document", eot)
    assert all(r["loss"] == r["loss"] for r in read_metrics(out))  # finite, not NaN


@pytest.mark.slow
@torch.no_grad()
def test_compiled_document_attention_isolates_documents_without_recompiling(mask_kind):
    """torch.compile(fullgraph=True): new document layouts in every batch, one graph for all (on one
    block: the mask a block sees does not depend on the depth)."""
    import torch._dynamo

    doc_model, _ = models(dataclasses.replace(CFG, n_layers=1))
    compiled = torch.compile(doc_model, fullgraph=True, dynamic=False)
    later = tokens(40, seed=2)
    batches = [
        torch.stack((torch.cat((tokens(24, seed=s), later)), tokens(10, 30, 24, seed=s + 50))) for s in range(3)
    ]  # (2, 64) each, the documents elsewhere in every batch
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs = [compiled(b)[0] for b in batches]
    for b, out in zip(batches, outs):
        torch.testing.assert_close(out, doc_model(b)[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[0][0, 24:], outs[1][0, 24:]) and torch.equal(outs[1][0, 24:], outs[2][0, 24:])


@pytest.mark.slow
def test_compiled_training_with_document_attention_follows_eager_without_recompiles(tiny_data, tmp_path):
    """The loop under --compile: one graph for every batch's document layout (evals' too), the eager
    losses. One block: the mask is the same in every block."""
    _, records, eager = eager_and_compiled(
        tiny_data, tmp_path, n_layers=1, max_steps=4, log_every=2, eval_every=2, eval_tokens=192, attention="document"
    )
    assert [r["recompiles"] for r in records] == [0, 0]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in eager], rel=1e-4)


def test_export_is_the_standard_llama_whatever_the_training_mask():
    from fastpt.hf import to_hf_config

    causal = dataclasses.replace(CFG, attention="causal", doc_token=None)
    assert to_hf_config(CFG, torch.float32, DOC, DOC) == to_hf_config(causal, torch.float32, DOC, DOC)


def test_the_data_folders_document_token(tiny_data, tmp_path):
    from fastpt.data.dataset import doc_token
    from fastpt.errors import DataError

    assert doc_token(tiny_data, "x") == json.loads((tiny_data / "meta.json").read_text())["eot_id"] == 256
    for meta in (None, '{"eot_id": null}', '{"eot_id": "256"}'):  # no meta.json, a tokenizer without one, a string
        if meta:
            (tmp_path / "meta.json").write_text(meta)
        with pytest.raises(DataError, match=f"'attention' = 'document' needs .* {tmp_path} has none"):
            doc_token(tmp_path, "'attention' = 'document'")


def test_activation_checkpointing_recomputes_the_same_document_attention():
    """The mask goes through torch.utils.checkpoint: the recomputed blocks give the same gradients."""
    grads = []
    for ac in ("none", "full"):
        torch.manual_seed(0)
        m = Transformer(CFG, activation_checkpointing=ac).train()
        rows = torch.stack((torch.cat((tokens(24, seed=1), tokens(40, seed=2))), tokens(10, 54, seed=3)))
        m(rows, labels=rows.roll(-1, 1))[1].backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.slow  # ~30 s of Triton's interpreter; the fast twins: test_kernels.py's trained losses, and above
def test_document_attention_trains_alike_on_the_triton_kernels(tiny_data, tmp_path, capsys):
    """--kernels triton (RMSNorm and the fused loss through Triton's interpreter on this CPU, in a
    process of its own: triton.jit reads TRITON_INTERPRET at import) beside the document mask: the
    same losses as the PyTorch reference kernels."""
    flags = dict(max_steps=3, log_every=1, eval_every=3, eval_tokens=128, attention="document")
    triton = run_train(
        *tiny_args(tiny_data, tmp_path / "triton", kernels="triton", **flags), env={"TRITON_INTERPRET": "1"}
    )
    assert triton.returncode == 0, triton.stderr
    code, _, err = run_main(train.main, tiny_args(tiny_data, tmp_path / "torch", kernels="torch", **flags), capsys)
    assert code == 0, err
    losses = [[r["loss"] for r in read_metrics(tmp_path / kind)] for kind in ("triton", "torch")]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-4)


def layouts(n: int) -> list[torch.Tensor]:
    """n batches (2, 64), each with other documents in other places (batch s: s + 1 and s + 2 of them)."""
    rows = [(*[7] * s, 64 - 7 * s) for s in range(n)], [(*[5 + s] * (s + 1), 64 - (5 + s) * (s + 1)) for s in range(n)]
    return [torch.stack((tokens(*a, seed=s), tokens(*b, seed=s + 9))) for s, (a, b) in enumerate(zip(*rows))]


def test_a_block_mask_built_outside_a_compiled_graph_allocates_no_dense_mask():
    """An eager model or blocks compiled one by one (FSDP) build the BlockMask outside a compiled
    graph: it is built by compiled code all the same, so no (B, T, T) tensor is ever allocated."""
    from torch.profiler import ProfilerActivity, profile

    B, T = 2, 1024
    idx = torch.randint(8, CFG.vocab_size, (B, T))
    idx[:, ::100] = DOC
    attention.document_mask(idx, DOC, flex=True)  # compiles the builder, once
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mask = attention.document_mask(idx, DOC, flex=True)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < B * T * T // 16, largest  # the block counts and indices, nothing of T x T
    dense = attention.document_mask(idx, DOC, flex=False)[:, 0]  # (B, T, T); the blocks any of it allows:
    assert torch.equal(mask.to_dense()[:, 0].bool(), dense.unflatten(1, (8, 128)).unflatten(3, (8, 128)).any((2, 4)))


COMPILE_CONFIGS = {  # how the trainer compiles (fastpt.distributed.compile_in_place)
    "compiled model": ("default", False),
    "per-block compiled (FSDP)": ("default", True),
    "reduce-overhead (CUDA graphs)": ("reduce-overhead", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", COMPILE_CONFIGS)
@torch.no_grad()
def test_block_masks_compile_once_for_every_document_layout(config, monkeypatch):
    """Batches with their documents in other places, through the BlockMask path (forward only on
    this CPU): not one recompile (of the mask's builder, the blocks or the model), and the dense
    mask's logits."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fastpt.distributed import compile_in_place

    mode, per_block = COMPILE_CONFIGS[config]
    doc_model, _ = models()
    dense = [doc_model(b)[0] for b in layouts(4)]
    monkeypatch.setattr(model_module, "document_mask", functools.partial(attention.document_mask, flex=True))
    compile_in_place(doc_model, mode, per_block)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        flex = [doc_model(b)[0] for b in layouts(4)]
    assert counters["stats"]["unique_graphs"] == (2 if per_block else 1)  # the builder and the blocks; the model
    for got, want in zip(flex, dense):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", COMPILE_CONFIGS)
def test_flex_document_attention_trains_on_cuda_without_recompiles(config, monkeypatch):
    """The GPU's training path (the BlockMask built by compiled code, FlexAttention forward and
    backward) over batches with other document layouts: no recompile, and the dense mask's losses
    and gradients."""
    import torch._dynamo

    from fastpt.distributed import compile_in_place

    mode, per_block = COMPILE_CONFIGS[config]
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(CFG, dim=128)).cuda()  # head_dim 32: FlexAttention's kernels want >= 16
    batches = [b.cuda() for b in layouts(4)]

    def losses_and_grads() -> list[tuple[float, list[torch.Tensor]]]:
        out = []
        for b in batches:
            model.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
            loss = model(b, labels=b.roll(-1, 1)).loss
            loss.backward()
            out.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
        return out

    monkeypatch.setattr(model_module, "document_mask", functools.partial(attention.document_mask, flex=False))
    dense = losses_and_grads()
    monkeypatch.undo()
    compile_in_place(model, mode, per_block)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        flex = losses_and_grads()
    for (flex_loss, flex_grads), (dense_loss, dense_grads) in zip(flex, dense):
        assert flex_loss == pytest.approx(dense_loss, rel=1e-4)
        for a, b in zip(flex_grads, dense_grads):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
