"""A clock that moves only when a test says so, for asserting the exact seconds a timed loop records.

Put in place of a module's ``time`` (``monkeypatch.setattr(module, "time", clock)``): the module's
``time.perf_counter()`` then reads ``clock.perf_counter()``, and the stubs a test wraps around the target's forward or a
drafter call ``clock.advance(seconds)``. Whole seconds (or sums of binary fractions) keep every difference exact.
"""

from __future__ import annotations


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
