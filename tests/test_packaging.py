"""The installed distribution owns no top-level import name of another distribution's: kernels/
installs as fastpt.kernels (from a checkout's root it stands aside for another `kernels`), and bench/ runs
from the checkout only."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

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
    # samefile: a checkout used without installing may link fastpt/kernels to kernels/
    assert os.path.samefile(result.stdout.strip(), REPO / "kernels" / "__init__.py")


def import_kernels_from_the_root(tmp_path, other: str | None) -> subprocess.CompletedProcess:
    """`import kernels` in a process whose sys.path starts at the checkout's root (as `python -m` or
    pytest there), then another `kernels` package (`other`, its __init__ text; None: no other at all,
    site-packages left out)."""
    if other is not None:
        (tmp_path / "kernels").mkdir()
        (tmp_path / "kernels" / "__init__.py").write_text(other)
        (tmp_path / "kernels" / "hub.py").write_text("NAME = 'the hub module'\n")
        code = (
            "import sys; sys.path[:] = sys.argv[1:3] + sys.path\n"
            "import kernels, fastpt.kernels as ours\n"
            "from kernels.hub import NAME\n"
            "print(kernels.__file__, ours.__file__, NAME, sep='\\n')"
        )
    else:
        code = "import sys; sys.path[:] = sys.argv[1:2] + [p for p in sys.path if 'site-packages' not in p]\n"
        code += "import kernels"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return subprocess.run(
        [sys.executable, "-c", code, str(REPO), str(tmp_path)], capture_output=True, text=True, cwd=cwd
    )


def test_import_kernels_from_the_root_gets_the_other_distributions_package(tmp_path):
    """The folder stands aside for the next `kernels` on sys.path (transformers imports Hugging Face's
    by that name), its submodules included, and fastpt.kernels stays fastpt's."""
    result = import_kernels_from_the_root(tmp_path, other="CUDAProperties = object\n")
    assert result.returncode == 0, result.stderr
    theirs, ours, name = result.stdout.split("\n")[:3]
    assert theirs == str(tmp_path / "kernels" / "__init__.py") and name == "the hub module"
    assert os.path.samefile(ours, REPO / "kernels" / "__init__.py")


def test_import_kernels_from_the_root_without_another_fails_as_if_the_folder_were_not_there(tmp_path):
    result = import_kernels_from_the_root(tmp_path, other=None)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'kernels'"


def test_transformers_and_lm_eval_work_from_the_repository_root(tmp_path):
    """A process started in the checkout (its root first on sys.path, as `python -m` or a script there)
    with the installed transformers, Hugging Face's `kernels` and lm-eval: an export loads with
    AutoModelForCausalLM and computes fastpt's logits, and lm-eval's HF model class imports."""
    pytest.importorskip("transformers")
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from lm_eval.models.huggingface import HFLM\n"
        "from fastpt import hf\n"
        "from fastpt.config import ModelConfig\n"
        "from fastpt.model import Transformer\n"
        "cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=16)\n"
        "ours = Transformer(cfg).eval()\n"
        "import pathlib\n"
        "hf.save_hf(pathlib.Path(sys.argv[1]), cfg, ours.state_dict())\n"
        "theirs = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "ids = torch.randint(0, 64, (2, 16))\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(theirs(ids).logits, ours(ids)[0], atol=1e-4, rtol=0)\n"
        "import importlib.metadata as md\n"
        "try:\n"
        "    md.version('kernels')\n"
        "except md.PackageNotFoundError:  # older transformers do not depend on Hugging Face's kernels\n"
        "    sys.exit(print('absent'))\n"
        "import kernels\n"
        "print(kernels.__file__ != sys.argv[2], md.version('transformers'), md.version('kernels'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(REPO / "kernels" / "__init__.py")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] in ("True", "absent"), result.stdout


def pyproject_bounds() -> dict[str, str]:
    """Package -> its bound ('>=2.11'), over the dependencies and every extra, and Python's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    bounds = {"python": project["requires-python"]}
    for text in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        req = Requirement(text)
        bound = str(req.specifier)
        assert bounds.setdefault(req.name, bound) == bound, f"{req.name}: {bounds[req.name]} and {bound}"
    return bounds


def test_contributings_table_of_lower_bounds_is_pyprojects():
    """Each bound has a row saying what tested it (CONTRIBUTING, "Lower bounds"): a bound moved in
    pyproject.toml without its row, or a row left behind, fails here."""
    text = (REPO / "CONTRIBUTING.md").read_text().split("## Lower bounds", 1)[1].split("\n## ", 1)[0]
    table = dict(re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|", text, flags=re.M))
    assert table == pyproject_bounds()
