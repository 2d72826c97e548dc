"""What a user touches around the loop: metrics, TensorBoard, sampling, plots, --help."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY, assert_one_line_error, read_metrics, run_main, run_quietly
from fastpt import checkpoint, export, plot, prepare, sample, train
from fastpt.config import PRESETS, TrainConfig
from fastpt.errors import MissingPackage
from fastpt.metrics import MetricsLogger, peak_flops
from fastpt.model import Transformer


@pytest.fixture(scope="module")
def run_dir(tiny_data, tmp_path_factory):
    """A 5-step tiny run with TensorBoard on: one checkpoint, train and eval metrics."""
    out = tmp_path_factory.mktemp("ux") / "run"
    args = ["--data", str(tiny_data), "--out", str(out), *TINY, "--max-steps", "5", "--log-every", "1", "--tensorboard"]
    code, _, err = run_quietly(train.main, args)
    assert code == 0, err
    return out


def load_model(run_dir) -> Transformer:
    return checkpoint.load_model(checkpoint.latest(run_dir), torch.device("cpu"))[0]


def greedy_without_cache(model: Transformer, ids: list[int], n: int) -> list[int]:
    """The oracle: re-run the whole sequence for every new token."""
    out = list(ids)
    for _ in range(n):
        logits, _, _ = model(torch.tensor([out]))
        out.append(int(logits[0, -1].argmax()))
    return out


def test_metrics_records_carry_the_documented_fields(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = read_metrics(run_dir)
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5]
    for r in train_records:
        assert {"step", "loss", "lr", "grad_norm", "tok_s", "mfu", "peak_mem_gib", "data_wait_pct"} <= r.keys()
        assert r["mfu"] is None  # a CPU has no peak-FLOPs entry: no made-up number
    evals = [r for r in records if "val_loss" in r]
    assert evals and evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"]))


def test_tensorboard_event_file_is_written(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4, 5]
    assert "val_loss" in acc.Tags()["scalars"]


def test_sample_prints_text_from_the_run_folder(run_dir, capsys):
    assert (run_dir / "tokenizer.json").is_file()  # the run folder is self-contained
    args = ["--ckpt", str(run_dir), "--prompt", "def ", "--max-new-tokens", "40", "--device", "cpu"]
    code, out, err = run_main(sample.main, args, capsys)
    assert code == 0, err
    assert out.startswith("def ") and len(out) > len("def \n")
    assert "ckpt_00000005.pt: step 5" in err


def test_kv_cache_generation_equals_full_recompute(run_dir):
    model = load_model(run_dir)
    prompt = [256, *b"import os\n"]
    cached = sample.generate(model, prompt, 30, temperature=0)
    assert cached == greedy_without_cache(model, prompt, 30)
    torch.manual_seed(0)
    assert sample.generate(model, prompt, 30, temperature=1.0, top_k=1) == cached  # top-1 is greedy


def test_a_checkpoint_with_an_unknown_model_field_is_one_line(run_dir, tmp_path, capsys):
    ckpt = checkpoint.load(checkpoint.latest(run_dir))
    ckpt["model_config"]["kernels"] = "triton"  # a runtime choice, never a model field
    torch.save(ckpt, tmp_path / "ckpt_00000005.pt")
    code, _, err = run_main(sample.main, ["--ckpt", str(tmp_path / "ckpt_00000005.pt"), "--device", "cpu"], capsys)
    assert_one_line_error(code, err, "model config has fields this fastpt does not know: kernels")


def test_generation_continues_past_the_context_window():
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=50, max_seq_len=16)).eval()
    torch.manual_seed(0)
    out = sample.generate(model, [1, 2, 3], 40, temperature=1.0, top_k=10)
    assert len(out) == 43 and all(0 <= t < 50 for t in out)
    # a preset's embedding may be wider than the tokenizer: ids it cannot decode are never drawn
    assert all(t < 7 for t in sample.generate(model, [1, 2, 3], 40, temperature=2.0, top_k=0, vocab=7))


@pytest.mark.slow
def test_compiled_generation_matches_eager(run_dir):
    model = load_model(run_dir)
    prompt = [256, *b"class "]
    compiled = torch.compile(model, dynamic=True)
    assert sample.generate(compiled, prompt, 12, temperature=0) == sample.generate(model, prompt, 12, temperature=0)


def test_sample_takes_a_checkpoint_file_and_draws_several_samples(run_dir, capsys):
    ckpt = checkpoint.latest(run_dir)
    code, out, err = run_main(
        sample.main,
        ["--ckpt", str(ckpt), "--prompt", "def ", "--max-new-tokens", "8", "--device", "cpu", "--num-samples", "3"],
        capsys,
    )
    assert code == 0, err
    samples = out.split("-" * 40 + "\n")
    assert len(samples) == 3 and all(s.startswith("def ") for s in samples)
    assert len(set(samples)) > 1  # drawn one after another from the seeded generator, not repeated


@pytest.mark.parametrize(
    "args, named",
    [
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "1e-300"], "'--temperature' must be 0 (off) or in [0.01, 100], got 1e-300"),
        (["--max-new-tokens", "1" + "0" * 400], "'--max-new-tokens' must be in [1, 1_000_000_000_000]"),
        (["--top-k", "-1"], "--top-k"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--num-samples", "0"], "--num-samples"),
        (["--seed", "-1"], "--seed"),
        (["--seed", "x"], "--seed"),
        (["--tokenizer", "missing.json"], "missing.json"),
        (["--tokenizer", "RUN/metrics.jsonl"], "metrics.jsonl"),
        (["--ckpt", "no/such/run"], "no/such/run"),
        (["--ckpt", "EMPTY"], "no checkpoint in"),
        (["--ckpt", "RUN/config.toml"], "config.toml"),
        (["--tokenizer", "BIG"], "has 1001 tokens, more than the model's vocab"),
    ],
)
def test_sample_mistakes_are_one_line(run_dir, tmp_path, capsys, args, named):
    big = tmp_path / "big.json"  # a tokenizer of another model: more ids than this one has
    big.write_text(json.dumps({"type": "char", "chars": "".join(chr(0x4E00 + i) for i in range(1000)), "eot": True}))
    args = [a.replace("RUN", str(run_dir)).replace("EMPTY", str(tmp_path)).replace("BIG", str(big)) for a in args]
    code, _, err = run_main(sample.main, ["--ckpt", str(run_dir), "--device", "cpu", *args], capsys)
    assert_one_line_error(code, err, named)


def test_plot_writes_a_png(run_dir):
    path = plot.plot(run_dir)
    assert path == run_dir / "loss.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_without_matplotlib_says_what_to_install(run_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    expected = 'fastpt.plot needs the matplotlib package: pip install -e ".[plot]" (or pip install matplotlib)'
    with pytest.raises(MissingPackage, match=re.escape(expected)):
        plot.plot(run_dir)


def test_wandb_without_the_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingPackage, match="--wandb needs the wandb package: pip install wandb"):
        MetricsLogger(tmp_path, {}, wandb_project="fastpt")


def test_peak_flops_table_knows_gpus_and_admits_unknown_ones():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 NVL") == 835e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA L4") == 121e12
    for unknown in ("cpu", "NVIDIA T400", "NVIDIA GB300", "Some Future Accelerator"):
        assert peak_flops(unknown) is None


def help_text(main, capsys) -> str:
    code, out, _ = run_main(main, ["--help"], capsys)
    assert code == 0
    return out


def test_train_help_documents_every_config_field(capsys):
    text = help_text(train.main, capsys)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert all(f.metadata["help"] for f in dataclasses.fields(TrainConfig))  # a new field needs its help line
    for name in names:
        assert "--" + name.replace("_", "-") in text
    defaults = [f for f in dataclasses.fields(TrainConfig) if "the preset's by default" not in f.metadata["help"]]
    assert text.count("(default:") >= len(defaults)
    assert " ".join(text.split()).count("the preset's by default") == len(names) - len(defaults)


@pytest.mark.parametrize(
    "module, options",
    [
        (prepare, ["--out", "--tokenizer", "--vocab-size", "inputs"]),
        (
            sample,
            [
                "--ckpt",
                "--prompt",
                "--num-samples",
                "--max-new-tokens",
                "--temperature",
                "--top-k",
                "--tokenizer",
                "--device",
                "--compile",
                "--seed",
            ],
        ),
        (plot, ["RUN_DIR"]),
    ],
)
def test_every_command_help_lists_its_options(module, options, capsys):
    text = help_text(module.main, capsys)
    for option in options:
        assert option in text
    if module is not plot:  # plot's only argument is the required run folder
        assert text.count("(default:") >= len(options) - 1  # all but the required --out / --ckpt


@pytest.mark.parametrize("command", [train, prepare, sample, export, plot], ids=lambda m: m.__name__)
def test_a_mistyped_command_line_is_one_line_for_every_command(command, capsys):
    code, out, err = run_main(command.main, ["--bogus", "x"], capsys)
    assert_one_line_error(code, err, "command line: ")
    assert "usage:" not in out + err


def test_importing_torchao_for_float8_prints_nothing():
    """torchao logs a line per prebuilt extension this torch cannot load, and torch one per Enum it
    registers; fastpt's float8 import drops exactly those."""
    pytest.importorskip("torchao")
    result = subprocess.run(
        [sys.executable, "-c", "from fastpt import float8; float8.require_torchao()"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
