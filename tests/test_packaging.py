"""The installed distribution owns no top-level import name of another distribution's: kernels/
installs as fastpt.kernels, and bench/ runs from the checkout only."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def test_every_installed_package_is_under_fastpt():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"] and all(p == "fastpt" or p.startswith("fastpt.") for p in setuptools["packages"])
    assert setuptools["package-dir"] == {"fastpt.kernels": "kernels"}


def test_another_top_level_kernels_package_does_not_touch_fastpt(tmp_path):
    """Hugging Face's `kernels` (or any) first on sys.path: fastpt trains on its own kernels."""
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("raise ImportError('the other kernels package was imported')\n")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import fastpt.model, fastpt.kernels as k; "
        "assert 'kernels' not in sys.modules; print(k.__file__)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(REPO / "kernels" / "__init__.py")
