"""`python -m bench` and `python -m bench kernels` on CPU: the rows they write and the loss check."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from bench import baseline, train_step
from bench.__main__ import main as bench_main
from bench.train_step import Setup, measure, parse_mode, run_mode, unavailable
from bench.train_step_report import losses_agree
from fastpt.model import Transformer
from fastpt.presets import ModelConfig

ROW_FIELDS = {
    "mode",
    "tok_s",
    "step_ms",
    "peak_mem_gib",
    "mfu",
    "loss",
    "compile_s",
    "device",
    "device_name",
    "torch",
    "triton",
    "commit",
    "preset",
    "micro_batch",
    "seq_len",
    "grad_accum",
    "dtype",
    "data",
}


def run_bench(capsys, *args: str) -> tuple[int, str]:
    """`python -m bench ARGS` in this process (each train-step mode still measured in a process of
    its own): (exit code, stdout)."""
    code = bench_main(list(args))
    return code, capsys.readouterr().out


def test_train_step_cli_rows_and_agreeing_losses(tmp_path, capsys, monkeypatch):
    # The modes measured in this process: their own processes are test_lever_rows_on_cpu's (and CI's
    # python -m bench run); one compiled mode's process costs this test a third of its time.
    here = lambda setup, mode, steps, warmup, timeout: measure(setup, mode, steps, warmup)
    monkeypatch.setattr(train_step, "measure_isolated", here)
    out = tmp_path / "rows.json"
    code, stdout = run_bench(
        capsys,
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--modes",
        "eager,compiled",
        "--json",
        str(out),
    )
    assert code == 0, stdout
    result = json.loads(out.read_text())
    assert result["losses_agree"] and "| eager |" in stdout and "| compiled |" in stdout
    rows = result["rows"]
    assert [r["mode"] for r in rows] == ["eager", "compiled"]
    for r in rows:
        assert ROW_FIELDS <= r.keys()
        assert r["tok_s"] > 0 and r["peak_mem_gib"] >= 0 and r["mfu"] is None  # no MFU on CPU
        assert r["planned_tok_s"] == pytest.approx(r["tokens_per_step"] / r["planned_step_ms"] * 1e3)
        assert r["loss"] == pytest.approx(rows[0]["loss"], rel=1e-4)
    assert "planned tok/s" in stdout and rows[1]["planned_step_ms"] < rows[0]["planned_step_ms"]


def test_kernel_cli_rows(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    code, stdout = run_bench(capsys, "kernels", "--device", "cpu", "--providers", "torch,fastpt", "--json", str(out))
    assert code == 0, stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["op"], r["provider"]) for r in rows} == {
        (op, p) for op in ("rms_norm", "cross_entropy", "linear_cross_entropy") for p in ("torch", "fastpt")
    }
    assert all(r["ms"] > 0 and r["rel_err"] < 1e-5 and 0 < r["floor_ms"] for r in rows)
    assert rows[0]["copy_gbps"] > 0 and "| floor ms | % of floor |" in stdout
    assert "fastpt rows run the PyTorch reference, not the Triton kernels, unless TRITON_INTERPRET=1" in stdout


def test_modes_parse():
    assert parse_mode("compiled+kernels+cudagraphs").compile_mode == "reduce-overhead"
    assert parse_mode("compiled+autotune+cudagraphs").compile_mode == "max-autotune"
    assert parse_mode("baseline").impl == "baseline" and parse_mode("baseline").compile
    levers = parse_mode("eager+ac-selective+float8")
    assert levers.activation_checkpointing == "selective" and levers.float8 and not levers.compile
    for bad in (
        "fast",
        "eager+autotune",
        "baseline+kernels",
        "baseline+ac",
        "compiled+ac+ac-selective",
        "eager+kernels+kernels",
    ):
        with pytest.raises(ValueError):
            parse_mode(bad)


def test_losses_agree_flags_disagreement_and_errors():
    rows = [{"mode": "eager", "loss": 4.0}, {"mode": "compiled", "loss": 4.0002}]
    assert losses_agree(rows, 1e-4) and not losses_agree(rows, 1e-5)
    assert not losses_agree(rows + [{"mode": "baseline", "error": "boom"}], 1e-3)
    assert losses_agree(rows + [{"mode": "compiled+float8", "skipped": "needs CUDA"}], 1e-3)


def test_lever_rows_on_cpu(tmp_path, capsys):
    """Activation checkpointing measured (in a process of its own, as every mode); the CUDA-only
    levers skipped with the reason in their row (CUDA graphs also at grad-accum > 1, as the trainer
    refuses them); a spent --time-budget skips."""
    out = tmp_path / "rows.json"
    code, stdout = run_bench(
        capsys,
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--modes",
        "eager+ac,compiled+cudagraphs,eager+float8",
        "--json",
        str(out),
    )
    assert code == 0, stdout
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["eager+ac"]["tok_s"] > 0 and rows["eager+ac"]["peak_mem_gib"] >= 0
    assert rows["compiled+cudagraphs"]["skipped"] == "CUDA graphs need a CUDA device"
    assert "'float8' needs a CUDA GPU" in rows["eager+float8"]["skipped"]
    assert "| compiled+cudagraphs | skipped: CUDA graphs need a CUDA device |" in stdout
    on_gpu = Setup("tiny", "cuda", 8, 2, 256, "bf16", "")
    assert "need --grad-accum 1" in unavailable(parse_mode("compiled+cudagraphs"), on_gpu)
    spent = run_mode(on_gpu, parse_mode("eager"), 1, 1, None, deadline=time.monotonic() + 5)
    assert spent["mode"] == "eager" and spent["skipped"].startswith("out of time (")


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_the_baseline_computes_the_same_model_as_fastpt(tie):
    """The peer is the same function (weights copied over, GQA and the 1b preset's untied head
    included): only then is its speed comparable and its loss a check on ours."""
    cfg = ModelConfig(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32, tie_embeddings=tie
    )
    torch.manual_seed(0)
    ours = Transformer(cfg, "torch")
    theirs = baseline.GPT(baseline.GPTConfig.like(cfg))
    theirs.load_llama_state(ours.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 33))
    _, loss, _ = ours(ids[:, :-1], labels=ids[:, 1:])
    _, peer_loss, _ = theirs(ids[:, :-1], labels=ids[:, 1:])
    torch.testing.assert_close(peer_loss, loss, rtol=1e-5, atol=0)


def test_commit_stamp_is_dirty_for_tracked_changes_only(tmp_path, monkeypatch):
    """A user's untracked data/ or runs/ beside the code does not make results '+dirty'."""
    from bench import common

    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code")
    monkeypatch.setattr(common, "REPO", tmp_path)
    monkeypatch.delenv("FASTPT_COMMIT", raising=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train_000.bin").write_bytes(b"\0")
    assert not common.git_commit().endswith("+dirty")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert common.git_commit().endswith("+dirty")
