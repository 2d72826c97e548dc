"""The source distribution is the package and its data, not the repository: the tests need the
checkout (bench/, docs/, the committed plan tables, conftest.py), so the sdist ships none of them
(MANIFEST.in), and the data the planner reads at run time (fastpt/plan/published.json) ships
with the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import REPO


def test_the_sdist_ships_the_package_and_its_data_and_no_tests(tmp_path):
    checkout = tmp_path / "clone"
    for name in ("fastpt", "kernels", "tests", "bench"):
        shutil.copytree(REPO / name, checkout / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(REPO / name, checkout / name)
    build = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path / 'dist')!r}))"
    result = subprocess.run([sys.executable, "-c", build], cwd=checkout, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    with tarfile.open(tmp_path / "dist" / result.stdout.split()[-1]) as sdist:
        names = {Path(*Path(name).parts[1:]).as_posix() for name in sdist.getnames()}
    assert "fastpt/plan/published.json" in names and "fastpt/plan/published.py" in names
    assert "kernels/api.py" in names or "fastpt/kernels/api.py" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/"))]
