"""The package's modules form layers, and each imports only from layers below it.

The import graph is read from the source with :mod:`ast`; nothing is imported to build
it. Three kinds of import are told apart:

* module-level imports: the dependency structure;
* ``if TYPE_CHECKING:`` imports: for annotations only, but a dependency all the same, so
  they obey the same order;
* imports inside a function ("lazy"): allowed only for start-up speed, of a third-party
  module (an optional extra such as prometheus_client, opentelemetry, starlette, django,
  alembic, or aiohttp/httpx kept off the CLI's start-up path) or of a package module in
  the same or a lower layer, and never one that closes a cycle (that is how a cycle hides).

A further check, ``tests/integration/test_import_each.py`` (it starts an interpreter, so
it is not a unit test), imports every module on its own, so a module that only loads when
something else was imported first cannot hide either.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import outbox

PACKAGE_DIR = Path(outbox.__file__).resolve().parent

#: The layers, lowest first, are the package's folders. Every subpackage of ``outbox`` is
#: one layer, named here once; the top-level modules are the vocabulary (at the bottom)
#: except the facade's, which sit above dispatching. Within one layer modules may import
#: each other at module level as long as there is no cycle. The architecture page of the
#: manual is drawn from this list and the graph below.
FOLDERS: list[tuple[str, str]] = [
    ("base", "foundation helpers: structured logs, safe terminal text"),
    ("store", "the only place that writes SQL"),
    ("wire", "one HTTP exchange: build, send, read, classify, redact, look up"),
    ("reconcile", "the reconciliation queue, operator figures and bulk actions"),
    ("observe", "hooks, Prometheus metrics, OpenTelemetry traces"),
    ("dispatch", "the dispatcher loop and everything it runs"),
    ("checker", "check-receiver: what a receiver does with a key"),
    ("testing", "the test receiver and the pytest plugin"),
    ("receiver", "the receiver kit: receipts beside the effect, for teams owning both sides"),
    ("console", "the web console"),
    ("contrib", "framework integrations (Django)"),
    ("cli", "the operator's commands"),
]
#: Top-level modules above dispatching: the facade and the deprecated aliases of moved
#: modules. Every other top-level module is vocabulary.
FACADE = ("client", "aio", "transaction", "metrics", "tracing", "transport")
#: Entry points that load commands: above everything they start.
ENTRY_POINTS = (
    "outbox.contrib.django.migrations",
    "outbox.contrib.django.management",
    "outbox.__main__",
    "outbox.cli.__main__",
)


def _layers() -> list[tuple[str, tuple[str, ...]]]:
    top = sorted(
        f"outbox.{p.stem}"
        for p in PACKAGE_DIR.glob("*.py")
        if p.stem not in {"__init__", "__main__", *FACADE}
    )
    folders = [(name, (f"outbox.{name}",)) for name, _ in FOLDERS]
    apps = folders.index(("checker", ("outbox.checker",)))
    return [
        ("vocabulary", tuple(top)),
        *folders[:apps],
        ("facade", tuple(f"outbox.{m}" for m in FACADE)),
        *folders[apps:],
        ("entry points", ENTRY_POINTS),
        ("package", ("outbox",)),
    ]


#: A module belongs to the layer of the longest pattern that is its name or a package
#: prefix of it (``outbox.store.*``).
LAYERS: list[tuple[str, tuple[str, ...]]] = _layers()


def test_every_folder_is_a_layer() -> None:
    subpackages = {p.parent.name for p in PACKAGE_DIR.glob("*/__init__.py")}
    named = {name for name, _ in FOLDERS}
    assert subpackages == named, "name each subpackage once in FOLDERS"


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
    """Why this import breaks the order, or None. A lazy import of the same layer is
    judged by :func:`test_no_cycle_even_through_lazy_imports`."""
    mine, theirs = layer_of(imp.importer), layer_of(imp.imported)
    if imp.kind == "lazy":
        if theirs <= mine:
            return None
        return (
            f"imports {imp.imported} inside a function ({LAYERS[theirs][0]} layer, above "
            f"{LAYERS[mine][0]}): a hidden cycle"
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


def _cycles(kinds: set[str]) -> list[list[str]]:
    edges: dict[str, set[str]] = {}
    for imp in graph():
        if imp.kind in kinds:
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
    return cycles


def test_no_cycle_among_module_level_imports() -> None:
    cycles = _cycles({"module", "type-checking"})
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_cycle_even_through_lazy_imports() -> None:
    """A lazy import (start-up speed) within one layer is allowed, but never one that
    closes a cycle: that is how a cycle hides."""
    cycles = _cycles({"module", "type-checking", "lazy"})
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_are_for() -> None:
    """The rules themselves: an upward import and a lazy upward import are refused; a lazy
    import of the same or a lower layer is left to the cycle check."""
    up = Import("outbox.config", "outbox.dispatch.dispatcher", "module", 1)
    assert violation(up) is not None
    lazy_up = Import("outbox.wire.lookup", "outbox.reconcile", "lazy", 1)
    assert violation(lazy_up) is not None
    lazy_same = Import("outbox.cli.tools", "outbox.cli.demo", "lazy", 1)
    assert violation(lazy_same) is None
    lazy_down = Import("outbox.client", "outbox.observe.metrics", "lazy", 1)
    assert violation(lazy_down) is None
    down = Import("outbox.dispatch.dispatcher", "outbox.store.base", "type-checking", 1)
    assert violation(down) is None
    assert layer_of("outbox.config") < layer_of("outbox.store.base") < layer_of("outbox.cli")
