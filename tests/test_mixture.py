"""--data mixtures: several prepared datasets sampled by weight, deterministic, striped over
ranks and exact on resume; every mistake in the spec is one line naming it."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import TINY, assert_one_line_error, run_main
from fastpt import distributed, train
from fastpt.config import PRESETS, TrainConfig, resolve
from fastpt.data.dataset import Source, data_sources, open_windows, source_names
from fastpt.data.loader import TrainLoader
from fastpt.data.shards import write_shard
from fastpt.data.windows import MIX_BLOCK, Mixture, Windows, quotas
from fastpt.errors import DataError
from fastpt.evaluate import evaluate
from fastpt.model import Transformer
from fastpt.prepare import prepare

SEQ = 7


def source(folder, first_id: int, n_windows: int) -> Windows:
    """Windows each filled with first_id + its number (mod 400): a row says its source and window."""
    folder.mkdir()
    tokens = first_id + np.arange(n_windows * (SEQ + 1)) // (SEQ + 1) % 400
    return Windows([write_shard(folder / "train_000000.bin", tokens, vocab_size=1000)], SEQ)


def take(loader: TrainLoader, n: int) -> list[torch.Tensor]:
    return [loader.next().x.clone() for _ in range(n)]


def test_quotas_keep_every_source_and_sum_to_the_block():
    assert quotas([0.8, 0.2], 1000).tolist() == [800, 200]
    assert quotas([1, 1, 1], 1000).tolist() == [334, 333, 333]
    assert quotas([1e-9, 1], 1000).tolist() == [1, 999]  # a tiny weight still draws
    assert quotas([1e-4, 1e-4, 0.9998], 1000).tolist() == [1, 1, 998]  # two tiny ones: neither taken back
    assert quotas([1.0] * 1000, 1000).tolist() == [1] * 1000
    with pytest.raises(DataError, match="'data' names 1001 sources; a mixture takes at most 1000"):
        quotas([1.0] * 1001, 1000)


WEIGHT = st.floats(min_value=1e-12, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=500, deadline=None)
@example([1e-4, 1e-4, 0.9998])
@example([1e-12] * 999 + [1.0])
@given(st.lists(st.one_of(WEIGHT, st.sampled_from([1e-4, 1e-9, 0.5, 1.0])), min_size=1, max_size=1000))
def test_quotas_give_every_named_source_a_window_and_sum_to_the_block(weights):
    """Any positive weights: each source >= 1 window per block, the block exactly full, no source above
    its exact share rounded up, and, when no source is below one window, each within one of its share."""
    quota = quotas(weights, MIX_BLOCK)
    exact = np.asarray(weights) / sum(weights) * MIX_BLOCK
    assert quota.min() >= 1 and quota.sum() == MIX_BLOCK
    assert (quota <= np.maximum(1, np.ceil(exact))).all()
    if exact.min() >= 1:
        assert (np.abs(quota - exact) < 1).all()


def test_a_mixture_draws_each_source_at_its_weight_and_resumes_exactly(tmp_path):
    web, code = source(tmp_path / "web", 0, 500), source(tmp_path / "code", 500, 60)
    mixture = Mixture([web, code], [0.8, 0.2])
    assert len(mixture) == 300  # code (60 windows at 20%) repeats first
    cpu = torch.device("cpu")
    reference = take(TrainLoader(mixture, 10, seed=5, device=cpu), 300)  # 3000 rows: 3 blocks, code's 10 epochs
    rows = torch.cat(reference)
    from_code = rows[:, 0] >= 500
    assert int(from_code.sum()) == 600  # exactly its 20% in every block of 1000
    assert 0.1 < from_code[:100].float().mean().item() < 0.3  # interleaved, not one source after the other
    code_rows = rows[from_code]
    assert len({tuple(r.tolist()) for r in code_rows[:60]}) == 60  # each source: no repeat within its epoch
    first = TrainLoader(mixture, 10, seed=5, device=cpu)
    take(first, 123)
    state = first.state_dict()
    first.close()
    resumed = TrainLoader(mixture, 10, seed=0, device=cpu)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 50), reference[123:]))
    ranks = [take(TrainLoader(mixture, 5, seed=5, device=cpu, rank=r, world_size=2), 8) for r in (0, 1)]
    assert torch.equal(torch.cat([torch.cat(pair) for pair in zip(*ranks)]), torch.cat(reference[:8]))
    other = torch.cat(take(TrainLoader(mixture, 10, seed=6, device=cpu), 30))
    assert not torch.equal(other, rows[:300])


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    """Two byte-level datasets (one tokenizer) and one with a BPE: a mixture may join only the first two."""
    root = tmp_path_factory.mktemp("mix")
    for name, text in (
        ("web", "plain prose, sentence after sentence. " * 300),
        ("code", "def f(x):\n    return x + 1\n" * 400),
    ):
        (root / f"{name}.txt").write_text(text)
        prepare([root / f"{name}.txt"], root / name, "bytes", workers=1, val_fraction=0.1)
    prepare([root / "web.txt"], root / "bpe", "bpe", 300, workers=1, val_fraction=0.1)
    return root


def test_a_mixture_trains_and_the_summary_shows_each_share(two_sets, tmp_path, capsys):
    spec = f"{two_sets / 'web'}:3,{two_sets / 'code'}:1"
    code, out, err = run_main(
        train.main,
        [*TINY, "--data", spec, "--out", str(tmp_path / "run"), "--max-steps", "2", "--eval-every", "2"],
        capsys,
    )
    assert code == 0, err
    summary = next(line for line in out.splitlines() if line.startswith("data "))
    assert f"{two_sets / 'web'} 75.0%:" in summary and f"{two_sets / 'code'} 25.0%:" in summary
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert {"val_loss", "val_loss/web", "val_loss/code"} <= set(last)
    line = next(line for line in out.splitlines() if "val loss" in line)
    assert f"(web {last['val_loss/web']:.4f}, code {last['val_loss/code']:.4f})" in line


def test_a_mixture_logs_each_sources_val_loss_beside_the_mixed_one(two_sets):
    """val_loss/SOURCE: the mean over that source's validation windows among the evaluated ones;
    val_loss over all of them, as before."""
    sources = [Source(two_sets / "web", 0.7), Source(two_sets / "code", 0.3)]
    _, val = open_windows(sources, 16, "concat", "llmc", 257)
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=257))
    cfg = TrainConfig(micro_batch=4, eval_tokens=16 * 30)  # 30 windows in 8 batches, the last short
    cpu = torch.device("cpu")
    names = source_names(sources)
    got = evaluate(model, val, cfg, cpu, torch.autocast("cpu", enabled=False), distributed.Dist(), None, names)
    w, origin = val.gather(np.arange(30)), torch.from_numpy(val.sources(np.arange(30)))  # (30, 17), (30,)
    with torch.no_grad():
        nats = F.cross_entropy(model(w[:, :-1])[0].transpose(1, 2), w[:, 1:], reduction="none").mean(1)  # (30,)
    assert names == ["web", "code"] and 0 < int((origin == 1).sum()) < 30
    assert got["val_loss"] == pytest.approx(nats.mean().item(), rel=1e-5)
    for k, name in enumerate(names):
        assert got[f"val_loss/{name}"] == pytest.approx(nats[origin == k].mean().item(), rel=1e-5)
    assert abs(got["val_loss/web"] - got["val_loss/code"]) > 0.01


def test_the_toml_table_form_is_the_same_mixture(two_sets, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'max_steps = 3\n\n[data]\n"{two_sets / "web"}" = 0.8\n"{two_sets / "code"}" = 0.2\n')
    cfg = resolve({}, str(config), "cpu")
    assert cfg.max_steps == 3
    assert [(s.folder, s.weight) for s in data_sources(cfg.data)] == [(two_sets / "web", 0.8), (two_sets / "code", 0.2)]


MIX_MISTAKES = {
    "weight not a number": ("{web}:0.8,{code}:lots", "'lots'"),
    "weight zero": ("{web}:0.8,{code}:0", "'0'"),
    "weight negative": ("{web}:-1,{code}:1", "'-1'"),
    "weight nan": ("{web}:nan,{code}:1", "'nan'"),
    "no such dataset": ("{web}:0.8,{root}/nothing:0.2", "{root}/nothing"),
    "no name": ("{web}:0.8,:0.2", "':0.2'"),
    "another tokenizer": ("{web}:0.5,{root}/bpe:0.5", "{root}/bpe"),
}


@pytest.mark.parametrize("case", MIX_MISTAKES)
def test_mixture_mistakes_are_one_line_naming_them(case, two_sets, tmp_path, capsys):
    spec, named = (v.format(web=two_sets / "web", code=two_sets / "code", root=two_sets) for v in MIX_MISTAKES[case])
    code, _, err = run_main(
        train.main, [*TINY, "--data", spec, "--out", str(tmp_path / "run"), "--max-steps", "1"], capsys
    )
    assert_one_line_error(code, err, named)


def test_a_bos_mixture_run_resumed_from_its_checkpoint_logs_what_the_whole_run_logs(two_sets, tmp_path, capsys):
    args = [
        *TINY,
        "--data",
        f"{two_sets / 'web'}:0.6,{two_sets / 'code'}:0.4",
        "--packing",
        "bos",
        "--max-steps",
        "6",
        "--log-every",
        "1",
        "--ckpt-every",
        "3",
        "--eval-every",
        "3",
        "--eval-tokens",
        "256",
    ]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run_main(train.main, [*args, "--out", str(whole)], capsys)[0] == 0
    resumed.mkdir()
    shutil.copy(whole / "ckpt_00000003.pt", resumed / "ckpt_00000003.pt")
    assert run_main(train.main, [*args, "--out", str(resumed), "--resume"], capsys)[0] == 0

    def after_step_3(run):
        return [
            {k: r[k] for k in ("step", "loss", "val_loss", "val_bpb") if k in r}
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["step"] > 3
        ]

    assert after_step_3(resumed) == after_step_3(whole) and len(after_step_3(whole)) == 4  # 3 train + 1 eval


def test_resuming_with_another_mixture_is_refused_in_one_line(two_sets, tmp_path, capsys):
    """Other shares, another source, or one dataset where the mixture was: refused, naming both mixtures
    (each would remap every later position). The same shares spelled otherwise (3:1 = 0.75:0.25) resume."""
    web, code = two_sets / "web", two_sets / "code"
    run = tmp_path / "run"
    args = [*TINY, "--out", str(run), "--ckpt-every", "2", "--eval-every", "100"]
    assert run_main(train.main, [*args, "--data", f"{web}:3,{code}:1", "--max-steps", "2"], capsys)[0] == 0
    before = sorted(p.name for p in run.iterdir())
    for spec, now in (
        (f"{code}:1,{web}:3", f"{code} 25.0%"),  # the same epoch length: once resumed silently, remapped
        (f"{web}:1,{code}:1", f"{web} 50.0%"),
        (f"{web}:3,{code}:1,{two_sets / 'web'}/../code:1", "60.0%"),
        (str(web), "--data now gives one dataset"),
    ):
        code_, _, err = run_main(train.main, [*args, "--data", spec, "--max-steps", "3", "--resume"], capsys)
        assert_one_line_error(code_, err, "ckpt_00000002.pt: the checkpoint's mixture is ", f"{web} 75.0% (", now)
        assert "a mixture cannot change mid-run" in err
    assert sorted(p.name for p in run.iterdir()) == before
    code_, out, err = run_main(
        train.main, [*args, "--data", f"{web}:0.75,{code}:0.25", "--max-steps", "3", "--resume"], capsys
    )
    assert code_ == 0 and "at step 2" in out, err
