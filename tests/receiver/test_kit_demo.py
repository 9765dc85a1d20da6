"""``outbox demo --receiver kit`` runs the story against the real kit: a replay after a
lost answer, a key conflict, and an unresolved operation settled by the status lookup."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from outbox.cli import main


def test_demo_against_the_kit(tmp_path: Path) -> None:
    env: dict[str, str | None] = {"OUTBOX_DATABASE_URL": None, "OUTBOX_APP": None}
    result = CliRunner().invoke(main, ["demo", "--receiver", "kit", "--dir", str(tmp_path)],
                                env=env, catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = {
        m[0]: m[1].strip() for m in re.findall(r"│ (order-\d+-reserve) │ ([^│]+)│", result.output)
    }
    assert rows == {
        "order-1001-reserve": "succeeded",
        "order-1002-reserve": "succeeded",
        "order-1003-reserve": "unresolved (key_conflict)",
        "order-1004-reserve": "succeeded (outcome_unknown)",
    }
    assert re.findall(r"│ order-\d+-reserve .*│ (\d+) +│", result.output) == ["1", "1", "1", "1"]
    assert "-> 200 applied" in result.output
