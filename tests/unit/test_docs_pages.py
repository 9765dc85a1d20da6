"""The manual's generated pages say what the code and the results say."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mkdocs", reason="the docs extra is not installed")


def _hooks() -> Any:
    spec = importlib.util.spec_from_file_location("_docs_hooks", ROOT / "tools/docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_architecture_page_names_every_folder_and_its_modules() -> None:
    page = _hooks().architecture_markdown()
    for folder in (p.parent.name for p in (ROOT / "outbox").glob("*/__init__.py")):
        assert f"| `{folder}` |" in page
    assert "`outbox.dispatch.dispatcher`" in page
    assert "`outbox.store._sqlalchemy`" in page


def test_the_performance_page_is_the_results_files(tmp_path: Path) -> None:
    hooks = _hooks()
    assert "No results are recorded" in hooks.performance_markdown(tmp_path)
    run = {
        "meta": {"git": "abc1234", "versions": {"httpx": "0.28.1"}},
        "measurements": {
            "raw": {
                "name": "raw aiohttp",
                "unit": "ops/s",
                "values": [1.0, 3.0],
                "median": 2125.0,
                "n": 2000,
            }
        },
        "targets": [{"target": "dispatch / raw", "value": 0.9, "goal": ">= 0.8x", "met": True}],
        "skipped": {"postgres": "server unreachable"},
    }
    (tmp_path / "published-2026-12-01.json").write_text(json.dumps(run))
    page = hooks.performance_markdown(tmp_path)
    assert "## published-2026-12-01" in page
    assert "| raw aiohttp | 2,125.0 | ops/s | 2 | 2000 |" in page
    assert "| dispatch / raw | 0.90 | >= 0.8x | yes |" in page
    assert "skipped postgres: server unreachable" in page
    assert "git: `abc1234`" in page
