"""bench/results/ as summaries: each README's table re-made from its folder's raw.tar.xz, the archive
packed again to the same bytes, the readers of archived files, and the folder's size budget."""

from __future__ import annotations

import runpy
import shutil
import subprocess

import pytest

from bench.common import REPO
from bench.results_archive import ARCHIVE, TABLE_BEGIN, main, pack, readme_table, table, unpack

RESULTS = REPO / "bench" / "results"
MAX_FILES, MAX_BYTES = 300, 3_000_000
REMADE = sorted(p.parent for p in RESULTS.glob("*/README.md") if TABLE_BEGIN in p.read_text())
SMALL = RESULTS / "2026-12-03-cpu-race5-tpp10"  # 15 archived files, one race


def test_the_remade_tables_cover_the_races_and_the_soak():
    names = {f.name for f in REMADE}
    assert {SMALL.name, "2026-12-01-cpu-soak", "2026-12-05-cpu-round4-ablate3"} <= names and len(names) >= 18


@pytest.mark.parametrize("folder", REMADE, ids=lambda f: f.name)
def test_each_readme_table_is_the_one_its_archive_remakes(folder):
    assert readme_table(folder) == table(folder)


def test_unpacked_then_packed_gives_the_same_bytes(tmp_path):
    folder = tmp_path / SMALL.name
    shutil.copytree(SMALL, folder)
    raw = unpack(folder)
    assert (raw / "race.json").is_file() and len(list(raw.rglob("metrics.jsonl"))) == 6
    (folder / ARCHIVE).unlink()
    assert pack(folder).read_bytes() == (SMALL / ARCHIVE).read_bytes()


def test_the_command_remakes_a_table_and_names_a_folder_without_one(tmp_path, capsys):
    assert main(["table", str(SMALL)]) == 0
    assert capsys.readouterr().out == readme_table(SMALL)
    legacy = RESULTS / "2026-12-02-cpu-race"  # its race.json predates the report's per-budget rows
    for folder, named in ((tmp_path, ARCHIVE), (legacy, "race.md")):
        assert main(["table", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fastpt: error: ") and err.count("\n") == 1 and named in err, err


@pytest.mark.parametrize(
    "script", ["2026-12-05-cpu-round4-ablate3/ablation.py", "2026-12-07-cpu-nanochat-race/vs_nanochat.py"]
)
def test_a_folders_script_reads_its_archive_and_prints_what_it_stored(script, capsys):
    path = RESULTS / script
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out == path.with_suffix(".txt").read_text()


def test_results_stay_within_300_files_and_3_mb():
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "bench/results"], cwd=REPO, capture_output=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [REPO / name for name in listed.decode().split("\0") if name]
    size = sum(f.stat().st_size for f in files if f.exists())
    assert 0 < len(files) <= MAX_FILES and size <= MAX_BYTES, (len(files), size)
