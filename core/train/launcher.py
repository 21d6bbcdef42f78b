"""`tessera-train --nproc-per-node N [--nnodes N ...]`: torchrun on this node, and nothing left behind.

The launcher owns the run: it holds the run directory's lock for its workers, starts torchrun
in a new process group via setsid (so a Ctrl-C reaches the launcher once, not every process twice)
as a fork of itself (`ForkedTorchrun`: torch is already imported, which a fresh interpreter
would spend ~2 s of CPU on before the first worker starts), and
on SIGINT / SIGTERM forwards the signal to torchrun, which stops its workers. Whatever
remains after `STOP_GRACE_S` — or after torchrun ends, normally or not — is killed: the
launcher is a child subreaper, so workers and the loopback data server stay its descendants
even when torchrun dies first. After a stop it prints one line and exits 128 + the signal.

Several nodes: one launcher per node with the same `Rendezvous` (core/train/launch_shape.py:
`--nnodes`, `--rdzv-endpoint`, `--rdzv-id`; c10d rendezvous, or a fixed `--node-rank` with static
rendezvous). Then no launcher
holds the run directory: the workers' rank 0 takes it, as under a plain torchrun. With
`--max-restarts N` torchrun restarts the worker group when a worker dies; the restarted workers
continue from the newest complete checkpoint (`core/train/cli.py`).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from core.state.checkpoint import latest_checkpoint, step_of
from core.lifecycle import STOP_SIGNALS, become_subreaper, descendants_of, die_with_parent, signal_all
from core.metrics import plot_losses, read_metrics
from core.train.failure import LOGS_NAME, PREFIX as FAILED_PREFIX, clear_failures, first_failure, launcher_log_name
from core.train.failure import report as failure_report, torchrun_root_cause
from core.train.launch_shape import LAUNCH_ENV, Launch
from core.train.rundir import LOCK_OWNER_ENV, METRICS_NAME, remove_partial_checkpoints

STOP_GRACE_S = 30.0  # torchrun's own grace for its workers is 30 s; ours covers torchrun itself
LEFTOVER_GRACE_S = 5.0


def interrupted_line(run_dir: Path, ckpt_dir: Path, signum: int) -> str:
    records = read_metrics(run_dir / METRICS_NAME)
    done = records[-1]["step"] if records else 0
    latest = latest_checkpoint(ckpt_dir)
    name = signal.Signals(signum).name
    if latest is None:
        return (f"tessera-train: {name}: interrupted after step {done}; no checkpoint was completed, "
                f"so nothing to resume (start again with --overwrite)")
    return (f"tessera-train: {name}: interrupted after step {done}; the last complete checkpoint is step "
            f"{step_of(latest)}; continue with --resume {run_dir}")


# The line rank 0 ends a run with when its input is bad (core/train/cli.py): shown, exit 2.
ERROR_LINE = b"tessera-train: error: "
FAILED_LINE = FAILED_PREFIX.encode()
HANG_LINE = b"tessera-train: hang: "  # core/watchdog.py: one per hung rank, each worth seeing
TAIL_LINES = 400  # of torchrun's output kept in memory: its failure account is its last ~40 lines


def _relay(stream, log, quiet: threading.Event, reported: list[int], failures: list[str], restarts: bool,
           tail: collections.deque, received: list[int]) -> None:
    """Copy torchrun's stderr (its workers' too) to the log file, and to ours until a stop, rank
    0's one-line report of a bad input, a rank's line that it failed or hung: what follows (the
    tracebacks of the ranks that lost their peer, torchrun's account) would bury the cause,
    which the launcher states at the end. A failing rank's own line is kept for that report
    (`failures`); the watchdog's hang lines are all shown (the hung rank's may come after a
    peer's). With restarts to come, the relay goes on for the restarted workers. `tail`: the
    last lines, this launcher's own (the log file may be shared by several nodes' launchers)."""
    for line in iter(stream.readline, b""):
        log.write(line)
        log.flush()
        tail.append(line)
        if line.startswith(FAILED_LINE):
            failures.append(line[len(FAILED_LINE):].decode(errors="replace").strip())
            if not restarts:
                quiet.set()
            continue
        if line.startswith(HANG_LINE) and not received:  # after a stop, only the stop's line
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            if not restarts:
                quiet.set()
            continue
        if not quiet.is_set():
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            if line.startswith(ERROR_LINE):
                reported.append(2)
                quiet.set()
    stream.close()


FAILURE_SETTLE_S = 5.0  # how long a failed launch of several nodes waits for its peers' failure records


def failure_lines(run_dir: Path, ckpt_dir: Path, failures: list[str], code: int, output: str,
                  log_name: str, multi_node: bool = False) -> str:
    """The end of a failed run: the cause from the rank that failed first (its record, else the
    first failure line seen, else torchrun's root cause in its `output`), the checkpoint to
    continue from and where the logs are (`log_name` in RUN_DIR/logs). With several nodes the
    records are first given FAILURE_SETTLE_S to arrive (another node's ranks may still be
    writing theirs); on one node every rank is gone by now, so every record is there."""
    first = first_failure(run_dir, settle_s=FAILURE_SETTLE_S if multi_node else 0.0)
    if first is not None:
        cause = f"rank {first['rank']}: {first['cause']}"
    elif failures:
        cause = failures[0]
    else:
        cause = torchrun_root_cause(output) or f"a worker ended with exit code {code}"
    return failure_report(run_dir, ckpt_dir, cause, launcher_log=log_name)


def _stop_leftovers() -> None:
    # Orphans re-parented to us (the data server of a worker that crashed) stay our children
    # as zombies once they end: reap them, or they would count as leftovers for the whole grace.
    _reap()
    leftovers = descendants_of(os.getpid())
    if not leftovers:
        return
    signal_all(leftovers, signal.SIGTERM)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while time.monotonic() < deadline and descendants_of(os.getpid()):
        time.sleep(0.1)
        _reap()
    signal_all(descendants_of(os.getpid()), signal.SIGKILL)
    _reap()


def _reap() -> None:
    """Collect the exit status of re-parented children so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _plot_if_stale(run_dir: Path) -> None:
    """loss.png of the steps in metrics.jsonl, unless rank 0 drew it after the last record."""
    metrics, plot = run_dir / METRICS_NAME, run_dir / "loss.png"
    if not metrics.exists() or (plot.exists() and plot.stat().st_mtime_ns >= metrics.stat().st_mtime_ns):
        return
    records = read_metrics(metrics)
    if records:
        try:
            plot_losses(run_dir, records)
        except Exception as err:  # never hides why the run ended
            print(f"tessera-train: loss.png not drawn: {err}", file=sys.stderr, flush=True)


class ForkedTorchrun:
    """`python -m torch.distributed.run ARGS` in its own process group (setsid) with `env`, its stderr a pipe
    (`stderr`), forked from the launcher rather than a new interpreter. The launcher has no
    threads yet (its relay starts after), so the fork is safe. The child ends as that interpreter
    would: an uncaught exception prints its traceback (which names torchrun's root cause) and
    exits 1, a Ctrl-C ends it by SIGINT. `pid`, `poll`, `wait` and `returncode` as subprocess.Popen's."""

    def __init__(self, args: list[str], env: dict[str, str]):
        sys.stdout.flush()
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            os.close(read_end)
            self._run_child(args, env, write_end)
        os.close(write_end)
        self.stderr = os.fdopen(read_end, "rb")

    @staticmethod
    def _run_child(args: list[str], env: dict[str, str], stderr_fd: int) -> None:
        code = 1
        try:
            os.setsid()
            die_with_parent()
            os.dup2(stderr_fd, 2)
            os.close(stderr_fd)
            os.environ.clear()
            os.environ.update(env)
            from torch.distributed import run as torchrun

            sys.argv = [torchrun.__file__, *args]
            torchrun.main(args)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            if code == -signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: as subprocess.Popen, assume it succeeded
                self.returncode = 0
            else:
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("torchrun", timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode


def launch_local(launch: Launch, worker_argv: list[str], run_dir: Path, ckpt_dir: Path, plot: bool = False) -> int:
    """Run `python -m core.train.cli WORKER_ARGV` on `launch.nproc_per_node` ranks of this node;
    returns the exit code.

    On one node the launcher holds the run directory for its workers and sweeps partial saves
    at the end; with several nodes the workers' rank 0 holds it (no launcher knows when the
    others' workers are done) and saves the launch shape it is handed. `plot` (train.plot): after
    a stop or a failure the launcher draws loss.png where rank 0 could not (torchrun may end it
    mid-plot once another rank has gone)."""
    rendezvous = launch.rendezvous
    become_subreaper()
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous.torchrun_args(),
           f"--nproc-per-node={launch.nproc_per_node}", "-m", "core.train.cli", *worker_argv]
    env = dict(os.environ)
    env[LAUNCH_ENV] = json.dumps(launch.to_dict())
    env.setdefault("OMP_NUM_THREADS", "1")  # N workers on a CPU-only machine share its cores
    # torchrun's c10d rendezvous lends its TCPStore to the workers by default, and the store keeps
    # a failed attempt's keys: a restarted worker could read its dead peer's address and fail to
    # connect. Unshared, every rendezvous round gets a fresh store, hosted by worker rank 0 on a
    # port torchrun found free and let go of (another process can take it first): so only when
    # the group may be restarted.
    if rendezvous.max_restarts > 0:
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # NCCL's flight recorder keeps each rank's last collectives and, when one times out, dumps
    # them to RUN_DIR/nccl-trace-rank-<R> (read with torchfrtrace); gloo ignores these.
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(run_dir.absolute() / "nccl-trace-rank-"))
    if not rendezvous.multi_node:
        env[LOCK_OWNER_ENV] = str(os.getpid())
    received: list[int] = []
    reported: list[int] = []
    failures: list[str] = []
    quiet = threading.Event()
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    clear_failures(run_dir)
    (run_dir / LOGS_NAME).mkdir(parents=True, exist_ok=True)
    log_name = launcher_log_name(rendezvous.multi_node)
    log = open(run_dir / LOGS_NAME / log_name, "ab")
    log.write(f"--- tessera-train launch at {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n".encode())
    proc = ForkedTorchrun(cmd[3:], env)

    def on_stop(signum, frame):
        if received:
            return
        received.append(signum)
        quiet.set()
        signal_all([proc.pid], signum)

    previous = {sig: signal.signal(sig, on_stop) for sig in STOP_SIGNALS}
    relay = threading.Thread(target=_relay, args=(proc.stderr, log, quiet, reported, failures,
                                                  bool(rendezvous.max_restarts), tail, received), daemon=True)
    relay.start()
    stop_at = None
    try:
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and stop_at is None:
                stop_at = time.monotonic() + STOP_GRACE_S
            if stop_at is not None and time.monotonic() > stop_at:
                signal_all([proc.pid, *descendants_of(os.getpid())], signal.SIGKILL)
    finally:
        _stop_leftovers()
        if not rendezvous.multi_node:
            # Every process of the run is gone: a save they were in the middle of is swept now.
            remove_partial_checkpoints(ckpt_dir)
            if plot and (received or code != 0):
                _plot_if_stale(run_dir)
        relay.join(timeout=5)
        log.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        print(interrupted_line(run_dir, ckpt_dir, received[0]), file=sys.stderr, flush=True)
        return 128 + received[0]
    if code and reported:
        return reported[0]
    if code:
        output = b"".join(tail).decode(errors="replace")
        print(failure_lines(run_dir, ckpt_dir, failures, code, output, log_name, rendezvous.multi_node),
              file=sys.stderr, flush=True)
        first = first_failure(run_dir)
        return int(first["exit_code"]) if first is not None and first.get("exit_code") else code
    return code
