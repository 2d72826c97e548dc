"""Rules a linter does not know: the tests change torch's settings only through torch's own
`config.patch(...)`. pytest's monkeypatch restores a config entry by setattr/delattr on the module,
which a torch config module is not built for (pytest 9.2's undo deleted
torch._inductor.config.realize_acc_reads_threshold, and every later compiled plan in that worker
failed)."""

from __future__ import annotations

import ast
import re

from conftest import REPO

TORCH_CONFIG = re.compile(r"^torch(\.\w+)*\.config(\.|$)")
PATCHERS = ("setattr", "delattr", "setitem", "delitem")


def config_aliases(tree: ast.AST) -> set[str]:
    """The names a file binds to torch config modules (`import torch._inductor.config as c`,
    `from torch._dynamo import config`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if TORCH_CONFIG.match(a.name)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names if a.name == "config"}
    return names


def monkeypatched_torch_configs(source: str) -> list[str]:
    """`monkeypatch.setattr(...)`-style calls (any receiver named *monkeypatch* or mp) whose target is a
    torch config module, by alias, dotted path or "torch....config.name" string: as 'line: call'."""
    tree = ast.parse(source)
    aliases = config_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        receiver = ast.unparse(node.func.value)
        if node.func.attr not in PATCHERS or not ("monkeypatch" in receiver or receiver == "mp"):
            continue
        target = node.args[0]
        text = target.value if isinstance(target, ast.Constant) and isinstance(target.value, str) else None
        text = text if text is not None else ast.unparse(target)
        if text in aliases or TORCH_CONFIG.match(text):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_monkeypatches_a_torch_config_module():
    offenders = [
        f"{path.relative_to(REPO)}:{hit}"
        for folder in ("tests", "bench")
        for path in sorted((REPO / folder).rglob("*.py"))
        for hit in monkeypatched_torch_configs(path.read_text())
    ]
    assert not offenders, "use torch's config.patch(...) instead:\n" + "\n".join(offenders)


def test_the_rule_sees_every_spelling():
    source = """
import torch
import torch._inductor.config as inductor_config
from torch._dynamo import config
from fastpt import config as ours

def test(monkeypatch):
    monkeypatch.setattr(inductor_config, "realize_acc_reads_threshold", 2)
    monkeypatch.delattr(torch._inductor.config, "realize_reads_threshold")
    monkeypatch.setattr("torch._functorch.config.enable_autograd_cache", False)
    monkeypatch.setattr(config, "cache_size_limit", 1)
    monkeypatch.setattr(ours, "PRESETS", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with inductor_config.patch(fx_graph_cache=False):
        pass
"""
    assert [hit.split(":")[0] for hit in monkeypatched_torch_configs(source)] == ["8", "9", "10", "11"]


def test_test_files_stay_findable():
    """A test file past 700 lines holds more than one concern: split it by concern (CONTRIBUTING's
    map says where each kind of test lives)."""
    files = [*(REPO / "tests").glob("*.py"), *(REPO / "bench").glob("test_*.py")]
    long = {p.name: n for p in files if (n := len(p.read_text().splitlines())) > 700}
    assert not long, long
