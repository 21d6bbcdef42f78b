"""Hang watchdog: a rank that stays too long in one phase of a step says where, leaves its stacks, and ends.

The Trainer names each phase as it enters it (`Watchdog.enter`: data wait, forward/backward,
gradient reduction, optimizer step + parameter all-gather, checkpoint save, ...). A daemon
thread sleeps until the current phase's deadline, `train.hang_timeout_s` after it began; a
phase change moves the deadline, so the thread costs nothing while steps progress. When a
deadline passes the rank prints one line (wrapped here)

    tessera-train: hang: rank 1 spent 600 s in forward/backward of step 3 (train.hang_timeout_s=600);
        stacks of every thread in RUN_DIR/hang-rank1.txt

writes every thread's Python stack there (faulthandler), hands the line to `on_hang` (the
trainer records it as the rank's failure, dated when the phase began: core/train/failure.py)
and exits with `HANG_EXIT_CODE`, so
torchrun stops the other workers and restarts the group (`--max-restarts`) or ends the run. A
rank stuck in a collective phase is usually waiting for a peer stuck elsewhere: that peer
is less far into the step (fewer phases entered), and the report names it.

Fault injection, for tests only: `TESSERA_INJECT_STALL=RANK:STEP:POINT[:SECONDS][,...]` makes
rank RANK sleep SECONDS (default: an hour, a hang) when it reaches POINT in step STEP. The points
are the phase names above, and "checkpoint write" (the background writer of
`checkpoint.async_save`, before it writes this rank's part). Unset, it costs one environment lookup.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

HANG_EXIT_CODE = 124  # as timeout(1): the process was ended for taking too long
STALL_ENV = "TESSERA_INJECT_STALL"
_HANG_S = 3600.0


@functools.cache
def _stalls(spec: str) -> tuple[tuple[int, int, str, float], ...]:
    out = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        fields = item.split(":")
        try:
            rank, step, point = int(fields[0]), int(fields[1]), fields[2]
            seconds = float(fields[3]) if len(fields) > 3 else _HANG_S
        except (IndexError, ValueError):
            raise ValueError(f"{STALL_ENV}={spec!r}: each entry must read RANK:STEP:POINT[:SECONDS], "
                             f"e.g. 1:3:forward/backward:2") from None
        out.append((rank, step, point, seconds))
    return tuple(out)


def stall_point(point: str, step: int, rank: int) -> None:
    """Fault injection (tests): sleep here if `TESSERA_INJECT_STALL` names this rank, step and point."""
    spec = os.environ.get(STALL_ENV)
    if not spec:
        return
    for r, s, p, seconds in _stalls(spec):
        if (r, s, p) == (rank, step, point):
            time.sleep(seconds)


class Watchdog:
    """Ends this process when one phase of a step outlasts `timeout_s` (0: never). `enter` is
    cheap and may be called from anywhere; only `start` arms the thread (the training loop)."""

    def __init__(self, timeout_s: float, rank: int, run_dir: str | Path,
                 on_hang: Callable[..., None] | None = None):
        self.timeout_s = float(timeout_s)
        # on_hang(cause without the rank, when=time.time() the phase began, progress=(step, phases
        # entered in it)), before the exit
        self.on_hang = on_hang
        self.rank = rank
        self.run_dir = Path(run_dir)
        self.step = 0
        self._state: tuple[str, int, float] | None = None  # (phase, step, since): one assignment, no lock
        self._phases_in_step = 0  # how far this rank got in its step: ranks enter the same phases in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin_step(self, step: int) -> None:
        self.step = step
        self._phases_in_step = 0

    def enter(self, phase: str) -> None:
        """This rank now works on `phase` of the current step; its deadline starts now."""
        self._phases_in_step += 1
        self._state = (phase, self.step, time.monotonic())
        stall_point(phase, self.step, self.rank)

    def start(self) -> None:
        if self.timeout_s <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._state = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.is_set():
            state = self._state
            if state is None:
                self._stop.wait(self.timeout_s)
                continue
            remaining = state[2] + self.timeout_s - time.monotonic()
            if remaining > 0:
                self._stop.wait(remaining)  # a later phase only moves the deadline: look again then
                continue
            if self._state is state and not self._stop.is_set():
                self._fire(*state)

    def _fire(self, phase: str, step: int, since: float) -> None:
        path = self.run_dir / f"hang-rank{self.rank}.txt"
        waited = time.monotonic() - since
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"rank {self.rank}, step {step}, phase {phase}, {waited:.0f} s; pid {os.getpid()}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = f"stacks of every thread in {path}"
        except OSError as err:
            where = f"could not write the stacks to {path}: {err.strerror}"
        what = f"spent {waited:.0f} s in {phase} of step {step} (train.hang_timeout_s={self.timeout_s:g}); {where}"
        sys.stderr.write(f"tessera-train: hang: rank {self.rank} {what}\n")
        sys.stderr.flush()
        if self.on_hang is not None:
            try:
                self.on_hang(f"hang: {what}", when=time.time() - waited, progress=(step, self._phases_in_step))
            except Exception:  # the exit below is what matters
                pass
        os._exit(HANG_EXIT_CODE)
