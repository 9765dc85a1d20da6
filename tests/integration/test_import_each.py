"""Each module of the package imports on its own, in a fresh interpreter with no
``outbox`` module loaded before it, so a module that only loads when something else was
imported first cannot hide.

An integration test: it starts an interpreter and imports every module (about 20 s), too
slow for the unit tier; the import graph's own checks stay in
``tests/unit/test_import_layers.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.unit.test_import_layers import module_names

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
