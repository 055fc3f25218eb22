"""The import graph of `src/hspec` is layered: each floor imports only floors below it, no circles.

Read with `ast`, not by importing, so every import counts: module level, inside functions (lazy
imports) and under `TYPE_CHECKING`. A unit is a subpackage (`hspec/drafters/...` -> `drafters`) or
a top-level module (`hspec/runtime.py` -> `runtime`). Units on one floor may import each other as
long as that makes no circle. See docs/design.md#layers-of-the-code for why the floors are these.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hspec"

# Lowest floor first. A new subpackage or top-level module must be given a floor here.
FLOORS: tuple[tuple[str, ...], ...] = (
    # no model code; `data`: task and prompt files; `console`: where a command's output goes (`--json`);
    # `durable`: writes a kill cannot leave half done
    ("registry", "metrics", "machine", "provenance", "console", "data", "cache", "durable"),
    ("models", "ssm"),  # the target runtime (over the KV pool) and the Mamba-2 reference
    ("sampling",),  # sampling transforms shared by the target's and the drafters' logits
    ("drafters",),  # the Drafter interface, every kind, drafter checkpoints
    ("decoding", "runtime"),  # the step, verification, the generate loop; names -> loaded objects
    ("serving", "training", "eval", "bench", "integrations"),  # built on a decoder; `integrations`: vLLM
    ("lab",),  # research tooling over evaluations (claims, shard merges, tables): never imported by the library
    ("cli", "demo", "__init__"),  # entry points
)
LAB_FLOOR = next(i for i, floor in enumerate(FLOORS) if floor == ("lab",))
# Units that serve inference (generate, serve) and so must never reach the training code: floors 0-4,
# the server and the vLLM plugin (docs/design.md#layers-of-the-code).
INFERENCE = tuple(unit for floor in FLOORS[:5] for unit in floor) + ("serving", "integrations")


def _unit(module: str) -> str:
    """`hspec.drafters.hspec.model` -> `drafters`; `hspec.runtime` -> `runtime`; `hspec` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """hspec modules `path` imports (`from hspec.x import y` counts as hspec.x.y when y is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "hspec")
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != "hspec":
                continue
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                is_module = (SRC.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (SRC.parent / Path(*sub.split(".")) / "__init__.py").exists()
                found.add(sub if is_module else name)
    return found


def module_graph() -> dict[str, set[str]]:
    """Every hspec module -> the hspec modules it imports."""
    graph = {}
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        graph[module] = _imports(path, module) - {module}
    return graph


def unit_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the module edges that make that arrow (for the failure message)."""
    units: dict[str, dict[str, set[str]]] = {}
    for module, imported in graph.items():
        arrows = units.setdefault(_unit(module), {})
        for other in imported:
            if _unit(other) != _unit(module):
                arrows.setdefault(_unit(other), set()).add(f"{module} -> {other}")
    return units


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle in a directed graph as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for root in sorted(edges):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(edges.get(root, ())))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


FLOOR_OF = {unit: i for i, floor in enumerate(FLOORS) for unit in floor}
GRAPH = module_graph()
UNITS = unit_graph(GRAPH)


def test_find_cycle_finds_and_clears():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_every_unit_has_a_floor():
    missing = sorted(set(UNITS) - set(FLOOR_OF))
    assert not missing, f"give {missing} a floor in FLOORS (tests/test_layering.py)"


def test_no_upward_arrow():
    upward = [f"{unit} (floor {FLOOR_OF[unit]}) imports {other} (floor {FLOOR_OF[other]}): {sorted(why)}"
              for unit, arrows in sorted(UNITS.items()) for other, why in sorted(arrows.items())
              if unit in FLOOR_OF and other in FLOOR_OF and FLOOR_OF[other] > FLOOR_OF[unit]]
    assert not upward, "imports against the floors:\n" + "\n".join(upward)


def test_no_circle_between_units():
    cycle = find_cycle({unit: set(arrows) for unit, arrows in UNITS.items()})
    assert cycle is None, f"units import each other in a circle: {' -> '.join(cycle or [])}"


def test_no_circle_between_modules():
    cycle = find_cycle(GRAPH)
    assert cycle is None, f"modules import each other in a circle: {' -> '.join(cycle or [])}"


@pytest.mark.parametrize("unit", INFERENCE)
def test_inference_never_reaches_training(unit):
    """Follow imports transitively from every module of `unit`: none may be hspec.training."""
    seen: set[str] = set()
    todo = [m for m in GRAPH if _unit(m) == unit]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(GRAPH.get(module, ()))
    reached = sorted(m for m in seen if _unit(m) == "training")
    assert not reached, f"{unit} reaches the training code: {reached}"


def test_the_lab_has_a_floor_of_its_own_above_the_library():
    """Everything below the lab is the library a user installs; only the command line sits above the lab,
    and within the command line only its lab group and the commands that hand lab code to the library
    (`hspec eval`'s findings) import it."""
    assert FLOORS[LAB_FLOOR] == ("lab",) and set(FLOORS[LAB_FLOOR + 1:][0]) == {"cli", "demo", "__init__"}
    library = [unit for floor in FLOORS[:LAB_FLOOR] for unit in floor]
    into_lab = sorted(edge for unit in library for edge in UNITS.get(unit, {}).get("lab", ()))
    assert not into_lab, f"the library imports the lab: {into_lab}"
    cli_into_lab = sorted({module for module, imported in GRAPH.items()
                           if _unit(module) == "cli" and any(_unit(m) == "lab" for m in imported)})
    assert cli_into_lab == ["hspec.cli.evaluate", "hspec.cli.lab"], cli_into_lab
