"""--optimizer muon: fastpt.muon.Muon for the blocks' matrices beside AdamW groups for the embedding,
the head and the norms, each at its own peak LR (nanochat's, scaled with width), Muon's momentum
warming up and its weight decay on the schedule; used by the loop, the GradScaler and checkpoints as
one optimizer; it trains, resumes bit for bit after SIGKILL, takes the config's settings after a
resume, and follows one process under DDP and FSDP (tests/test_distributed.py). Newton-Schulz
batches same-shape matrices (fp32 on a CPU) and matches torch.optim.Muon's bf16 one."""

from __future__ import annotations

import dataclasses
import signal

import pytest
import torch

from conftest import TINY, assert_resumes_exactly, read_metrics, records, run_args, run_main, train_refuses
from fastpt import checkpoint, train
from fastpt.config import PRESETS, TrainConfig
from fastpt.model import Transformer
from fastpt.muon import Muon, newton_schulz
from fastpt.optim import apply_schedule, is_muon_matrix, muon_momentum_at, optimizers_for, peak_lrs, step_all
from faults import run_faulty

MUON = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02)


def small_model(seed: int = 0, **shape) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=97, n_kv_heads=2, **shape))


def names(model: Transformer, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def groups_by_name(optimizers: list) -> dict[str, dict]:
    return {g["name"]: g for o in optimizers for g in o.param_groups}


def test_muon_takes_the_blocks_matrices_and_adamw_keeps_the_rest_in_named_groups():
    model = small_model()
    adamw, muon = optimizers_for(model, MUON)
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, Muon)
    matrices = names(model, muon.param_groups[0]["params"])
    assert matrices == {n for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2}
    assert {n.split(".")[-2] for n in matrices} == {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    head, plain = adamw.param_groups  # tied: the shared matrix is the head's group
    assert (head["name"], names(model, head["params"])) == ("head", {"tok_embeddings.weight"})
    assert plain["name"] == "lr" and all("norm" in n for n in names(model, plain["params"]))
    assert len(matrices) + len(head["params"]) + len(plain["params"]) == len(list(model.parameters()))  # each once
    assert muon.param_groups[0]["peak_lr"] == 0.02 and muon.param_groups[0]["momentum"] == 0.95
    seed = optimizers_for(model, TrainConfig())
    assert [type(o) for o in seed] == [torch.optim.AdamW]  # the seed's, unchanged
    assert [(g["weight_decay"], g["betas"], g["lr"]) for g in seed[0].param_groups] == [(0.1, (0.9, 0.95), 5e-4)] + [
        (0.0, (0.9, 0.95), 5e-4)
    ]
    untied = small_model(tie_embeddings=False)
    named = {g["name"]: names(untied, g["params"]) for g in optimizers_for(untied, MUON)[0].param_groups}
    assert named["embed"] == {"tok_embeddings.weight"} and named["head"] == {"output.weight"}
    assert not is_muon_matrix("output.weight", torch.zeros(3, 3))  # an untied head stays with AdamW


@pytest.mark.parametrize("dim", [64, 768])
def test_each_group_runs_at_its_own_peak_lr_on_the_schedule(dim):
    """nanochat's AdamW LRs beside Muon: embedding 0.2 (for its init std 1, so 0.2 x 0.02 at ours),
    head 0.004, times (dim / 768) ** -0.5; the norms at --lr, Muon at --muon-lr; betas (0.8, 0.95)
    for the embedding and head."""
    width = (dim / 768) ** -0.5
    cfg = dataclasses.replace(MUON, tie_embeddings=False)
    peaks = {"lr": 1e-3, "embed": 0.2 * 0.02 * width, "head": 0.004 * width, "muon": 0.02}
    assert peak_lrs(cfg, dim) == pytest.approx(peaks)
    assert peak_lrs(MUON, dim) == pytest.approx({"lr": 1e-3, "head": 0.004 * width, "muon": 0.02})  # tied
    assert peak_lrs(dataclasses.replace(cfg, embed_lr=0.05, head_lr=0.01), dim) == {
        "lr": 1e-3,
        "embed": 0.05,
        "head": 0.01,
        "muon": 0.02,
    }
    assert peak_lrs(TrainConfig(), dim) == {"lr": 5e-4}
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=97, dim=dim, n_heads=4, tie_embeddings=False))
    optimizers = optimizers_for(model, cfg)
    at = {"warmup": 5, "peak": 10, "end": cfg.max_steps}
    for step, fraction in ((at["warmup"], 5 / 500), (at["peak"], 10 / 500)):
        lrs = apply_schedule(optimizers, cfg, step)
        assert lrs == pytest.approx({k: v * fraction for k, v in peak_lrs(cfg, dim).items()}, rel=1e-12)
        assert {n: g["lr"] for n, g in groups_by_name(optimizers).items()} == lrs
    groups = groups_by_name(optimizers)
    assert groups["embed"]["betas"] == groups["head"]["betas"] == (0.8, 0.95) and groups["lr"]["betas"] == (0.9, 0.95)
    assert apply_schedule(optimizers, cfg, at["end"])["muon"] == pytest.approx(0.02 * 0.1)  # cosine's floor


def test_muons_momentum_warms_up_linearly_from_085():
    cfg = dataclasses.replace(MUON, muon_momentum=0.95, muon_momentum_warmup=300)
    for step, want in ((0, 0.85), (150, 0.90), (300, 0.95), (1000, 0.95)):
        assert muon_momentum_at(cfg, step) == pytest.approx(want, rel=1e-12)
    assert muon_momentum_at(dataclasses.replace(cfg, muon_momentum_warmup=0), 0) == 0.95  # off
    optimizers = optimizers_for(small_model(), cfg)
    apply_schedule(optimizers, cfg, 150)
    assert optimizers[1].param_groups[0]["momentum"] == pytest.approx(0.90)


def test_muon_weight_decay_shrinks_the_matrices_by_lr_times_it():
    """Decoupled: p <- p * (1 - lr * wd) - lr' * update, so two runs that differ only in the decay
    differ by lr * wd * p, with the schedule's lr of that step."""
    runs = {}
    for wd in (0.0, 0.5):
        model = small_model()
        cfg = dataclasses.replace(MUON, muon_weight_decay=wd, warmup_steps=10)
        optimizers = optimizers_for(model, cfg)
        before = model.layers[0].attention.wq.weight.detach().clone()
        lr = apply_schedule(optimizers, cfg, 5)["muon"]  # half-way up the warmup: 0.01
        steps(model, optimizers, torch.amp.GradScaler("cpu", enabled=False), 1)
        runs[wd] = model.layers[0].attention.wq.weight.detach()
    assert lr == pytest.approx(0.01)
    torch.testing.assert_close(runs[0.0] - runs[0.5], lr * 0.5 * before, rtol=1e-4, atol=1e-7)
    assert not torch.equal(runs[0.0], runs[0.5])


def loss_of(model: Transformer, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 97, (2, 16), generator=g)
    return model(x, labels=x.roll(-1, 1))[1]


def steps(model: Transformer, opts: list, scaler: torch.amp.GradScaler, n: int, start: int = 0) -> None:
    """The loop's step: every optimizer zeroed, unscaled and stepped through one GradScaler."""
    for i in range(start, start + n):
        for opt in opts:
            opt.zero_grad()
        scaler.scale(loss_of(model, i)).backward()
        for opt in opts:
            scaler.unscale_(opt)
        step_all(opts, scaler, torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        scaler.update()


def test_a_grad_scaler_steps_both_optimizers_as_unscaled_ones():
    """fp16's path (here on CPU fp32): a power-of-two scale is exact, so scaled steps equal plain ones,
    and a non-finite gradient anywhere skips the update of both optimizers."""
    plain, scaled = small_model(), small_model()
    steps(plain, optimizers_for(plain, MUON), torch.amp.GradScaler("cpu", enabled=False), 3)
    opt = optimizers_for(scaled, MUON)
    steps(scaled, opt, torch.amp.GradScaler("cpu", init_scale=2.0**12), 3)
    for (name, a), b in zip(plain.named_parameters(), scaled.parameters()):
        assert torch.equal(a, b), name
    before = {n: p.clone() for n, p in scaled.named_parameters()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for o in opt:
        o.zero_grad()
    scaler.scale(loss_of(scaled, 9)).backward()
    scaled.layers[0].attention.wq.weight.grad[0, 0] = float("inf")  # in a Muon parameter only
    for o in opt:
        scaler.unscale_(o)
    step_all(opt, scaler, torch.nn.utils.clip_grad_norm_(scaled.parameters(), 1.0))
    assert all(torch.equal(p, before[n]) for n, p in scaled.named_parameters())
    assert scaler.get_scale() == 2.0**12  # the update is yet to halve it: nothing stepped


def test_both_optimizers_state_round_trips_through_a_checkpoint(tmp_path):
    model = small_model()
    opt = optimizers_for(model, MUON)
    no_scaler = torch.amp.GradScaler("cpu", enabled=False)
    steps(model, opt, no_scaler, 2)
    model_state = checkpoint.ModelState(model).state_dict()
    optim_state = checkpoint.OptimizerState(model, opt).state_dict()
    assert any("momentum_buffer" in s for s in optim_state["state"].values())  # Muon's
    assert any("exp_avg_sq" in s for s in optim_state["state"].values())  # AdamW's
    torch.save({"model": model_state, "optimizer": optim_state}, tmp_path / "c.pt")
    restored = small_model(seed=1)
    restored_opt = optimizers_for(restored, MUON)
    saved = torch.load(tmp_path / "c.pt", weights_only=True)
    checkpoint.ModelState(restored).load_state_dict(saved["model"])
    checkpoint.OptimizerState(restored, restored_opt).load_state_dict(saved["optimizer"])
    steps(model, opt, no_scaler, 2, start=2)
    steps(restored, restored_opt, no_scaler, 2, start=2)
    for (name, a), b in zip(model.named_parameters(), restored.parameters()):
        assert torch.equal(a, b), name
    assert restored_opt[-1].param_groups[-1]["peak_lr"] == 0.02


def test_muon_trains(tiny_data, tmp_path, capsys):
    code, _, err = run_main(
        train.main,
        [
            *TINY,
            "--data",
            str(tiny_data),
            "--out",
            str(tmp_path),
            "--max-steps",
            "30",
            "--warmup-steps",
            "3",
            "--log-every",
            "5",
            "--eval-every",
            "30",
            "--eval-tokens",
            "256",
            "--optimizer",
            "muon",
        ],
        capsys,
    )
    assert code == 0, err
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert losses[-1] < losses[0] - 1.0, losses


RECIPE = ("--optimizer", "muon", "--schedule", "wsd", "--decay-fraction", "0.3", "--warmup-steps", "2")


@pytest.mark.parametrize("at", [4, 8])  # wsd over 10 steps: the peak at step 4, decaying from step 7
def test_muon_with_wsd_resumes_exactly_from_a_checkpoint(tiny_data, tmp_path, capsys, at):
    """In process: a fresh folder holding only the checkpoint of step `at` continues as the run went on."""
    assert_resumes_exactly(tiny_data, tmp_path, capsys, RECIPE, at)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [6, 9])  # wsd: stable at 6, decaying at 9
def test_muon_with_wsd_resumes_bit_identically_after_sigkill(tiny_data, tmp_path, capsys, kill_at):
    code, _, err = run_main(train.main, run_args(tiny_data, tmp_path / "reference", *RECIPE), capsys)
    assert code == 0, err
    killed = run_faulty("kill-at-step", kill_at, *run_args(tiny_data, tmp_path / "run", *RECIPE))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    code, out, err = run_main(train.main, [*run_args(tiny_data, tmp_path / "run", *RECIPE), "--resume"], capsys)
    assert code == 0, err
    assert f"at step {(kill_at - 1) // 4 * 4}" in out
    assert records(tmp_path / "run") == records(tmp_path / "reference")


def test_resuming_with_another_optimizer_is_one_line(tiny_data, tmp_path, capsys):
    args = [
        *TINY,
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path),
        "--max-steps",
        "2",
        "--eval-every",
        "2",
        "--eval-tokens",
        "128",
    ]
    assert run_main(train.main, args, capsys)[0] == 0
    train_refuses(
        capsys, [*args, "--max-steps", "4", "--resume", "--optimizer", "muon"], "--optimizer adamw", "ckpt_00000002.pt"
    )


def test_newton_schulz_batches_same_shape_matrices_and_matches_torchs_muon():
    """A batch orthogonalizes each matrix exactly as alone (so a rank's share gives the same bits as
    the whole), in fp32 on a CPU, close to torch.optim.Muon's bf16 iteration; a tall matrix is done
    through its transpose; the singular values land near 1 (the quintic's band, 0.5-1.5)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(4, 24, 40, generator=torch.Generator().manual_seed(0))
    whole = newton_schulz(g)
    assert whole.dtype == torch.float32 and torch.equal(whole, torch.cat([newton_schulz(m[None]) for m in g]))
    torchs = torch.stack([_zeropower_via_newtonschulz(m, (3.4445, -4.7750, 2.0315), 5, 1e-7).float() for m in g])
    torch.testing.assert_close(whole, torchs, atol=0.02, rtol=0.05)
    assert torch.equal(newton_schulz(g.mT), whole.mT)
    s = torch.linalg.svdvals(whole)
    assert 0.5 < s.min() and s.max() < 1.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_newton_schulz_keeps_bf16_on_cuda_as_torchs_muon():
    """On CUDA the iteration stays the published one, bf16: batched, within bf16's rounding of torch's."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(4, 256, 704, generator=torch.Generator().manual_seed(0)).cuda()
    ours = newton_schulz(g)
    assert ours.dtype == torch.bfloat16
    torchs = torch.stack([_zeropower_via_newtonschulz(m, (3.4445, -4.7750, 2.0315), 5, 1e-7) for m in g])
    torch.testing.assert_close(ours.float(), torchs.float(), atol=0.02, rtol=0.05)


def test_muon_steps_as_torchs_muon_up_to_its_bf16_newton_schulz():
    """The same momentum, scale and decoupled decay as torch.optim.Muon ("original" scaling): one
    step from the same weights and gradient lands within bf16's rounding of torch's."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(48, 16)), torch.nn.Parameter(torch.randn(16, 48))]
    theirs = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    ours = Muon(weights, lr=0.05, momentum=0.9, weight_decay=0.1)
    ref = torch.optim.Muon(theirs, lr=0.05, momentum=0.9, weight_decay=0.1)
    for _ in range(2):
        for w, t in zip(weights, theirs):
            w.grad = torch.randn_like(w)
            t.grad = w.grad.clone()
        ours.step()
        ref.step()
    for w, t in zip(weights, theirs):
        torch.testing.assert_close(w, t, atol=2e-3, rtol=0)
        assert torch.equal(ours.state[w]["momentum_buffer"], ref.state[t]["momentum_buffer"])


def test_muon_under_fsdp_is_accepted(tmp_path):
    from fastpt import config

    cfg = config.resolve({"optimizer": "muon", "parallel": "fsdp", "out": str(tmp_path)}, None, "cpu")
    assert (cfg.optimizer, cfg.parallel) == ("muon", "fsdp")


CHANGED = {  # per optimizer: flags a resume changes, and the group settings they must show after its steps
    "adamw": (
        ("--lr", "2e-3", "--weight-decay", "0.05", "--beta1", "0.85"),
        {("lr", True): {"peak_lr": 2e-3, "weight_decay": 0.05, "betas": (0.85, 0.95)}},
        "lr 0.001 -> 0.002, weight_decay 0.1 -> 0.05, beta1 0.9 -> 0.85",
    ),
    "muon": (
        ("--muon-lr", "0.01", "--head-lr", "0.003", "--muon-momentum", "0.9", "--muon-weight-decay", "0.1"),
        {("muon", True): {"peak_lr": 0.01, "weight_decay": 0.1, "momentum": 0.9}, ("head", True): {"peak_lr": 0.003}},
        "muon_lr 0.02 -> 0.01, head_lr 0.0 -> 0.003, muon_weight_decay 0.0 -> 0.1, muon_momentum 0.95 -> 0.9",
    ),
}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_resume_takes_the_configs_optimizer_settings(tiny_data, tmp_path, capsys, optimizer):
    """A changed setting applies to every group after the resume and is named in one line; an
    unchanged config resumes bit for bit."""
    import shutil

    flags, want, line = CHANGED[optimizer]
    recipe = ("--optimizer", optimizer, "--lr", "1e-3", "--muon-momentum-warmup", "0", "--keep-checkpoints", "3")
    assert run_main(train.main, run_args(tiny_data, tmp_path / "reference", *recipe), capsys)[0] == 0
    for name, extra in (("same", ()), ("changed", flags)):
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "reference" / "ckpt_00000004.pt", tmp_path / name)
        code, out, err = run_main(
            train.main, [*run_args(tiny_data, tmp_path / name, *recipe, *extra), "--resume"], capsys
        )
        assert code == 0 and "at step 4" in out, err
        assert ("resume: " in out) is (name == "changed"), out
    assert records(tmp_path / "same") == [r for r in records(tmp_path / "reference") if r["step"] > 4]
    assert f"resume: {line} (the config's values apply)" in out
    saved = torch.load(tmp_path / "changed" / "ckpt_00000010.pt", weights_only=True)["optimizer"]["param_groups"]
    groups = {(g["name"], g["decayed"]): g for g in saved}  # the groups as the steps after the resume ran them
    for name, settings in want.items():
        for key, value in settings.items():
            got = tuple(groups[name][key]) if key == "betas" else groups[name][key]
            assert got == pytest.approx(value), (name, key)
    last = read_metrics(tmp_path / "changed")[-1]
    assert last["lr/muon" if optimizer == "muon" else "lr"] != read_metrics(tmp_path / "reference")[-1].get(
        "lr/muon" if optimizer == "muon" else "lr"
    )
