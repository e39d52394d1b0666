"""The launch scripts import each other without cycles (module-level and deferred imports alike)."""

import ast
from pathlib import Path

LAUNCH = Path(__file__).parents[1] / "launch"


def launch_imports(path: Path) -> set[str]:
    """The ``launch.*`` modules that ``path`` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "launch":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("launch."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("launch.")}
    return found & {p.stem for p in LAUNCH.glob("*.py")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path of module names, or ``None``."""
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target] if target in path else [node, target]
            if target not in state:
                cycle = visit(target, path + [target])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_launch_modules_have_no_import_cycle():
    graph = {p.stem: launch_imports(p) - {p.stem} for p in LAUNCH.glob("*.py")}
    assert graph["starpo"] == {"demo_starpo", "demo_seeds"} and "starpo" not in graph["demo_starpo"] | graph["demo_seeds"]
    assert "tdd" not in graph["tdd_demo"]
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
