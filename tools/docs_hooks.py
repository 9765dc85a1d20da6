"""MkDocs hooks: pages generated from the code and the benchmark results, and a nav that
tolerates guide pages not written yet.

* ``architecture.md`` is drawn from ``tests/unit/test_import_layers.py`` (its ``LAYERS``,
  ``FOLDERS`` and ``graph()``), so the map of the layers cannot drift from the code.
* ``performance.md`` is a table of every ``benchmarks/results/*.json`` (newest first);
  nothing on it is typed by hand. Local runs are ignored by git; a run copied to
  ``benchmarks/results/published-<date>.json`` is committed and shown by every build.
* A ``nav`` entry under ``guide/`` whose file does not exist yet is dropped, so the
  guide pages written on other branches can be listed before they are merged.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def _layer_test() -> Any:
    path = ROOT / "tests" / "unit" / "test_import_layers.py"
    spec = importlib.util.spec_from_file_location("_outbox_import_layers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def architecture_markdown() -> str:
    layers = _layer_test()
    described = dict(layers.FOLDERS)
    edges: dict[tuple[int, int], int] = defaultdict(int)
    modules: dict[int, set[str]] = defaultdict(set)
    for name in layers.module_names():
        modules[layers.layer_of(name)].add(name)
    for imp in layers.graph():
        mine, theirs = layers.layer_of(imp.importer), layers.layer_of(imp.imported)
        if imp.kind != "lazy" and mine != theirs:
            edges[(mine, theirs)] += 1
    names = [name for name, _ in layers.LAYERS]
    out = [
        "# Architecture",
        "",
        "Generated at build time from the package's own import graph, read by "
        "`tests/unit/test_import_layers.py` (the test that enforces it): a module imports "
        "only from its own layer or a lower one.",
        "",
        "## Layers, lowest first",
        "",
        "| # | layer | what it holds | modules |",
        "|---|---|---|---|",
    ]
    for index, (name, patterns) in enumerate(layers.LAYERS):
        what = described.get(
            name,
            ", ".join(f"`{p}`" for p in patterns)
            if name != "vocabulary"
            else "errors, model, clock, durations, canonical, config, ...",
        )
        out.append(f"| {index} | `{name}` | {what} | {len(modules[index])} |")
    out += [
        "",
        "## Who imports whom (module-level and type-checking imports)",
        "",
        "```mermaid",
        "graph BT",
    ]
    out += [f'  L{i}["{n}"]' for i, n in enumerate(names)]
    out += [f"  L{a} -->|{n}| L{b}" for (a, b), n in sorted(edges.items())]
    out += ["```", "", "## Modules per layer", ""]
    for index, name in enumerate(names):
        listed = ", ".join(f"`{m}`" for m in sorted(modules[index]))
        out.append(f"* **{name}**: {listed or '(none)'}")
    return "\n".join(out) + "\n"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 10 else f"{value:,.1f}"
    return "" if value is None else str(value)


def performance_markdown(directory: Path = ROOT / "benchmarks" / "results") -> str:
    results = sorted(directory.glob("*.json"), reverse=True)
    out = [
        "# Performance",
        "",
        "Generated at build time from `benchmarks/results/*.json`, written by "
        "`python -m benchmarks run` (`make bench`). Nothing here is typed by hand: run the "
        "benchmarks and rebuild. The host's speed drifts, so compare ratios within one run.",
        "",
    ]
    if not results:
        out.append("No results are recorded in this checkout yet: `make bench` writes one.")
    for path in results:
        data = json.loads(path.read_text())
        meta = data.get("meta", {})
        out += [f"## {path.stem}", ""]
        if meta:
            flat = {k: v for k, v in meta.items() if not isinstance(v, dict | list)}
            out += [", ".join(f"{k}: `{v}`" for k, v in flat.items()), ""]
            if isinstance(meta.get("versions"), dict):
                out += [
                    "Versions: " + ", ".join(f"{k} `{v}`" for k, v in meta["versions"].items()),
                    "",
                ]
        if data.get("targets"):
            out += ["| target | value | goal | met |", "|---|---|---|---|"]
            for t in data["targets"]:
                met = "yes" if t.get("met") else "no"
                out.append(
                    f"| {t.get('target')} | {_fmt(t.get('value'))} | {t.get('goal')} | {met} |"
                )
            out.append("")
        out += ["| measurement | median | unit | runs | n |", "|---|---|---|---|---|"]
        for key, m in sorted(data.get("measurements", {}).items()):
            out.append(
                f"| {m.get('name', key)} | {_fmt(m.get('median'))} | {m.get('unit', '')} "
                f"| {len(m.get('values', []))} | {_fmt(m.get('n'))} |"
            )
        for label, why in data.get("skipped", {}).items():
            out.append(f"\n* skipped {label}: {why}")
        out.append("")
    return "\n".join(out) + "\n"


def _tolerant(nav: list[Any], docs_dir: Path) -> list[Any]:
    kept: list[Any] = []
    for item in nav:
        if isinstance(item, dict):
            ((title, value),) = item.items()
            if isinstance(value, list):
                kept.append({title: _tolerant(value, docs_dir)})
            elif (
                isinstance(value, str)
                and value.startswith("guide/")
                and not (docs_dir / value).exists()
            ):
                continue
            else:
                kept.append(item)
        else:
            kept.append(item)
    return kept


def on_config(config: Any) -> Any:
    config["nav"] = _tolerant(config["nav"], Path(config["docs_dir"]))
    return config


def on_files(files: Files, config: Any) -> Files:
    for name, text in (
        ("architecture.md", architecture_markdown()),
        ("performance.md", performance_markdown()),
    ):
        files.append(File.generated(config, name, content=text))
    return files
