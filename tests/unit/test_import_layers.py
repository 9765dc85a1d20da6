"""The package's modules form layers, and each imports only from layers below it.

The import graph is read from the source with :mod:`ast`; nothing is imported to build
it. Three kinds of import are told apart:

* module-level imports: the dependency structure;
* ``if TYPE_CHECKING:`` imports: for annotations only, but a dependency all the same, so
  they obey the same order;
* imports inside a function ("lazy"): allowed only for start-up speed, and only of a
  third-party module (an optional extra such as prometheus_client, opentelemetry,
  starlette, django, alembic, or aiohttp/httpx kept off the CLI's start-up path) or of a
  package module in a *strictly lower* layer. A lazy import of the same or a higher layer
  is how a cycle hides, so it fails here.

A further check imports every module on its own, in a fresh interpreter with no
``outbox`` module loaded before it, so a module that only loads when something else was
imported first cannot hide either.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import outbox

PACKAGE_DIR = Path(outbox.__file__).resolve().parent

#: The layers, lowest first. A module belongs to the layer of the longest pattern that is
#: its name or a package prefix of it (``outbox.store.*``). Within one layer modules may
#: import each other (module level) as long as there is no cycle.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "outbox.version",
            "outbox.errors",
            "outbox.model",
            "outbox.clock",
            "outbox.logs",
            "outbox.failpoints",
            "outbox.durations",
            "outbox.safetext",
            "outbox.canonical",
            "outbox.body",
            "outbox.redact",
            "outbox.sending",
        ),
    ),
    ("config", ("outbox.config", "outbox.classify")),
    ("policy", ("outbox.policy",)),
    (
        "store: tables and rows",
        (
            "outbox.store.tables",
            "outbox.store.records",
            "outbox.store.rows",
            "outbox.store.statements",
            "outbox.store.changes",
            "outbox.store.marker",
            "outbox.store.busy",
        ),
    ),
    (
        "store: engines and schema",
        (
            "outbox.store.writelock",
            "outbox.store.liveness",
            "outbox.store.revisions",
            "outbox.store.engine",
            "outbox.store.migrate",
        ),
    ),
    (
        "store: operator queries",
        ("outbox.store.operator", "outbox.store.dispatching", "outbox.store.direct"),
    ),
    ("store: queries", ("outbox.store.base",)),
    ("store: commits", ("outbox.store.commit",)),
    (
        "store: dialects and reads",
        (
            "outbox.store.sqlite",
            "outbox.store.postgres",
            "outbox.store.browse",
            "outbox.store.monitoring",
        ),
    ),
    ("store", ("outbox.store",)),
    ("transport", ("outbox.exchange", "outbox.transport")),
    ("lookup", ("outbox.lookup",)),
    (
        "reconcile: reports and actions",
        ("outbox.parts", "outbox.status", "outbox.reconcile.reports", "outbox.reconcile.actions"),
    ),
    ("reconcile: probes", ("outbox.reconcile.probe",)),
    ("reconcile", ("outbox.reconcile", "outbox.bulk", "outbox.browse")),
    (
        "dispatch",
        (
            "outbox.observe",
            "outbox.metrics",
            "outbox.tracing",
            "outbox.heartbeat",
            "outbox.wakeup",
            "outbox.dbthread",
            "outbox.outcomes",
            "outbox.unresolved",
            "outbox.dispatch",
        ),
    ),
    ("client", ("outbox.aio", "outbox.transaction", "outbox.client")),
    (
        "applications",
        (
            "outbox.cli_support",
            "outbox.supervise",
            "outbox.checker",
            "outbox.demo",
            "outbox.testing",
            "outbox.console",
            "outbox.contrib",
        ),
    ),
    (
        "commands",
        (
            "outbox.cli.root",
            "outbox.cli.reading",
            "outbox.cli.dispatching",
            "outbox.cli.operator",
            "outbox.cli.tools",
        ),
    ),
    (
        "entry points",
        ("outbox.cli", "outbox.contrib.django.migrations", "outbox.contrib.django.management"),
    ),
    ("process", ("outbox.__main__", "outbox.cli.__main__")),
    ("package", ("outbox",)),
]


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    imported: str
    #: "module", "type-checking" or "lazy".
    kind: str
    line: int


def module_names() -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, me: str, is_package: bool) -> Iterator[str]:
    """The dotted names an import statement loads: ``import a.b`` loads ``a.b``;
    ``from a import b`` loads ``a`` and, if it is a module, ``a.b``."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        anchor = me.split(".") if is_package else me.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    if base != "outbox":  # running the top package's __init__ first is tolerated
        yield base
    for alias in node.names:
        yield f"{base}.{alias.name}"


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of a package module by ``name``, resolved to the modules it loads.

    Importing ``outbox.x`` runs the top package's ``__init__`` first; that implicit edge is
    left out, but naming the top package (``from outbox import __version__``) counts, and
    so does every other package's ``__init__``.
    """
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "type-checking")
                for stmt in child.orelse:
                    visit_stmt(stmt, kind)
                continue
            visit_stmt(child, kind)

    def visit_stmt(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            kind = "lazy" if kind == "module" else kind
        if isinstance(node, ast.Import | ast.ImportFrom):
            loaded: set[str] = set()
            for dotted in _targets(node, name, is_package):
                if dotted != "outbox" and not dotted.startswith("outbox."):
                    continue  # third-party
                target = resolve(dotted)
                if target is not None and target != name:
                    loaded.add(target)
            found.extend(Import(name, t, kind, node.lineno) for t in sorted(loaded))
        visit(node, kind)

    visit(ast.parse(path.read_text(encoding="utf-8")), "module")
    return found


def layer_of(name: str) -> int:
    matches = [
        (len(pattern), index)
        for index, (_, patterns) in enumerate(LAYERS)
        for pattern in patterns
        if name == pattern or name.startswith(pattern + ".")
    ]
    if not matches:
        raise LookupError(name)
    return max(matches)[1]


def violation(imp: Import) -> str | None:
    """Why this import breaks the order, or None."""
    mine, theirs = layer_of(imp.importer), layer_of(imp.imported)
    if imp.kind == "lazy":
        if theirs < mine:
            return None
        return (
            f"imports {imp.imported} inside a function ({LAYERS[theirs][0]} layer, not "
            f"strictly below {LAYERS[mine][0]}): a hidden cycle"
        )
    if theirs <= mine:
        return None
    return f"imports {imp.imported} ({imp.kind}), a higher layer ({LAYERS[theirs][0]})"


def graph() -> list[Import]:
    modules = module_names()
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def test_every_module_has_a_layer() -> None:
    missing = []
    for name in module_names():
        try:
            layer_of(name)
        except LookupError:
            missing.append(name)
    assert not missing, f"place these modules in LAYERS: {missing}"


def test_imports_follow_the_layers() -> None:
    found = []
    for imp in graph():
        why = violation(imp)
        if why is not None:
            found.append(f"{imp.importer}:{imp.line} {why}")
    assert not found, "\n".join(found)


def test_no_cycle_among_module_level_imports() -> None:
    edges: dict[str, set[str]] = {}
    for imp in graph():
        if imp.kind != "lazy":
            edges.setdefault(imp.importer, set()).add(imp.imported)
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_are_for() -> None:
    """The rules themselves: an upward import, a lazy same-layer import and a lazy import
    of a lower layer are told apart."""
    up = Import("outbox.config", "outbox.dispatch", "module", 1)
    assert violation(up) is not None
    hidden = Import("outbox.lookup", "outbox.lookup", "lazy", 1)
    assert violation(hidden) is not None
    lazy_up = Import("outbox.lookup", "outbox.reconcile", "lazy", 1)
    assert violation(lazy_up) is not None
    lazy_down = Import("outbox.client", "outbox.metrics", "lazy", 1)
    assert violation(lazy_down) is None
    down = Import("outbox.dispatch", "outbox.store.base", "type-checking", 1)
    assert violation(down) is None


_IMPORT_EACH = """
import importlib, json, sys
results = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "outbox" or m.startswith("outbox.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and not (exc.name == "outbox" or exc.name.startswith("outbox.")):
            results[name] = "extra not installed: " + exc.name
        else:
            results[name] = "error: " + repr(exc)
    except Exception as exc:
        results[name] = "error: " + repr(exc)
print(json.dumps(results))
"""


@pytest.mark.timeout(300)
def test_each_module_imports_on_its_own() -> None:
    """Each module imported first, with no other ``outbox`` module loaded before it."""
    names = sorted(module_names())
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps(names)],
        capture_output=True,
        text=True,
        check=True,
        timeout=280,
    )
    results: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    errors = {name: why for name, why in results.items() if why.startswith("error")}
    assert not errors, errors
