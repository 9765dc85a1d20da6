"""Every ``pip install`` hint names the distribution, ``http-outbox``.

The distribution called ``outbox`` on the package index is an unrelated project: a hint
``pip install 'outbox[metrics]'`` would install someone else's code.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_WRONG = re.compile(r"pip install\s+['\"]?outbox(\[|\b)")


def _files() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "outbox").rglob("*.py"))]
    found += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "examples").rglob("*"))
    return [p for p in found if p.is_file() and p.suffix in {".md", ".py"}]


def test_no_hint_installs_the_unrelated_outbox_distribution() -> None:
    # The whole text, not line by line: prose wraps a hint across lines.
    wrong = [
        f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
        for p in _files()
        for text in [p.read_text()]
        for match in _WRONG.finditer(text)
    ]
    assert wrong == [], f"pip install hints naming 'outbox' instead of 'http-outbox': {wrong}"


def test_the_pattern_catches_the_wrong_name() -> None:
    assert _WRONG.search("pip install 'outbox[metrics]'")
    assert _WRONG.search("pip install outbox")
    assert _WRONG.search("exit 2, `pip install\n  'outbox[metrics]'`")
    assert not _WRONG.search("pip install 'http-outbox[metrics]'")
