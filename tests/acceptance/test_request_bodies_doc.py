"""The Python blocks of docs/guide/request-bodies.md run as written (the Stripe call
against the test receiver's stripe-like dialect, over real HTTP)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "guide" / "request-bodies.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_the_guide_runs(block: str) -> None:
    exec(compile(block, str(DOC), "exec"), {})  # noqa: S102 - our own documentation
