"""The package's folders are layers: imports point down, and the module graph has no loop.

Every import counts, at the top of a module, inside a function, or under ``TYPE_CHECKING``:
a lower room that needs a higher one holds a concept in the wrong room.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "launcher"

#: lowest first; the package's own root modules (errors, waits) sit below every folder
LAYERS = ["", "host", "server", "config", "deploy", "install", "watch", "reports", "bench", "cli"]
#: the entry point imports the CLI and the unit's two standard-library paths
TOP = {"launcher.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            # the longest known prefix: launcher.host.proc.run -> launcher.host.proc
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("launcher") and name != "launcher":
                found.add(name)
    # `from launcher.host import proc` names the folder too: an empty __init__ is no import
    return found - empty_packages() - {module_name(path)}


FOLDERS = {f"launcher.{f}" for f in LAYERS if f}


@functools.cache
def empty_packages() -> frozenset[str]:
    return frozenset(
        module_name(p) for p in PACKAGE.rglob("__init__.py") if not p.read_text().strip()
    )


def layer(module: str) -> int:
    if module == "launcher":
        return 0
    parts = module.split(".")
    folder = parts[1] if len(parts) > 2 or f"launcher.{parts[1]}" in FOLDERS else ""
    return LAYERS.index(folder)


@functools.cache
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, known) for name, path in mods.items()}


def test_every_module_sits_in_a_known_folder() -> None:
    strays = [
        m for m in modules() if m not in TOP and m.count(".") > 1 and m.split(".")[1] not in LAYERS
    ]
    assert strays == []


@pytest.mark.parametrize("module", sorted(set(modules()) - TOP))
def test_imports_point_down(module: str) -> None:
    here = layer(module)
    upward = sorted(t for t in graph()[module] if t not in TOP and layer(t) > here)
    assert upward == [], f"{module} ({LAYERS[here] or 'root'}) imports higher rooms: {upward}"


def test_the_module_graph_has_no_loop() -> None:
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1:
                loops.append([*stack[stack.index(t) :], t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert loops == []


def _imported_at_load(module: str, target: str) -> bool:
    """Whether ``module`` imports ``target`` when it is loaded (top level, not in a function
    or under ``TYPE_CHECKING``)."""
    tree = ast.parse(modules()[module].read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            if target in names:
                return True
        elif isinstance(node, ast.Import) and target in {a.name for a in node.names}:
            return True
    return False


#: The entry points of the unit's ``python -S`` paths (``exec``, ``prestart``).
LEAN_ENTRIES = ("launcher.host.launch", "launcher.install.prestart")


def loaded_by_lean_paths() -> set[str]:
    """The package's modules ``python -S -m launcher exec`` and ``prestart`` load: what the
    entry points import at load time, the entry point ``launcher.__main__`` and the
    packages holding them (their ``__init__`` runs first)."""
    g = graph()
    seen: set[str] = set()
    todo = list(LEAN_ENTRIES)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += [t for t in g[m] if _imported_at_load(m, t)]
    packages = {".".join(m.split(".")[:n]) for m in seen for n in range(1, m.count(".") + 1)}
    return seen | packages | {"launcher.__main__"}


def test_the_units_standard_library_paths_import_only_the_standard_library() -> None:
    """``python -S -m launcher exec`` and ``prestart`` (the unit's ExecStart and
    ExecStartPre) run without site-packages: their modules may import nothing but the
    standard library and each other."""
    allowed = {
        "launcher",
        "launcher.__main__",
        "launcher.deploy",
        "launcher.host",
        "launcher.host.launch",
        "launcher.host.envfile",
        "launcher.install",
        "launcher.install.prestart",
        "launcher.deploy.store",
        "launcher.deploy.restart",
        "launcher.deploy.restart.front",
        "launcher.deploy.restart.admission",
        "launcher.deploy.restart.lane",
        "launcher.host.proc",
        "launcher.host.systemd",
        "launcher.host.units",
        "launcher.errors",
    }
    seen = loaded_by_lean_paths()
    assert seen <= allowed, f"the python -S paths load {sorted(seen - allowed)}"


@pytest.mark.parametrize("module", sorted(loaded_by_lean_paths()))
def test_what_the_python_s_paths_load_imports_no_third_party_module_at_load(module: str) -> None:
    """Every module the unit's ``python -S`` paths load imports, when it is loaded, only the
    standard library and the package (a third-party import fails there: no site-packages).
    An import inside a function (``from launcher import waits``, tenacity's, for the lock
    wait) runs only where the function is called, which these paths never do."""
    tree = ast.parse(modules()[module].read_text())
    allowed = sys.stdlib_module_names | {"launcher", "__future__"}
    outside = sorted(n for n in _load_time_imports(tree.body) if n.split(".")[0] not in allowed)
    assert outside == [], f"{module} imports {outside} when it is loaded"


def _load_time_imports(body: list[ast.stmt]) -> Iterator[str]:
    """The modules the statements import when they run: at the top level, in ``if``,
    ``try`` and ``with`` blocks and class bodies, not in functions nor under
    ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module if node.module and not node.level else "launcher"
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                yield from _load_time_imports(node.body)
            yield from _load_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _load_time_imports(block)
            for handler in node.handlers:
                yield from _load_time_imports(handler.body)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from _load_time_imports(node.body)
