"""Heartbeats of the background parts: the calibrator's thread, the balancer's expert staging, a
drafter group's restart. Each part says when it last made progress and what it is doing, so that
one that stopped (a build waiting on a stale lock, an actor that no longer answers, a migration
that never completes) is reported instead of silent: `drafter_status()`, `/admin/drafter`,
`/health` (200 with status "degraded": the engine still serves) and the `dspark_background_*`
gauges. A part is stalled when it should be working and has not progressed for
`parallel.stall_after_s`; a part that is waiting (for its interval, for rounds, for steps) never is.
Reading one is constant time: `/health` reads them at every probe.
"""

from __future__ import annotations

import threading
import time
from typing import Optional


# every part that has one (the `part` label of the dspark_background_* gauges: one series each, always)
PARTS = ("calibrator", "expert_staging", "drafter_restart")


class Heartbeat:
    """One part's progress. `beat(activity)`: it progressed and is working on `activity`;
    `rest(activity)`: it is waiting, not expected to progress. Step-driven parts (expert staging
    advances only when the engine steps) also call `ran()` at each step: their bound counts the
    time up to the last step, so an idle engine does not make them look stalled."""

    def __init__(self, part: str, stall_after_s: float, step_driven: bool = False, clock=time.monotonic):
        self.part, self.stall_after_s, self.step_driven, self._clock = part, stall_after_s, step_driven, clock
        self._lock = threading.Lock()
        self.activity, self.working = "idle", False
        self._progress_t = self._ran_t = clock()

    def beat(self, activity: str) -> None:
        with self._lock:
            self.activity, self.working = activity, True
            self._progress_t = self._ran_t = self._clock()

    def rest(self, activity: str = "idle") -> None:
        with self._lock:
            self.activity, self.working = activity, False
            self._progress_t = self._ran_t = self._clock()

    def ran(self) -> None:
        with self._lock:
            self._ran_t = self._clock()

    def snapshot(self) -> dict:
        with self._lock:
            now = self._clock()
            age = now - self._progress_t
            # a step-driven part had no chance to progress after the last step
            overdue = (self._ran_t if self.step_driven else now) - self._progress_t
            return snapshot(self.part, self.activity, self.working, age,
                            self.working and overdue > self.stall_after_s, self.stall_after_s)


def snapshot(part: str, activity: str, working: bool, age_s: float, stalled: bool, bound_s: float,
             reason: Optional[str] = None) -> dict:
    """A heartbeat as reported (also made up by the engine for a remote part that did not answer)."""
    if stalled and reason is None:
        reason = f"{part}: no progress for {age_s:.0f} s while {activity} (bound: parallel.stall_after_s = {bound_s:g})"
    return {"part": part, "activity": activity, "working": working, "seconds_since_progress": round(age_s, 1),
            "stalled": stalled, "reason": reason if stalled else None}


def stalled_reasons(beats: list[dict]) -> list[str]:
    return [b["reason"] for b in beats if b.get("stalled")]
