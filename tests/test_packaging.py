"""The installed distribution owns no top-level import name of another distribution's: kernels/
installs as fastpt.kernels, and bench/ runs from the checkout only."""

from __future__ import annotations

import os
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


def test_the_folder_imported_again_as_kernels_leaves_fastpts_ops_alone(tmp_path):
    """From a checkout, `import kernels` (transformers looks for Hugging Face's package by that name)
    finds this folder: that second copy must register ops of its own, not replace fastpt's."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import torch; import fastpt.kernels as ours\n"
        "from fastpt.kernels.ops import rms_norm as ops\n"
        "calls = []; real = ops.rms_norm_forward\n"
        "ops.rms_norm_forward = lambda *a: calls.append(1) or real(*a)\n"
        "import kernels as stray\n"
        "assert stray is not ours and stray.functional.NAMESPACE == 'kernels'\n"
        "ours.rms_norm(torch.randn(3, 16), torch.ones(16), backend='triton')\n"
        "print(len(calls))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"  # fastpt's launcher ran, not the stray copy's
