"""The layers docs/architecture.md draws are the code's.

The drawing in its "The layers" section is read as data: each floor of the box (the rows
between its horizontal rules, top to bottom) holds the units (a subpackage `jobs/`, a top-level
module `config.py`) that start a cell's line. The imports are read from the source with `ast`
(every `import`, also inside functions and `TYPE_CHECKING` blocks), so the check needs nothing
installed and sees what a lazy import would hide from an import-time tracer.

A unit may import units on its own floor (drawn beside it) or below; none above. No two units
import each other, directly or round a loop. Every unit is drawn exactly once: a new package
must find its floor in the drawing, a renamed one must be renamed there.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "prorl_server"
DOC = ROOT / "docs" / "architecture.md"

KNOWN_UPWARD: dict[tuple[str, str], str] = {}
"""Imports up a floor that are known and scheduled to go. Each must still exist: once it is gone,
its entry goes too, so the list can only shrink."""

_DECLARED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:/|\.py))(?:\s|$)")


def units() -> set[str]:
    """prorl_server's subpackages (`jobs/`) and top-level modules (`app.py`)."""
    found = {f"{path.name}/" for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    found |= {path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    return found


def drawn_floors(text: str) -> list[list[str]]:
    """The units of each floor of the layer drawing, top first."""
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    top = next(i for i, line in enumerate(lines) if line.lstrip().startswith("┌"))
    bottom = next(i for i, line in enumerate(lines) if i > top and line.lstrip().startswith("└"))
    floors: list[list[str]] = [[]]
    for line in lines[top + 1 : bottom]:
        if line.lstrip().startswith("├"):
            floors.append([])
            continue
        for cell in line.split("│")[1:-1]:
            match = _DECLARED.match(cell.strip())
            if match:
                floors[-1].append(match.group(1))
    return floors


def unit_of(module: str) -> str | None:
    """The unit a dotted module name is in; "" for the root package, None outside prorl_server."""
    parts = module.split(".")
    if parts[0] != "prorl_server":
        return None
    if len(parts) == 1:
        return ""
    if (PACKAGE / parts[1] / "__init__.py").is_file():
        return f"{parts[1]}/"
    if (PACKAGE / f"{parts[1]}.py").is_file():
        return f"{parts[1]}.py"
    return None


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def imported_modules(path: Path) -> Iterator[str]:
    """Every module name `path` imports (for `from X import y`: X.y when that is a module, else X)."""
    name, is_package = _module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if unit_of(full) else base


def import_graph() -> dict[tuple[str, str], set[str]]:
    """(importing unit, imported unit) -> the modules (paths) whose imports make that edge."""
    edges: dict[tuple[str, str], set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit_of(_module_name(path)[0])
        assert source is not None
        for module in imported_modules(path):
            target = unit_of(module)
            if target is None or target == source:
                continue
            edges.setdefault((source, target), set()).add(str(path.relative_to(ROOT)))
    return edges


def cycles(edges: Mapping[tuple[str, str], object]) -> list[list[str]]:
    """The strongly connected groups of more than one unit (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for source, target in edges:
        graph.setdefault(source, []).append(target)
        graph.setdefault(target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def upward(edges: Mapping[tuple[str, str], set[str]], floors: list[list[str]]) -> dict[tuple[str, str], set[str]]:
    """The edges from a unit to one drawn above it (units not drawn are the drawing test's to report)."""
    floor_of = {unit: level for level, members in enumerate(floors) for unit in members}

    def climbs(importer: str, imported: str) -> bool:
        return importer in floor_of and imported in floor_of and floor_of[imported] < floor_of[importer]

    return {edge: where for edge, where in edges.items() if climbs(*edge)}


def test_every_unit_is_drawn_once_and_nothing_else() -> None:
    drawn = [unit for floor in drawn_floors(DOC.read_text()) for unit in floor]
    twice = sorted({unit for unit in drawn if drawn.count(unit) > 1})
    assert not twice, f"drawn on more than one line of docs/architecture.md's layers: {twice}"
    assert set(drawn) == units(), (
        f"not drawn in docs/architecture.md's layers: {sorted(units() - set(drawn))}; "
        f"drawn but not in prorl_server/: {sorted(set(drawn) - units())}"
    )


def test_no_unit_imports_one_drawn_above_it() -> None:
    up = upward(import_graph(), drawn_floors(DOC.read_text()))
    unknown = {edge: sorted(where) for edge, where in up.items() if edge not in KNOWN_UPWARD}
    assert not unknown, f"imports up a floor of docs/architecture.md's layers (importer, imported: modules): {unknown}"
    gone = sorted(set(KNOWN_UPWARD) - set(up))
    assert not gone, f"no longer imported up a floor, remove from KNOWN_UPWARD: {gone}"


def test_no_import_cycles_between_units() -> None:
    edges = {edge: where for edge, where in import_graph().items() if edge not in KNOWN_UPWARD}
    assert cycles(edges) == []


def _drawn_below(unit: str) -> list[str]:
    floors = drawn_floors(DOC.read_text())
    level = next(level for level, members in enumerate(floors) if unit in members)
    return [member for members in floors[level + 1 :] for member in members]


def _sources(unit: str) -> list[Path]:
    return sorted((PACKAGE / unit).rglob("*.py")) if unit.endswith("/") else [PACKAGE / unit]


def test_nothing_below_api_knows_about_grpc() -> None:
    knowing = [
        str(path.relative_to(ROOT))
        for unit in _drawn_below("api/")
        for path in _sources(unit)
        if any(module == "grpc" or module.startswith(("grpc.", "grpc_")) for module in imported_modules(path))
    ]
    assert knowing == []


def test_nothing_below_jobs_builds_a_protobuf_message() -> None:
    """A message is built by calling `v1.Name(...)`; an enum's `v1.Phase.Name(value)` is no message."""
    building = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for unit in _drawn_below("jobs/")
        for path in _sources(unit)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "v1"
    ]
    assert building == []


def test_the_client_package_never_imports_the_server() -> None:
    client = ROOT / "prorl_client" / "src" / "prorl_client"
    importing = [
        str(path.relative_to(ROOT))
        for path in sorted(client.rglob("*.py"))
        if any(unit_of(module) is not None for module in imported_modules(path))
    ]
    assert importing == []


def test_the_root_package_imports_nothing_of_its_own() -> None:
    assert [m for m in imported_modules(PACKAGE / "__init__.py") if unit_of(m) is not None] == []


def test_the_reading_finds_what_it_is_meant_to() -> None:
    """The graph and the checks on known imports, so that a reading that found nothing could not pass."""
    edges = import_graph()
    assert "prorl_server/gateway/app.py" in edges[("gateway/", "llm/")]
    assert ("api/", "errors.py") in edges  # `from prorl_server import errors`: the module, not the root
    assert ("cli.py", "datasets/") in edges  # imported inside a function
    assert "sandbox/" in _drawn_below("gateway/") and "jobs/" not in _drawn_below("gateway/")
    assert any(module == "grpc" for module in imported_modules(PACKAGE / "api" / "errors.py"))
    assert cycles({("a/", "b/"): 1, ("b/", "c/"): 1, ("c/", "a/"): 1, ("c/", "d/"): 1}) == [["a/", "b/", "c/"]]
    floors = [["top.py"], ["mid/", "side/"], ["low/"]]
    found = upward({("low/", "mid/"): {"x"}, ("mid/", "side/"): {"y"}, ("top.py", "low/"): {"z"}}, floors)
    assert found == {("low/", "mid/"): {"x"}}
