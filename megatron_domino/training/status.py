"""What a run is doing now, one context manager per stretch of work: it names the stretch for hang reports
(the watchdog reads ``phase``), times it (``log.timers``) and marks it in profiles, so the loop says each once."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

from torch.profiler import record_function


class Status:
    def __init__(self, timers):
        self.timers = timers
        self.phase = "start-up"

    @contextmanager
    def __call__(self, phase: str, timer: str | None = None, profile: str | None = None):
        """Within: ``phase`` is what the run does (the one before is back after); ``timer`` times it; ``profile``
        names a profiler range."""
        before, self.phase = self.phase, phase
        if timer is not None:
            self.timers.start(timer)
        try:
            with record_function(profile) if profile is not None else nullcontext():
                yield
        finally:
            if timer is not None:
                self.timers.stop(timer)
            self.phase = before
