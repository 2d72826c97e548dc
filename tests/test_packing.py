"""--packing bos: every window starts at a document token and holds whole documents best-fit
(the one that does not fit cropped), seeded, striped over ranks and exact on resume."""

from __future__ import annotations

import json

import numpy as np
import torch

from conftest import TINY, assert_one_line_error, run_main
from fastpt import train
from fastpt.data.dataset import MANY_EPOCHS, doc_token, packing_warning
from fastpt.data.loader import TrainLoader
from fastpt.data.shards import write_shard
from fastpt.data.windows import BosWindows, Windows, best_fit

DOC = 1000  # the document token of the synthetic shards
HEAD, LONG = 998, 999  # ids of a shard's leading partial document and of a long document


def documents(rng: np.random.Generator, count: int, longest: int) -> list[np.ndarray]:
    """Documents of random lengths: the document token, then ids that say which document it is."""
    return [np.concatenate(([DOC], np.full(rng.integers(1, longest), i % DOC))) for i in range(count)]


def write_docs(path, docs: list[np.ndarray], head: int = 0):
    """A shard of these documents, after `head` tokens of a document that began in an earlier shard."""
    return write_shard(path, np.concatenate([np.full(head, HEAD), *docs]), vocab_size=DOC + 1)


def test_best_fit_takes_the_longest_that_fits_then_crops_the_shortest():
    # span 8: 6 + 2 fill the first row, 5 + 3 the second; 5 and 5 cannot share one row whole
    assert best_fit([5, 3, 2, 6], 8, buffer=10) == ([3, 2, 0, 1], [6, 2, 5, 3], [2, 4])
    assert best_fit([5, 5], 8, buffer=10) == ([1, 0], [5, 3], [2])  # one of them cropped to fit
    assert best_fit([5, 2], 8, buffer=10) == ([], [], [])  # an unfilled last row is left out


def test_bos_windows_start_at_a_document_and_hold_whole_documents(tmp_path):
    rng = np.random.default_rng(0)
    docs = documents(rng, 400, 24) + [np.concatenate(([DOC], np.full(100, LONG)))]  # one longer than a window
    shards = [
        write_docs(tmp_path / "train_000000.bin", docs[:200], head=9),
        write_docs(tmp_path / "train_000001.bin", docs[200:]),
    ]
    seq_len = 32
    windows = BosWindows(shards, seq_len, DOC)
    rows = windows.gather(np.arange(len(windows))).numpy()  # (N, seq_len + 1)
    assert rows.shape[1] == seq_len + 1 and (rows[:, 0] == DOC).all()
    lengths = {d[1]: len(d) for d in docs}
    whole = cropped = 0
    for row in rows:
        pieces = np.split(row, np.flatnonzero(row == DOC))[1:]
        for k, piece in enumerate(pieces):
            # one document's tokens, never two glued together (a crop may keep its document token alone)
            assert (piece[1:] == piece[-1]).all()
            full = len(piece) > 1 and len(piece) == lengths[piece[1]]
            assert full or k == len(pieces) - 1  # only a window's last document may be cropped
            whole, cropped = whole + full, cropped + (not full)
    assert whole > 2 * cropped, (whole, cropped)  # best-fit: mostly whole documents
    assert [LONG] * seq_len in rows[:, 1:].tolist()  # the long document gives a window of its first tokens
    assert not (rows == HEAD).any()  # a shard's leading partial document is dropped
    total = sum(map(len, docs)) + 9
    assert windows.dropped == 1 - len(windows) * (seq_len + 1) / total and 0 < windows.dropped < 0.2, windows.dropped


def test_bos_loader_is_seeded_striped_and_exact_on_resume(tmp_path):
    shard = write_docs(tmp_path / "train_000000.bin", documents(np.random.default_rng(1), 600, 40))
    windows = BosWindows([shard], 16, DOC)
    cpu = torch.device("cpu")

    def take(loader, n):
        return [loader.next().x.clone() for _ in range(n)]

    reference = take(TrainLoader(windows, 4, seed=3, device=cpu), 2 * len(windows) // 4)  # two epochs
    assert all((b[:, 0] == DOC).all() for b in reference)
    first = TrainLoader(windows, 4, seed=3, device=cpu)
    take(first, 37)
    state = first.state_dict()
    first.close()
    resumed = TrainLoader(windows, 4, seed=0, device=cpu)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 30), reference[37:]))
    ranks = [take(TrainLoader(windows, 2, seed=3, device=cpu, rank=r, world_size=2), 10) for r in (0, 1)]
    assert torch.equal(torch.cat([torch.cat(pair) for pair in zip(*ranks)]), torch.cat(reference[:10]))
    other = take(TrainLoader(windows, 4, seed=4, device=cpu), 10)
    assert not all(torch.equal(a, b) for a, b in zip(other, reference))


def test_bos_trains_and_the_summary_says_what_it_drops(tiny_data, tmp_path, capsys):
    assert doc_token(tiny_data, "test") == json.loads((tiny_data / "meta.json").read_text())["eot_id"] == 256
    code, out, err = run_main(
        train.main,
        [
            *TINY,
            "--data",
            str(tiny_data),
            "--out",
            str(tmp_path / "run"),
            "--packing",
            "bos",
            "--max-steps",
            "3",
            "--log-every",
            "1",
        ],
        capsys,
    )
    assert code == 0, err
    summary = next(line for line in out.splitlines() if line.startswith("data "))
    assert "| packing bos |" in summary and "bos drops" in summary
    dropped = float(summary.split("bos drops ")[1].split("%")[0])
    assert 50 < dropped < 100  # whole source files at seq_len 32: the run says so, once
    warnings = [line for line in err.splitlines() if line.startswith("fastpt: warning: --packing bos drops")]
    assert len(warnings) == 1 and f"{dropped:.1f}% of {tiny_data}'s tokens" in warnings[0], err


def test_bos_warns_when_the_run_reads_its_windows_too_often(tmp_path):
    """Short documents drop little; the warning comes only once the run would read them > 4 times."""
    windows = BosWindows(
        [write_docs(tmp_path / "train_000000.bin", documents(np.random.default_rng(2), 400, 24))], 32, DOC
    )
    assert windows.dropped < 0.5
    per_step = 8
    enough = int(MANY_EPOCHS * len(windows) / per_step)
    assert packing_warning(windows, per_step, enough) is None
    warning = packing_warning(windows, per_step, enough + 10)
    assert (
        warning
        and f"leaves {len(windows):,} windows" in warning
        and f"read {per_step * (enough + 10) / len(windows):.1f} times" in warning
    )
    concat = Windows([tmp_path / "train_000000.bin"], 32)
    assert packing_warning(concat, per_step, 100 * enough) is None  # concat: not a packing that drops


def test_bos_on_data_without_a_document_token_is_one_line_naming_the_folder(tmp_path, capsys):
    folder = tmp_path / "nanogpt"
    folder.mkdir()
    for split in ("train", "val"):
        (folder / f"{split}.bin").write_bytes(np.arange(5000, dtype=np.uint16).tobytes())
    code, _, err = run_main(
        train.main,
        [
            *TINY,
            "--data",
            str(folder),
            "--data-format",
            "nanogpt",
            "--packing",
            "bos",
            "--out",
            str(tmp_path / "run"),
            "--max-steps",
            "1",
        ],
        capsys,
    )
    assert_one_line_error(code, err, str(folder), "'packing' = 'bos'")
