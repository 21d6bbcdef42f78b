"""Drop streams whose client stopped reading.

gRPC's flow control pauses a stream whose client does not read: the worker thread waits in
the send of its current message, holding the thread, a stream slot and the message (up to
max_message_bytes). `SendWatch` notes when each stream started waiting and cancels the RPC
once it has waited `timeout` seconds; the thread then returns, and the client, when it reads
again, gets CANCELLED and reconnects from its last resume token (a retryable status).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class SendWatch:
    """One daemon thread that cancels streams stuck in a send for longer than `timeout` s."""

    def __init__(self, timeout: float, on_drop: Callable[[str], None] | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"stream send timeout is {timeout!r}; it must be > 0 seconds")
        self.timeout = float(timeout)
        self._on_drop = on_drop
        self._waiting: dict[int, tuple[float, object, str]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def sending(self, context, who: str) -> int:
        """Note that `context`'s stream is handing a message to gRPC; returns a ticket for `sent`."""
        ticket = id(context)
        with self._lock:
            self._waiting[ticket] = (time.monotonic(), context, who)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="send-watch", daemon=True)
                self._thread.start()
        return ticket

    def sent(self, ticket: int) -> None:
        """The message left (the stream asked for its next one), or the stream ended."""
        with self._lock:
            self._waiting.pop(ticket, None)

    def close(self) -> None:
        """Stop the watch thread (streams still waiting are no longer dropped)."""
        self._wake.set()

    def _run(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self._wake.wait(period):
            now = time.monotonic()
            with self._lock:
                stuck = [(t, c, w) for t, (since, c, w) in self._waiting.items() if now - since > self.timeout]
                for ticket, _, _ in stuck:
                    del self._waiting[ticket]
            for _, context, who in stuck:
                log.warning("dropped stream %s: its client read nothing for %.0f s", who, self.timeout)
                if self._on_drop:
                    self._on_drop(who)
                context.cancel()
