"""A single refreshing progress line on stderr for long-running data-service commands."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Shows `docs, docs/s, tokens/s, MB written` on one line, redrawn at most every
    `interval` seconds. Only draws when `enabled` and the stream is a terminal."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, interval: float = 0.2):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.enabled = enabled and isatty
        self.interval = interval
        self.start = time.perf_counter()
        self._last = 0.0
        self._width = 0

    def update(self, docs: int, tokens: int, bytes_written: int, force: bool = False) -> None:
        """Redraw the line if enough time has passed since the last redraw."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        dt = max(now - self.start, 1e-9)
        line = (f"{docs:,} docs  {docs / dt:,.0f} docs/s  {tokens / dt / 1e6:,.2f} M tokens/s  "
                f"{bytes_written / 1e6:,.1f} MB written")
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def finish(self, summary: str | None = None) -> None:
        """Clear the progress line and, if given, print `summary` on a line of its own."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
        if summary:
            self.stream.write(summary + "\n")
        self.stream.flush()

    def elapsed(self) -> float:
        """Seconds since this progress line was created."""
        return time.perf_counter() - self.start
