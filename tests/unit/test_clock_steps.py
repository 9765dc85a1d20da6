"""SystemClock's step watch: a step of the wall clock against the monotonic one resets
the steady time the claim's takeover rule reads (DESIGN-NOTES "Leases that survive a
clock step"). The system clocks are replaced by a pair the test moves."""

from __future__ import annotations

import pytest

import outbox.clock as clock_module
from outbox.clock import FakeClock, SystemClock, steady_ms

S = 10**9  # one second in ns


class Clocks:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.wall, self.mono = 1_800_000_000 * S, 5_000 * S
        monkeypatch.setattr(clock_module.time, "time_ns", lambda: self.wall)
        monkeypatch.setattr(clock_module.time, "monotonic_ns", lambda: self.mono)

    def run(self, seconds: float) -> None:
        self.wall += int(seconds * S)
        self.mono += int(seconds * S)


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    return Clocks(monkeypatch)


def test_steady_time_counts_from_the_clock_s_creation(clocks: Clocks) -> None:
    clock = SystemClock()
    assert clock.steady_ms() == 0  # nothing is known of the time before it
    clocks.run(30)
    clock.now_ms()
    assert (clock.steady_ms(), clock.steps) == (30_000, 0)


@pytest.mark.parametrize("step", [+600, -600, +1.5, -1.5])
def test_a_step_either_way_resets_the_steady_time(clocks: Clocks, step: float) -> None:
    clock = SystemClock()
    clocks.run(60)
    assert clock.steady_ms() == 60_000
    clocks.wall += int(step * S)
    clocks.run(1)
    clock.now_ms()
    assert (clock.steps, clock.last_step_ms) == (1, int(step * 1000))
    assert clock.steady_ms() == 0
    clocks.run(2)
    if step > 0:
        assert clock.steady_ms() == 2_000
    else:  # standing still until the wall clock is back where it stood (at 60 - step)
        assert clock.steady_ms() == max(0, int((63 - (60 - step)) * 1000))


def test_slew_and_jitter_are_not_steps(clocks: Clocks) -> None:
    clock = SystemClock()
    for _ in range(100):
        clocks.run(36)  # an hour, slewed at 500 ppm (NTP's most) and read every 36 s
        clocks.wall += 18_000_000
        clock.now_ms()
    clocks.wall += S // 2  # half a second: under the tolerance
    clock.now_ms()
    assert clock.steps == 0
    assert clock.steady_ms() == 3_600_000


def test_after_a_step_back_the_clock_stands_still_then_is_steady_again(clocks: Clocks) -> None:
    clock = SystemClock()
    clocks.run(10)
    before = clock.now_ms()
    clocks.wall -= 600 * S
    for _ in range(5):
        clocks.run(100)
        assert clock.now_ms() == before  # never backwards
        assert clock.steady_ms() == 0
    clocks.run(110)  # past where it stood
    assert clock.now_ms() == before + 10_000
    clocks.run(20)
    assert clock.steady_ms() == 20_000 + 10_000


def test_clocks_not_watched_have_no_steady_time() -> None:
    assert steady_ms(FakeClock()) is None
