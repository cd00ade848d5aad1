"""The package's modules import one way, and none is longer than MAX_LINES.

The static import graph: every `.py` file under megatron_rlcorr/ is parsed with `ast` (nothing is
imported), and every `import`/`from ... import` statement anywhere in it is an edge, also ones
inside functions and under `if TYPE_CHECKING:` (a circle that only type checkers or a late call
walk is still a circle in the design). Only edges to `megatron_rlcorr.*` count.

Edge rules (a node is a module; a package is the node of its `__init__.py`):
- `import megatron_rlcorr.a.b` and `from megatron_rlcorr.a.b import x` (or the relative spelling)
  are edges to `megatron_rlcorr.a.b`, the module or package named.
- `from P import name`, where `P.name` is a submodule or subpackage, is an edge to `P.name` and not
  to `P`: `from . import b` inside pkg/a.py imports pkg/b.py. Python runs pkg/__init__.py before
  pkg.b either way, but pkg/__init__ has then already started (every submodule's import starts
  with its package's), so counting it would make every package that re-exports its submodules a
  circle that never happens.
- For the same reason, the implicit import of a module's parent packages is no edge; importing a
  package (`from ..rollout import EmbeddedEngine`) is an edge to that package's __init__, since
  that is where the name comes from.
- Imports whose module is computed at run time (importlib.import_module(f"...")) are not seen.
"""
from __future__ import annotations

import ast
from pathlib import Path

import megatron_rlcorr

ROOT = Path(megatron_rlcorr.__file__).parent
PACKAGE = "megatron_rlcorr"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _base(node: ast.ImportFrom, name: str, is_package: bool) -> str | None:
    """The absolute module `from <node.module> import ...` names inside module `name`."""
    if node.level == 0:
        return node.module
    package = name.split(".") if is_package else name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _targets(node: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = _base(node, name, is_package)
    if base is None:
        return set()
    subs = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
    if len(subs) < len(node.names):  # some names come from the module itself
        subs.add(base)
    return subs


def import_graph() -> dict[str, set[str]]:
    """Module -> the megatron_rlcorr modules it imports (rules in the docstring)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(tree):
            edges |= _targets(node, name, is_package, modules)
        graph[name] = {target for target in edges
                       if target in modules and target != name and target.split(".")[0] == PACKAGE}
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively (the graph has a few hundred nodes)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest chain start -> ... -> start inside one component (breadth first)."""
    parents, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & within):
                if child == start:
                    chain = [node]
                    while parents[chain[-1]] is not None:
                        chain.append(parents[chain[-1]])
                    return [start] + chain[::-1][1:] + [start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a component but on no cycle")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each module that is on any, without repeats."""
    found, seen = [], set()
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        for start in component:
            chain = _shortest_cycle(graph, start, set(component))
            key = frozenset(zip(chain, chain[1:]))
            if key not in seen:
                seen.add(key)
                found.append(chain)
    return found


def test_graph_sees_the_edges_it_should():
    graph = import_graph()
    # relative, from a subpackage, a package's re-export, function-local and TYPE_CHECKING imports
    assert "megatron_rlcorr.rl.async_rollout" in graph["megatron_rlcorr.rl.trainer"]
    assert "megatron_rlcorr.correction.core" in graph["megatron_rlcorr.correction"]
    assert "megatron_rlcorr.rollout" in graph["megatron_rlcorr.eval"]
    assert "megatron_rlcorr.rollout.vllm_engine" in graph["megatron_rlcorr.rollout"]  # inside make_engine
    assert "megatron_rlcorr.parallel.groups" in graph["megatron_rlcorr.rollout"]  # under TYPE_CHECKING
    # `from P import name` with P.name a submodule is an edge to the submodule only
    assert cycles({"p": {"p.a"}, "p.a": {"p.b"}, "p.b": set()}) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(chain) for chain in found)


def test_no_module_over_max_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"
