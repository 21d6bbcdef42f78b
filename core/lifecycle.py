"""Process lifetime: signals become a clean stop, and no process of a run outlives its parent.

Workers turn SIGINT / SIGTERM into `Interrupted`, which unwinds the Trainer (closing the data
stream, stopping the loopback data server, removing a half-written checkpoint) and ends the
process with 128 + the signal's number, without a traceback. A worker whose parent (torchrun,
or `tessera-train`) dies gets SIGTERM from the kernel (Linux `PR_SET_PDEATHSIG`), so nothing
keeps training on its own. A stop the main thread cannot act on (it is blocked in a collective
whose peer died, and Python handlers run only between bytecodes) ends the process after
`STUCK_STOP_GRACE_S`, so a restart under torchrun is not held up by its 30 s kill timeout. A stop
the main thread did act on is left to finish its cleanup (and the loss plot), however loaded the
machine: its parent's own kill timeout bounds it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STUCK_STOP_GRACE_S = 10.0


class Interrupted(BaseException):
    """A stop signal arrived. BaseException, like KeyboardInterrupt: `except Exception` must not eat it."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    signum: int | None = None
    deferring = 0  # depth of `stop_deferred` blocks on the main thread
    deferred = False  # a stop arrived inside one and is still to be raised


def interrupted_by() -> int | None:
    """The stop signal this process received, if any (also after `Interrupted` was caught)."""
    return _State.signum


def _raise_interrupted(signum, frame) -> None:
    if _State.signum is not None:
        return  # one stop is enough: a second signal must not break the cleanup of the first
    _State.signum = signum
    if _State.deferring:
        _State.deferred = True
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_deferred():
    """A stretch that must not be cut in half (publishing a checkpoint: renames, `latest`,
    pruning): a stop signal arriving inside it raises `Interrupted` when the stretch ends."""
    _State.deferring += 1
    try:
        yield
    finally:
        _State.deferring -= 1
    if _State.deferring == 0 and _State.deferred:
        _State.deferred = False
        raise Interrupted(_State.signum)


def install_stop_handlers(stuck_grace: float = STUCK_STOP_GRACE_S) -> None:
    """SIGINT / SIGTERM raise `Interrupted` in the main thread; if the main thread has not acted
    on the signal `stuck_grace` seconds after it, the process exits with 128 + the signal."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_interrupted)
    # The C-level handler writes each signal's number to this pipe at once, even while the
    # main thread is blocked; a watcher thread reads it.
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_exit_when_stuck, args=(read_fd, stuck_grace), name="stop-watch", daemon=True).start()


def _exit_when_stuck(read_fd: int, grace: float) -> None:
    while True:
        data = os.read(read_fd, 1)
        if not data:
            return
        if data[0] in STOP_SIGNALS:
            time.sleep(grace)
            if _State.signum is not None:  # the main thread's handler ran: it is stopping cleanly
                continue
            sys.stderr.write(f"stopping now: {signal.Signals(data[0]).name} was not handled within {grace:g} s "
                             "(blocked in a collective?)\n")
            sys.stderr.flush()
            os._exit(128 + data[0])


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for `sig` when the parent process ends; if it already has, stop now."""
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, int(sig))
    if parent == 1 or os.getppid() != parent:
        os.kill(os.getpid(), sig)


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init, so it can find
    and stop them (torchrun starts each worker with setsid, outside our process group)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc (Linux); [] elsewhere."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields resume after the last ')'.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def descendants_of(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def exit_without_teardown(code: int | None) -> None:
    """End the process as `sys.exit(code)` would, minus the interpreter's teardown.

    After a run, tearing down the interpreter collects every object torch created (seconds of
    CPU per process, paid by each rank of every run). Everything a normal exit does that
    matters happens first: other non-daemon threads finish, the exit handlers run (the loopback
    data server stops, logging flushes), stdout and stderr are flushed."""
    # What the interpreter does first at exit: the threading exit hooks (concurrent.futures' among
    # them: they end idle pool workers, e.g. inductor's compile threads), then a join of every
    # other non-daemon thread. Joining without the hooks waits for ever on such idle workers.
    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001 (the handlers os._exit would skip)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more to deliver
            pass
    os._exit(code or 0)
