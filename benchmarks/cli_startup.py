"""How long ``outbox status`` and ``outbox reconcile show`` take, start to exit, on SQLite.

Runs each command N times as a fresh process, interleaving the trees compared (so a busy
machine slows both alike), and prints medians and the ratio. Usage:

    python benchmarks/cli_startup.py [--runs 15] [--before DIR]

``--before DIR``: a checkout of an older outbox (e.g. ``git archive main | tar -x -C DIR``),
put first on PYTHONPATH for the "before" runs.

Each tree runs with its bytecode compiled and cached (in a private ``PYTHONPYCACHEPREFIX``,
warmed by one untimed run), as an installed package has it: ``pip install`` compiles the
``.pyc`` files, and an environment with ``PYTHONDONTWRITEBYTECODE`` set would otherwise
recompile every outbox module on every run (~60 ms CPU here), which measures the set-up, not
the CLI.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PREPARE = """
import sys
from outbox import Endpoint, Outbox
with Outbox(sys.argv[1], endpoints=[Endpoint(name="api", base_url="http://127.0.0.1:9")]) as ob:
    ob.enqueue(endpoint="api", method="POST", path="/x", json={"n": 1}, operation_id="op-1")
"""


def _prepare(directory: Path, pythonpath: str | None) -> str:
    """A database made by the tree's own code (its own schema version), one operation."""
    url = f"sqlite:///{directory / 'outbox.sqlite3'}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    subprocess.run([sys.executable, "-c", _PREPARE, url], env=env, check=True, cwd=directory)
    return url


def _time(command: list[str], pythonpath: str | None, pycache: Path) -> tuple[float, float]:
    """Wall-clock and CPU (user + system) seconds of one run of ``command``.

    Run from the temporary directory, never from a checkout: ``python -m`` puts the
    working directory first on ``sys.path``, ahead of ``PYTHONPATH``, so a run started
    in one tree would time that tree's code for both sides."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(pycache / (pythonpath or "installed").strip("/"))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True, cwd=pycache.parent)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--before", default=None)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        python = sys.executable
        commands = {
            "python -c pass": [python, "-c", "pass"],
            "outbox status": [python, "-m", "outbox.cli", "--db", "{url}", "status"],
            "outbox reconcile show": [
                python, "-m", "outbox.cli", "--db", "{url}", "reconcile", "show", "op-1",
            ],
        }  # fmt: skip
        trees = {"after": None} if options.before is None else {
            "before": options.before, "after": None,
        }  # fmt: skip
        urls = {}
        for tree, path in trees.items():
            (Path(tmp) / tree).mkdir()
            urls[tree] = _prepare(Path(tmp) / tree, path)
        pycache = Path(tmp) / "pycache"

        def line(command: list[str], tree: str) -> list[str]:
            return [word.replace("{url}", urls[tree]) for word in command]

        for command in commands.values():
            for tree, path in trees.items():
                _time(line(command, tree), path, pycache)  # compiles and caches the bytecode
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(options.runs):
            for name, command in commands.items():
                for tree, path in trees.items():
                    timed = _time(line(command, tree), path, pycache)
                    results.setdefault((name, tree), []).append(timed)
        print(f"medians of {options.runs} runs; wall clock, then CPU (user + system)")
        for name in commands:
            for index, label in ((0, "wall"), (1, "cpu")):
                medians = {
                    tree: statistics.median(r[index] for r in results[(name, tree)])
                    for tree in trees
                }
                line = "  ".join(f"{tree} {m:.3f}s" for tree, m in medians.items())
                if "before" in medians:
                    line += f"  after/before {medians['after'] / medians['before']:.2f}"
                print(f"{name:24} {label:4}: {line}")


if __name__ == "__main__":
    main()
