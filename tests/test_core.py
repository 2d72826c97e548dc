"""The core contracts: schedule, decay groups, presets, shards, loader, config and the loop."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import eager_and_compiled, read_metrics, run_main, run_train, tiny_args
from fastpt import train
from fastpt.config import PRESET_BATCH, PRESETS, TrainConfig, load_toml, resolve, to_toml
from fastpt.data.dataset import Windows
from fastpt.data.loader import TrainLoader
from fastpt.data.shards import read_shard, write_shard
from fastpt.errors import ConfigError, DataError
from fastpt.model import LogitsOutput, LossOutput, Transformer
from fastpt.optim import build_optimizer, lr_at, param_groups
from fastpt.presets import model_config


def seed_lr(step, peak_lr, n_warmup, n_total, min_ratio=0.1):
    """The appendix's formula, transcribed as written (D.1)."""
    if step < n_warmup:
        return peak_lr * step / max(1, n_warmup)
    progress = (step - n_warmup) / max(1, n_total - n_warmup)
    progress = min(1.0, progress)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak_lr * (min_ratio + (1 - min_ratio) * cosine)


def test_lr_at_is_the_seed_formula_at_every_step():
    for step in range(0, 10_200):
        assert lr_at(step, 5e-4, 500, 10_000) == seed_lr(step, 5e-4, 500, 10_000)
    assert lr_at(0, 5e-4, 500, 10_000) == 0.0
    assert lr_at(500, 5e-4, 500, 10_000) == pytest.approx(5e-4)
    assert lr_at(10_000, 5e-4, 500, 10_000) == pytest.approx(5e-5)
    assert lr_at(12_345, 5e-4, 500, 10_000) == pytest.approx(5e-5)


def small_model(vocab=97) -> Transformer:
    import dataclasses

    return Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=vocab))


def names_in(model: nn.Module, group: dict) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_param_groups_ndim_rule_decays_every_matrix_and_no_vector():
    model = small_model()
    decay, no_decay = param_groups(model, 0.1, "ndim")
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert "tok_embeddings.weight" in names_in(model, decay)
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert "norm.weight" in names_in(model, no_decay)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_param_groups_strict_rule_spares_bias_norm_and_embedding():
    model = nn.ModuleDict(
        {"emb": nn.Embedding(10, 4), "proj": nn.Linear(4, 4, bias=True), "norm_like": nn.Linear(4, 4, bias=False)}
    )
    decay, no_decay = param_groups(model, 0.1, "strict")
    assert names_in(model, decay) == {"proj.weight"}
    assert names_in(model, no_decay) == {"emb.weight", "proj.bias", "norm_like.weight"}
    model.proj.weight.requires_grad_(False)
    decay, _ = param_groups(model, 0.1, "strict")
    assert decay["params"] == []
    with pytest.raises(ValueError, match="decay rule"):
        param_groups(model, 0.1, "bogus")


def test_optimizer_is_fused_adamw_with_seed_hyperparameters():
    opt = build_optimizer(small_model(), 0.1, "ndim", 5e-4, (0.9, 0.95), 1e-8)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["fused"] and opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


def test_0_04b_preset_has_42m_parameters_and_tied_head():
    model = Transformer(PRESETS["0.04b"])
    assert 42.0e6 < model.num_params() < 42.2e6
    assert model.output_weight is model.tok_embeddings.weight
    n = model.num_params()
    assert model.cfg.flops_per_token(1024) == 6 * n + 6 * 8 * 512 * 1024  # causal attention: half of 12 L d T


def test_an_untied_input_embedding_is_a_lookup_not_model_flops():
    """Untying adds a (V, C) lookup table, not a matmul: the same model FLOPs per token as tied."""
    tied = PRESETS["0.04b"]
    untied = dataclasses.replace(tied, tie_embeddings=False)
    assert untied.num_params() == tied.num_params() + 32000 * 512
    assert untied.flops_per_token(1024) == tied.flops_per_token(1024)


def test_model_returns_named_outputs_that_unpack_as_the_seed_loop_does_and_ignores_minus_100():
    torch.manual_seed(0)
    model = small_model()
    x = torch.randint(0, 97, (2, 16))
    y = x.clone()
    out = model(x, labels=y)
    assert isinstance(out, LossOutput) and out.logits is None and out.loss.shape == ()
    assert out.z_loss == 0 and torch.equal(out.cross_entropy, out.loss.detach())  # no z-loss: the loss itself
    _, loss, _ = model(x, labels=y)  # the seed loop's line
    assert torch.equal(loss, out.loss)
    y_masked = y.clone()
    y_masked[:, 8:] = -100
    decoded = model(x)
    assert isinstance(decoded, LogitsOutput) and decoded.cache is None and decoded.logits.shape == (2, 16, 97)
    expected = nn.functional.cross_entropy(decoded.logits[:, :8].reshape(-1, 97), y[:, :8].reshape(-1))
    torch.testing.assert_close(model(x, labels=y_masked).loss, expected)
    z_model = Transformer(model.cfg, z_loss=0.01)
    z_model.load_state_dict(model.state_dict())
    z_out = z_model(x, labels=y)
    assert z_out.z_loss > 0 and not z_out.z_loss.requires_grad
    torch.testing.assert_close(z_out.cross_entropy, out.loss.detach())  # the z part comes out exactly
    torch.testing.assert_close(z_out.loss, out.loss + z_out.z_loss)


def test_kv_cache_decoding_matches_full_forward():
    torch.manual_seed(0)
    model = small_model()
    x = torch.randint(0, 97, (1, 12))
    full = model(x).logits
    cache = model(x[:, :7], kv_cache=[]).cache
    for t in range(7, 12):
        logits, _, cache = model(x[:, t : t + 1], kv_cache=cache)  # unpacks positionally too
        torch.testing.assert_close(logits[:, -1], full[:, t], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("wide", [False, True])
def test_shard_round_trip(tmp_path, wide):
    tokens = np.random.default_rng(0).integers(0, 70_000 if wide else 50_257, size=1000)
    path = write_shard(tmp_path / "train_000000.bin", tokens, vocab_size=70_000 if wide else 50_257)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:4]) == ([20240801, 7] if wide else [20240520, 1]) + [1000, 70_000 if wide else 50_257]
    view = read_shard(path)
    assert isinstance(view, np.memmap)
    np.testing.assert_array_equal(view, tokens)


def test_reads_llmc_written_shard_and_headerless_nanogpt(tmp_path):
    tokens = np.arange(2000, dtype=np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, len(tokens))  # llm.c leaves header[3] zero
    (tmp_path / "llmc.bin").write_bytes(header.tobytes() + tokens.tobytes())
    np.testing.assert_array_equal(read_shard(tmp_path / "llmc.bin"), tokens)
    (tmp_path / "train.bin").write_bytes(tokens.tobytes())
    np.testing.assert_array_equal(read_shard(tmp_path / "train.bin", headerless=True), tokens)
    with pytest.raises(DataError, match="train.bin: bad magic"):
        read_shard(tmp_path / "train.bin")


def make_windows(tmp_path, n_tokens=10_000, seq_len=15) -> Windows:
    a = write_shard(tmp_path / "train_000000.bin", np.arange(n_tokens) % 1000)
    b = write_shard(tmp_path / "train_000001.bin", np.arange(n_tokens // 3) % 1000)
    return Windows([a, b], seq_len)


def take(loader: TrainLoader, n: int) -> list[torch.Tensor]:
    return [loader.next().x.clone() for _ in range(n)]


def test_loader_windows_cover_each_epoch_once_and_are_seeded(tmp_path):
    windows = make_windows(tmp_path)
    cpu = torch.device("cpu")
    loader = TrainLoader(windows, 5, seed=1, device=cpu)
    batch = loader.next()
    torch.testing.assert_close(batch.y[:, :-1], batch.x[:, 1:])
    loader = TrainLoader(windows, 1, seed=1, device=cpu)
    starts = [int(b[0, 0]) for b in take(loader, len(windows))]
    all_starts = [int(windows.gather(np.array([i]))[0, 0]) for i in range(len(windows))]
    assert sorted(starts) == sorted(all_starts) and starts != all_starts  # a permutation, not in order
    assert loader.epoch == 1
    same = [b for b in take(TrainLoader(windows, 4, seed=7, device=cpu), 6)]
    again = [b for b in take(TrainLoader(windows, 4, seed=7, device=cpu), 6)]
    other = [b for b in take(TrainLoader(windows, 4, seed=8, device=cpu), 6)]
    assert all(torch.equal(a, b) for a, b in zip(same, again))
    assert not all(torch.equal(a, b) for a, b in zip(same, other))


def test_loader_state_round_trip_and_split_invariance(tmp_path):
    windows = make_windows(tmp_path)
    cpu = torch.device("cpu")
    reference = take(TrainLoader(windows, 4, seed=3, device=cpu), 200)  # crosses an epoch boundary
    first = TrainLoader(windows, 4, seed=3, device=cpu)
    take(first, 120)
    state = first.state_dict()
    first.close()
    resumed = TrainLoader(windows, 4, seed=0, device=cpu)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 80), reference[120:]))
    # micro-batch 2 sees the same windows, in the same order, as micro-batch 4
    halves = take(TrainLoader(windows, 2, seed=3, device=cpu), 20)
    assert torch.equal(torch.cat(halves), torch.cat(reference[:10]))
    # two ranks of micro-batch 2 together see what one rank of micro-batch 4 sees
    ranks = [take(TrainLoader(windows, 2, seed=3, device=cpu, rank=r, world_size=2), 10) for r in (0, 1)]
    interleaved = torch.cat([torch.cat((a, b)) for a, b in zip(*ranks)])
    assert torch.equal(interleaved, torch.cat(reference[:10]))


def test_loader_raises_the_producer_error_instead_of_waiting(tmp_path, monkeypatch):
    windows = make_windows(tmp_path)
    gather = windows.gather
    calls = []

    def failing_gather(indices):
        calls.append(indices)
        if len(calls) == 3:
            raise OSError("Input/output error")
        return gather(indices)

    monkeypatch.setattr(windows, "gather", failing_gather)
    loader = TrainLoader(windows, 4, seed=0, device=torch.device("cpu"))
    take(loader, 2)
    with pytest.raises(OSError, match="Input/output error"):
        loader.next()
    loader.close()


def test_config_precedence_file_errors_and_round_trip(tmp_path):
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('lr = 1e-3\nmax_steps = 50\npreset = "tiny"\n')
    cfg = resolve({"lr": 2e-3}, str(cfg_file), "cuda")
    assert (cfg.lr, cfg.max_steps, cfg.preset) == (2e-3, 50, "tiny")
    assert (cfg.micro_batch, cfg.grad_accum) == PRESET_BATCH["tiny"]  # the preset's batch, unless given
    assert resolve({"preset": "1b", "grad_accum": 3}, None, "cuda").grad_accum == 3
    assert cfg.warmup_steps == 5  # the default 500 adapts to a 50-step run
    assert resolve({}, None, "cuda") == TrainConfig(device="cuda")  # the seed's defaults on a GPU
    assert resolve({}, None, "cpu").preset == "tiny"
    assert model_config(TrainConfig(), 50257).vocab_size == 50257  # FineWeb's GPT-2 ids widen 0.04b
    assert model_config(TrainConfig(), 4096).vocab_size == 32000
    assert model_config(TrainConfig(preset="tiny", seq_len=512), 300).max_seq_len == 512
    (tmp_path / "again.toml").write_text(to_toml(cfg))
    assert TrainConfig(**load_toml(str(tmp_path / "again.toml"))) == cfg
    cfg_file.write_text("learning_rate = 1e-3\n")
    with pytest.raises(ConfigError, match="unknown config key 'learning_rate'"):
        resolve({}, str(cfg_file), "cpu")
    with pytest.raises(ConfigError, match="'dtype' = 'fp8'"):
        resolve({"dtype": "fp8"}, None, "cpu")
    with pytest.raises(ConfigError, match="'warmup_steps' \\(600\\)"):
        resolve({"warmup_steps": 600, "max_steps": 100}, None, "cpu")
    # a contradiction between two keys is the config's to refuse, not the distributed layer's
    with pytest.raises(ConfigError, match="'compile_mode' = 'reduce-overhead' uses CUDA graphs, which FSDP"):
        resolve({"parallel": "fsdp", "compile": True, "compile_mode": "reduce-overhead", "grad_accum": 1}, None, "cuda")


def test_micro_batch_times_accum_gives_the_same_losses(tiny_data, tmp_path, capsys):
    for name, micro_batch, accum in (("a", "8", "1"), ("b", "2", "4")):
        args = tiny_args(tiny_data, tmp_path / name, max_steps=4, log_every=1, eval_every=100)
        code, _, err = run_main(train.main, args + ["--micro-batch", micro_batch, "--grad-accum", accum], capsys)
        assert code == 0, err
    a, b = [r["loss"] for r in read_metrics(tmp_path / "a")], [r["loss"] for r in read_metrics(tmp_path / "b")]
    assert len(a) == 4
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_tiny_run_on_real_text_learns_and_writes_its_run_dir(bpe_data, tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_args(
        bpe_data, out, max_steps=60, seq_len=64, micro_batch=8, lr="3e-3", warmup_steps=10, eval_every=30, log_every=10
    )
    code, stdout, err = run_main(train.main, args, capsys)
    assert code == 0, err
    assert "Step    60/60 | Loss:" in stdout and "tok/s" in stdout
    losses = [r["loss"] for r in read_metrics(out)]
    assert losses[-1] < losses[0] - 0.5 and losses[-1] < math.log(512) - 0.8, losses
    records = read_metrics(out)
    assert {"step", "loss", "lr", "tok_s", "grad_norm", "peak_mem_gib"} <= set(records[-1])
    assert (out / "config.toml").is_file() and (out / "ckpt_00000060.pt").is_file()
    val = [line for line in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert len(val) == 2


def test_checkpoint_resume_continues_at_the_right_step(tiny_data, tmp_path, capsys):
    common = tiny_args(tiny_data, tmp_path, log_every=1, eval_every=100)
    code, _, err = run_main(train.main, common + ["--max-steps", "4", "--ckpt-every", "2"], capsys)
    assert code == 0, err
    ckpt = torch.load(tmp_path / "ckpt_00000004.pt", weights_only=True)  # nothing but tensors and plain values
    assert ckpt["train_state"]["step"] == 4 and "step" not in ckpt and ckpt["optimizer"]["state"]
    assert not any(k.startswith("_orig_mod.") for k in ckpt["model"])
    code, out, err = run_main(train.main, common + ["--max-steps", "6", "--resume"], capsys)
    assert code == 0, err
    assert "resumed from" in out and "at step 4" in out
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_run_with_kernels_resumes(tiny_data, tmp_path):
    """The loop's CUDA path (bf16 autocast, Triton kernels, pinned batches, eval) and a resume from
    a checkpoint loaded onto the GPU (its RNG state comes back as CUDA tensors)."""
    common = tiny_args(tiny_data, tmp_path, device="cuda", dtype="bf16", kernels="triton", log_every=1)
    first = run_train(*common, "--max-steps", "2")
    assert first.returncode == 0, first.stderr
    resumed = run_train(*common, "--max-steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 2" in resumed.stdout
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in records)


@pytest.mark.slow
def test_eager_and_compiled_losses_agree(tiny_data, tmp_path):
    """On one block, not the tiny preset's two: what is compared does not depend on the depth."""
    compiled, records, eager = eager_and_compiled(
        tiny_data, tmp_path, n_layers=1, max_steps=3, log_every=1, eval_every=100
    )
    assert "compile True" in compiled.stdout
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in eager], rtol=1e-4)


def test_z_loss_is_trained_on_and_logged_apart(tiny_data, tmp_path, capsys):
    """--z-loss 0 is the plain loss; --z-loss c logs the cross-entropy as `loss` (step 1, before any
    update, equals the plain run's) and c * logsumexp^2 as `z_loss` (near c * ln(V)^2 at init)."""
    for z in ("0", "0.01"):
        args = tiny_args(tiny_data, tmp_path / z, max_steps=3, log_every=1, eval_every=100, z_loss=z)
        code, out, err = run_main(train.main, args, capsys)
        assert code == 0, err
    plain, z = read_metrics(tmp_path / "0"), read_metrics(tmp_path / "0.01")
    assert "z_loss" not in plain[0] and "| Z: " in out
    assert z[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert 0.01 * math.log(257) ** 2 * 0.9 < z[0]["z_loss"] < 0.01 * math.log(257) ** 2 * 1.1
    assert z[-1]["loss"] != plain[-1]["loss"]  # the z term changed the updates
