"""The layout's rules: no import cycles among the project's modules (imports inside functions
count too), the serving side imports nothing from benchmarks or training, and ruff is clean."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec", "coordinator", "drafter_service", "verifier_service")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {
        _module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "v1" not in p.relative_to(REPO).parts
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            targets |= {c for c in candidates if c in modules and c != name}
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_serving_needs_no_bench_or_train():
    graph = import_graph()
    serving = [m for m in graph if m.split(".")[0] in PACKAGES[1:] or m.startswith(("specdec.serving", "specdec.core"))]
    reached, todo = set(), list(serving)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    assert not [m for m in reached if m.startswith(("specdec.bench", "specdec.train"))]


def test_the_plain_servers_run_without_ray():
    """`python -m verifier_service`, `drafter_service` and `coordinator` serve where Ray is not
    installed (a GPU machine's image, say): their imports reach no Ray, the composition root included."""
    modules = ["verifier_service.server", "drafter_service.server", "coordinator.server", "specdec.serving.service_main", "specdec.app"]
    code = "import sys; sys.modules['ray'] = None\n" + "".join(f"import {m}\n" for m in modules)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


# Layers from the bottom: nothing imports a layer above its own, and the services (the two
# model services and the coordinator) know each other only by their protos. The composition root
# (`specdec.app`: the Serve app and the launcher; each package's `python -m` entry point) builds
# the services and wires them together.
LAYERS = ("core", "serving plumbing", "model services", "coordinator", "composition root", "cli, bench and training")


def layer_of(module: str) -> int:
    if module.endswith(".__main__") or module == "specdec.app" or module.startswith("specdec.app."):
        return 4
    if module == "specdec" or module.startswith(("specdec.cli", "specdec.bench", "specdec.train")):
        return 5
    for index, prefixes in (
        (3, ("coordinator",)), (2, ("drafter_service", "verifier_service")), (1, ("specdec.serving",)),
        (0, ("specdec.core", "specdec.data")),
    ):
        if module.startswith(prefixes):
            return index
    raise AssertionError(f"{module} belongs to no layer: place it in tests/test_layout.py LAYERS")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                found.append(f"{module} ({LAYERS[layer_of(module)]}) imports {target} ({LAYERS[layer_of(target)]})")
            elif {layer_of(module), layer_of(target)} <= {2, 3} and module.split(".")[0] != target.split(".")[0]:
                found.append(f"{module} imports another service's {target}")
    return found


def test_layers_import_downward_only():
    assert layering_violations(import_graph()) == []


def test_layer_check_catches_an_upward_import():
    graph = {
        "coordinator.server": {"drafter_service.server"}, "specdec.core.tree": {"coordinator.server"},
        "drafter_service.server": {"verifier_service.verifier"},
    }
    assert layering_violations(graph) == [
        "coordinator.server imports another service's drafter_service.server",
        "drafter_service.server imports another service's verifier_service.verifier",
        "specdec.core.tree (core) imports coordinator.server (coordinator)",
    ]



def test_ruff_is_clean_on_the_tree():
    """The rules pyproject.toml's [tool.ruff] names (line length 140 included)."""
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], capture_output=True, text=True, cwd=REPO)
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-1000:]
