"""The installed distribution owns no top-level import name of another distribution's: kernels/ is
fastpt.kernels through the link fastpt/kernels -> ../kernels (a namespace portion, no __init__.py, so
that `import kernels` is never fastpt's code), and bench/ runs from the checkout only."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# What a process reports of the kernels it got: the api module's file and its folder, resolved.
WHERE = "import fastpt.kernels.api as k, os; print(os.path.realpath(k.__file__))"


def test_every_installed_package_is_under_fastpt_and_kernels_is_a_link():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"] and all(p == "fastpt" or p.startswith("fastpt.") for p in setuptools["packages"])
    assert "package-dir" not in setuptools  # a mapping sends an editable install's fastpt.kernels to its own tree
    assert os.readlink(REPO / "fastpt" / "kernels") == "../kernels"
    assert not (REPO / "kernels" / "__init__.py").exists()


def python(code: str, cwd: Path, *path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`code` in a new interpreter started in `cwd` (so cwd is first on sys.path, as for `python -m`
    there), with `path` added after it (site dirs: their .pth files, editable finders, are run)."""
    sites = "".join(f"site.addsitedir({str(p)!r}); " for p in path)
    return subprocess.run(
        [sys.executable, "-c", f"import site, sys; {sites}\n{code}"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**(env or os.environ), "PYTHONPATH": ""},
    )


def copy_checkout(dest: Path) -> Path:
    """What an install needs of this checkout, the link included."""
    for name in ("fastpt", "kernels"):
        shutil.copytree(REPO / name, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    return dest


def test_another_top_level_kernels_package_does_not_touch_fastpt(tmp_path):
    """Hugging Face's `kernels` (or any) first on sys.path: fastpt trains on its own kernels."""
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("raise ImportError('the other kernels package was imported')\n")
    code = f"sys.path.insert(0, {str(tmp_path)!r}); import fastpt.model; assert 'kernels' not in sys.modules; {WHERE}"
    result = python(code, REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(REPO / "kernels" / "api.py")


def import_kernels(tmp_path: Path, *roots: Path, other: bool) -> subprocess.CompletedProcess:
    """`import kernels` in a process whose sys.path starts with `roots` (checkouts' roots, as `python -m`
    or pytest there), then another `kernels` package (a stand-in for Hugging Face's) if `other`, or no
    site-packages at all; prints where `kernels` and its `hub` came from, and every module loaded from
    a fastpt checkout's kernels/ folder."""
    site = tmp_path / "site"
    if other:
        (site / "kernels").mkdir(parents=True)
        (site / "kernels" / "__init__.py").write_text("CUDAProperties = object\n")
        (site / "kernels" / "hub.py").write_text("NAME = 'the hub module'\n")
    folders = [str(root / "kernels") for root in roots]
    code = (
        f"sys.path[:] = {[str(r) for r in roots]!r} + ([{str(site)!r}] if {other} else [])"
        " + [p for p in sys.path if 'site-packages' not in p]\n"
        "import kernels\n"
        "hub = __import__('kernels.hub').hub.NAME if hasattr(kernels, 'CUDAProperties') else None\n"
        "ours = [m for m in sys.modules.values() if any(str(getattr(m, '__file__', None)).startswith(f)"
        f" for f in {folders!r})]\n"
        "print(getattr(kernels, '__file__', None), hub, ours, hasattr(kernels, 'rms_norm'), sep='\\n')"
    )
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return python(code, cwd)


def test_import_kernels_from_the_root_gets_the_other_distributions_package(tmp_path):
    """The folder is no regular package, so the next `kernels` on sys.path wins (transformers imports
    Hugging Face's by that name), its submodules included."""
    result = import_kernels(tmp_path, REPO, other=True)
    assert result.returncode == 0, result.stderr
    theirs, hub, ours, has_ops = result.stdout.split("\n")[:4]
    assert theirs == str(tmp_path / "site" / "kernels" / "__init__.py") and hub == "the hub module"
    assert ours == "[]" and has_ops == "False"


def test_import_kernels_from_the_root_without_another_runs_none_of_fastpt(tmp_path):
    """With no other `kernels` installed, the folder is an empty namespace: nothing of fastpt's runs."""
    result = import_kernels(tmp_path, REPO, other=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:4] == ["None", "None", "[]", "False"]


def test_two_checkouts_on_the_path_import_kernels_and_fastpt(tmp_path):
    """Two checkouts' roots on sys.path (the old stand-aside recursed there): `import kernels` is
    neither's code, and fastpt.kernels is the first checkout's own."""
    second = copy_checkout(tmp_path / "second")
    result = import_kernels(tmp_path, REPO, second, other=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[2:4] == ["[]", "False"]
    result = python(f"sys.path.insert(1, {str(second)!r}); {WHERE}", REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(REPO / "kernels" / "api.py") and not result.stderr


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args],
        check=True,
        capture_output=True,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )


@pytest.mark.slow
def test_a_normal_install_runs_from_the_clone_root_and_from_anywhere(tmp_path):
    """`pip install .` then a command run from the clone's root (whose fastpt/ shadows the installed
    one: it once had no kernels there), and from anywhere else (the wheel's copy of kernels/)."""
    checkout = copy_checkout(tmp_path / "clone")
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(checkout))
    site = tmp_path / "site"
    zipfile.ZipFile(next((tmp_path / "wheel").glob("fastpt-*.whl"))).extractall(site)
    assert (site / "fastpt" / "kernels" / "api.py").is_file() and not (site / "fastpt" / "kernels").is_symlink()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"sys.path[:] = [p for p in sys.path if 'site-packages' not in p or p == {str(site)!r}] + sys.path; {WHERE}"
    for cwd, expected in ((checkout, checkout / "kernels"), (tmp_path, site / "fastpt" / "kernels")):
        result = python(code, cwd, site, env=env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == str(expected / "api.py") and not result.stderr


@pytest.mark.slow
def test_an_editable_install_run_from_another_checkout_uses_that_checkouts_kernels(tmp_path):
    """Checkout A installed editable, a command run from checkout B: B's fastpt with B's kernels (the
    old package-dir mapping gave it A's); B without its link gets A's through A's editable finder,
    and fastpt says so loudly; with no kernels found at all it says how to restore the link."""
    a, b = copy_checkout(tmp_path / "a"), copy_checkout(tmp_path / "b")
    prefix = tmp_path / "prefix"
    pip("install", "--no-deps", "--no-build-isolation", "--prefix", str(prefix), "-e", str(a))
    (site,) = prefix.glob("lib/python*/site-packages")
    result = python(WHERE, b, site)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(b / "kernels" / "api.py") and not result.stderr
    (b / "fastpt" / "kernels").unlink()
    (b / "fastpt" / "kernels").write_text("../kernels")  # what git writes for a link with core.symlinks off
    result = python(WHERE, b, site)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(a / "kernels" / "api.py")
    assert "fastpt: WARNING: fastpt's kernels come from another tree" in result.stderr
    assert str(a / "kernels") in result.stderr and str(b / "fastpt") in result.stderr
    result = python(WHERE, b)
    assert result.returncode == 1 and "git config core.symlinks true" in result.stderr


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
        "print(not str(kernels.__file__).startswith(sys.argv[2]), md.version('transformers'), md.version('kernels'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(REPO / "kernels")],
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
