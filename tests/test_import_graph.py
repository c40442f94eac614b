"""The package's modules import each other without a cycle.

The graph is read from the sources with ``ast`` (nothing is imported): one node per module of
``vsa2_rl`` (``vsa2_rl/``, with ``kernels/`` as ``vsa2_rl.kernels`` and ``rewards/`` as
``vsa2_rl.rewards``, as pyproject's ``package-dir`` installs them), one edge per ``import`` or
``from ... import`` of another of them, at module level or inside a function. ``from pkg import
name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg``.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"vsa2_rl": "vsa2_rl", "vsa2_rl.kernels": "kernels", "vsa2_rl.rewards": "rewards"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement reaches (``from a import b`` -> ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            anchor = anchor.rpartition(".")[0]
        base = f"{anchor}.{base}" if base else anchor
    return [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, name, path.name == "__init__.py"):
                while target and target not in modules:  # a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as its nodes in order, first one repeated at the end, or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            following = next(stack[-1], None)
            if following is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif following in on_path:
                return [*path[path.index(following) :], following]
            elif following not in done:
                path.append(following)
                on_path.add(following)
                stack.append(iter(sorted(graph[following])))
    return None


def test_find_cycle_reports_the_cycle_it_finds():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = {"d"}
    assert find_cycle(graph) is None


def test_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "vsa2_rl.kernels.segments" in graph["vsa2_rl.kernels.block_sparse"]  # relative
    assert "vsa2_rl.config" in graph["vsa2_rl.runtime"]  # module level
    assert "vsa2_rl.models.wan_bundle" in graph["vsa2_rl.runtime"]  # inside a function


def test_package_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
