"""A throughput meter and a stopwatch: the training loop's timing."""

import time


class Throughput:
    """Samples per second over the timed intervals added to it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.samples = 0

    def add(self, seconds: float, samples: int) -> None:
        self.seconds += seconds
        self.samples += samples

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class Stopwatch:
    def __init__(self) -> None:
        self._start = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap (or since creation)."""
        now = time.perf_counter()
        elapsed, self._start = now - self._start, now
        return elapsed
