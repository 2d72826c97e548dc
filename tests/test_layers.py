"""The ground floor: imports point down only. Every import counts, at the top of a module, inside a
function or under TYPE_CHECKING: no two fastpt modules reach each other, nothing imports the
command fastpt.train, kernels/ knows nothing of fastpt, and fastpt knows nothing of bench or tests."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def module_files() -> dict[str, Path]:
    """Module name -> file, for fastpt/ and kernels/ (installed as fastpt.kernels)."""
    found = {}
    for root, prefix in ((REPO / "fastpt", "fastpt"), (REPO / "kernels", "fastpt.kernels")):
        for path in root.rglob("*.py"):
            if "kernels" in path.relative_to(root).parts[:1] and prefix == "fastpt":
                continue  # a checkout's fastpt/kernels link to kernels/ (see CONTRIBUTING)
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules `name` imports, anywhere in its file, resolved against `modules` (and bench, tests)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from fastpt.plan import planner` imports fastpt.plan.planner; `from x import name`, x
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in ("bench", "tests", "conftest"):
                out.add(target)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_two_modules_import_each_other():
    graph = import_graph()
    assert "fastpt.step" in graph and "fastpt.plan.planner" in graph  # the walk found the rooms
    assert (cycle := find_cycle(graph)) is None, " -> ".join(cycle)


def test_the_command_is_imported_by_nothing():
    importers = sorted(name for name, deps in import_graph().items() if "fastpt.train" in deps)
    assert importers == [], f"{importers} import fastpt.train: import what they need from fastpt.step"


def test_layers_point_down():
    for name, deps in import_graph().items():
        assert not {d for d in deps if d.split(".")[0] in ("bench", "tests", "conftest")}, name
        if name.startswith("fastpt.kernels"):
            assert all(d.startswith("fastpt.kernels") for d in deps), f"{name} imports {deps}"


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_command_starts_without_the_heavy_parts_of_torch():
    """`python -m fastpt.train --help` costs about `import torch`: DCP, DTensor and FSDP (~1.5 s),
    Inductor, Triton and transformers are imported where a run uses them, not at start-up."""
    heavy = ["torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp"]
    heavy += ["torch._inductor", "triton", "transformers"]
    check = f"import sys, fastpt.train; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout == "[]\n", f"imported by fastpt.train: {result.stdout}"
