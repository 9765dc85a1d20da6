"""The oracle can fail: each planted bug makes a small soak fail on the expected checks.

The bugs live in ``tests.soak.planted`` (monkeypatches in the dispatcher subprocesses;
the library's source is untouched). Each small soak is tuned so that its bug has
plenty of chances to show: pauses for the lease bugs, stuck keys for the window, kills
between the send and the outcome for the write-ahead rule. SQLite only, a few seconds
of chaos each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.soak.engine import SoakSettings, run_soak
from tests.soak.test_soak import soak_seed

SMALL: dict[str, Any] = {
    "operations": 160,
    "enqueue_rate": 16.0,
    "min_kills": 2,
    "drain_seconds": 20.0,
    "window_seconds": 8.0,
    "p_failpoints": 1.0,
}

# The lease bugs need one dispatcher to lose its lease while another takes over: a
# random schedule produces that race only when timing cooperates, so these run the
# scripted stale-owner race instead (every operation, every time; no random faults).
SCRIPTED: dict[str, Any] = {
    "operations": 12,
    "enqueue_rate": 200.0,
    "min_kills": 0,
    # A's slots are all taken by its held attempts, so it cannot take its own expired
    # leases back: B is the one that takes over.
    "concurrency": 12,
    "p_via_caller": 0.0,
    "p_rollback": 0.0,
    "p_get": 0.0,
    "window_seconds": 30.0,  # longer than the hold: the window must not be what stops A
    "p_fail_before_work": 0.0,
    "p_drop_after_commit": 0.0,
    "p_fail_after_commit": 0.0,
    "p_stored_500": 0.0,
    "p_delay_after_commit": 0.0,
    "p_stuck": 0.0,
}

PLANTS: dict[str, tuple[dict[str, Any], set[str]]] = {
    # Idempotency-Key = request ID: every retry after a lost response is a new effect.
    "key_per_attempt": (
        {"p_drop_after_commit": 0.2, "p_delay_after_commit": 0.1, "p_fail_after_commit": 0.1,
         "failpoint_menu": ("after_response=kill:0.05",)},
        {"O3_duplicate_effects", "O9_key_not_operation_id"},
    ),
    # The attempt row is written with the outcome: a kill after the send loses it.
    "send_before_commit": (
        {"failpoint_menu": ("after_response=kill:0.1",)},
        {"O8_sent_without_attempt"},
    ),
    # The window never closes: stuck keys are retried (409) past it.
    "no_window_check": (
        {"p_stuck": 0.15, "window_seconds": 3.0, "drain_seconds": 8.0,
         "failpoint_menu": ("after_claim=kill:0.01",)},
        {"O11_sent_after_window"},
    ),
    # No pre-send lease check: a dispatcher held past its lease wakes up and sends.
    "no_lease_check": ({**SCRIPTED, "script": "after_attempt_commit"}, {"O12_sent_after_lease"}),
    # No fencing: a dispatcher held past its lease overwrites its successor's outcome.
    "no_fencing": ({**SCRIPTED, "script": "after_response"}, {"O13_settled_row_rewritten"}),
}  # fmt: skip


@pytest.mark.soak
@pytest.mark.timeout(200)
@pytest.mark.parametrize("bug", sorted(PLANTS))
def test_planted_bug_is_caught(bug: str, tmp_path: Path) -> None:
    overrides, expected = PLANTS[bug]
    settings = SoakSettings(seed=soak_seed(), plant=bug, **{**SMALL, **overrides})
    result = run_soak(settings, tmp_path / "soak")
    line = json.dumps(result.line, sort_keys=True, default=str)
    caught = {name for name, count in result.verdict.checks.items() if count}
    assert expected <= caught, (
        f"{bug}: expected {sorted(expected)}, caught {sorted(caught)}: {line}"
    )


@pytest.mark.soak
@pytest.mark.timeout(200)
@pytest.mark.parametrize("point", ["after_attempt_commit", "after_response"])
def test_scripted_race_without_a_plant_is_clean(point: str, tmp_path: Path) -> None:
    """The control of the scripted race: A held past its lease at ``point``, B takes
    over; with the real code A neither sends late nor rewrites B's outcome."""
    settings = SoakSettings(seed=soak_seed(), script=point, **{**SMALL, **SCRIPTED})
    result = run_soak(settings, tmp_path / "soak")
    line = json.dumps(result.line, sort_keys=True, default=str)
    assert result.verdict.ok, line
    assert result.line["acknowledged"] == SCRIPTED["operations"], line


@pytest.mark.soak
@pytest.mark.timeout(200)
def test_small_soak_without_a_plant_is_clean(tmp_path: Path) -> None:
    """The control: the same small soak, no bug, every check at zero."""
    overrides = {"failpoint_menu": ("after_response=pause:{pause}@0.2",
                                    "after_attempt_commit=pause:{pause}@0.15",
                                    "after_response=kill:0.1"),
                 "p_two": 1.0, "p_drop_after_commit": 0.2, "p_stuck": 0.05}  # fmt: skip
    settings = SoakSettings(seed=soak_seed(), **{**SMALL, **overrides})
    result = run_soak(settings, tmp_path / "soak")
    line = json.dumps(result.line, sort_keys=True, default=str)
    assert result.verdict.ok, line
