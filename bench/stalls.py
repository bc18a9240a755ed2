"""Where an event loop stands still: a sampler for benchmarks that look for loop stalls.

A callback on the loop beats every few milliseconds; a thread watches the beat and, whenever
the loop is later than `threshold_s`, takes the loop thread's stack (its innermost frames).
A stack seen in many samples is what holds the loop (a synchronous call: a process spawn, a
large read, a parse); stacks spread over the loop's idle points mean the process was not
scheduled at all (the machine's load, not the code).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections import Counter


class StallSampler:
    def __init__(self, loop: asyncio.AbstractEventLoop, threshold_s: float = 0.05, interval_s: float = 0.005) -> None:
        self.loop = loop
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.stacks: Counter[str] = Counter()
        self.stalls = 0
        self.worst_s = 0.0
        self._beat_at = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-sampler", daemon=True)

    def start(self) -> None:
        """Called on the loop's thread."""
        self._loop_thread = threading.get_ident()
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        self._beat_at = time.monotonic()
        if not self._stop.is_set():
            self.loop.call_later(self.interval_s, self._beat)

    def _watch(self) -> None:
        stalled = False
        while not self._stop.wait(self.interval_s):
            lag = time.monotonic() - self._beat_at - self.interval_s
            if lag < self.threshold_s:
                stalled = False
                continue
            self.stalls += not stalled
            stalled = True
            self.worst_s = max(self.worst_s, lag)
            frame = sys._current_frames().get(self._loop_thread)
            if frame is not None:
                inner = traceback.extract_stack(frame)[-6:]
                self.stacks[
                    " <- ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(inner))
                ] += 1

    def report(self, top: int = 8) -> str:
        lines = [
            f"{self.stalls} stalls over {self.threshold_s * 1e3:.0f} ms, the worst {self.worst_s * 1e3:.0f} ms; "
            f"the loop thread's innermost frames while stalled ({self.interval_s * 1e3:.0f} ms samples):"
        ]
        lines += [f"  {count:5d}  {stack}" for stack, count in self.stacks.most_common(top)]
        return "\n".join(lines)
