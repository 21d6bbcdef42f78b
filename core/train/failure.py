"""Why a run stopped: each failing rank's record, and the few lines that tell the user.

A rank that fails writes RUN_DIR/logs/failure-rank-R.json (its one-line cause, when, which
attempt) and its traceback to RUN_DIR/logs/rank-R.log, and prints one line; nothing else of it
reaches the terminal. A rank the hang watchdog ends (core/watchdog.py) writes a record too, dated
when it stopped making progress (the start of the phase it hung in), with how far into its step
it got. When several ranks fail, the first one is the cause, and of hung ranks one that got least
far: the others usually fail, or hang, because it left or stopped (a collective whose peer is
gone or stuck). The launcher (core/train/launcher.py), or a process running alone, then prints
the report: that cause, the last complete checkpoint and the command that continues from it,
and where the full logs are.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import traceback
from pathlib import Path

from core.state.checkpoint import latest_checkpoint, step_of
from dataservice.rpc import DataServiceError

LOGS_NAME = "logs"
LAUNCHER_LOG = "launcher.log"
PREFIX = "tessera-train: failed: "
_RECORD = re.compile(r"failure-rank-(\d+)\.json$")


def cause_of(err: BaseException) -> str:
    """One line: a data-service error as the service put it (status and message, e.g. DATA_LOSS
    naming the shard), anything else as `Type: message`."""
    if isinstance(err, DataServiceError):
        text = str(err)
    else:
        text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return " ".join(text.split())[:2000]


def record_failure(run_dir: Path, rank: int, err: BaseException, exit_code: int) -> str:
    """Write this rank's record and traceback under RUN_DIR/logs; returns the cause line. A run
    directory that cannot be written loses the record, never the exit."""
    cause = cause_of(err)
    record_cause(run_dir, rank, cause, exit_code, detail="".join(traceback.format_exception(err)))
    return cause


def record_cause(run_dir: Path, rank: int, cause: str, exit_code: int, when: float | None = None,
                 detail: str = "", progress: tuple[int, int] | None = None) -> None:
    """This rank's record: `cause` (one line), `when` it failed (time.time(); default now),
    for a hang how far the rank got (`progress`: step, phases entered in it) and, in rank-R.log,
    `detail` (a traceback). Never raises for a run directory it cannot write."""
    logs = Path(run_dir) / LOGS_NAME
    try:
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"rank-{rank}.log", "a") as f:
            f.write(f"--- rank {rank} failed at {time.strftime('%Y-%m-%d %H:%M:%S')}: {cause}\n{detail}")
        record = {"rank": rank, "time": time.time() if when is None else when, "cause": cause,
                  "exit_code": exit_code, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}
        if progress is not None:
            record["progress"] = list(progress)
        tmp = logs / f".failure-rank-{rank}.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(logs / f"failure-rank-{rank}.json")
    except OSError:
        pass


def launcher_log_name(multi_node: bool) -> str:
    """The launcher's log in RUN_DIR/logs: launcher.log, or with several nodes (whose run
    directory may be one shared folder) one per node launcher, launcher-HOST-PID.log."""
    return f"launcher-{socket.gethostname()}-{os.getpid()}.log" if multi_node else LAUNCHER_LOG


def clear_failures(run_dir: Path) -> None:
    """Forget the records of an earlier launch (a new launch writes its own)."""
    logs = Path(run_dir) / LOGS_NAME
    if logs.is_dir():
        for path in logs.iterdir():
            if _RECORD.match(path.name):
                path.unlink(missing_ok=True)


def first_failure(run_dir: Path, settle_s: float = 0.0) -> dict | None:
    """The record of the rank that failed first in the latest attempt; None without records.
    `settle_s` > 0: first wait (at most that long) until no new record has appeared for a second:
    a node's launcher can end before a peer node's first-failing rank has written its record."""
    if settle_s > 0:
        _wait_for_records(Path(run_dir) / LOGS_NAME, settle_s)
    records = []
    logs = Path(run_dir) / LOGS_NAME
    for path in logs.glob("failure-rank-*.json") if logs.is_dir() else []:
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return None
    last = max(r.get("attempt", 0) for r in records)
    latest = [r for r in records if r.get("attempt", 0) == last]
    # A hung rank that got further into the step than another hung rank was waiting for it (in a
    # collective): its phase may even have begun first, when the other was slow to reach its own.
    hung = [tuple(r["progress"]) for r in latest if "progress" in r]
    least = min(hung, default=None)
    causes = [r for r in latest if "progress" not in r or tuple(r["progress"]) == least]
    return min(causes, key=lambda r: r["time"])


def _wait_for_records(logs: Path, limit_s: float) -> None:
    deadline, seen, quiet_since = time.monotonic() + limit_s, None, time.monotonic()
    while time.monotonic() < deadline:
        names = sorted(p.name for p in logs.glob("failure-rank-*.json")) if logs.is_dir() else []
        if names != seen:
            seen, quiet_since = names, time.monotonic()
        elif time.monotonic() - quiet_since >= 1.0:
            return
        time.sleep(0.1)


def torchrun_root_cause(text: str) -> str | None:
    """torchrun's own "Root Cause (first observed failure)" of a worker that left no record
    (killed by a signal, say), as one line; None when `text` has none."""
    _, found, rest = text.partition("Root Cause (first observed failure):")
    rank = re.search(r"rank\s*:\s*(\d+)", rest) if found else None
    code = re.search(r"exitcode\s*:\s*(-?\d+)", rest) if found else None
    if rank is None or code is None:
        return None
    signal_name = re.search(r"Signal (\d+) \((\w+)\)", rest)
    how = f"was killed by {signal_name.group(2)}" if signal_name else f"ended with exit code {code.group(1)}"
    return f"rank {rank.group(1)}: the worker {how} without saying why"


def report(run_dir: Path, ckpt_dir: Path, cause: str, launcher_log: bool | str) -> str:
    """The lines that end a failed run: the cause, where to continue from, where the logs are
    (`launcher_log`: the launcher's log name, True for launcher.log, False without a launcher)."""
    latest = latest_checkpoint(ckpt_dir)
    if latest is None:
        resume = "no checkpoint was completed; start again with --overwrite"
    else:
        resume = (f"the last complete checkpoint is step {step_of(latest)} ({latest}); continue with: "
                  f"tessera-train --resume {run_dir}")
    logs = Path(run_dir) / LOGS_NAME
    name = LAUNCHER_LOG if launcher_log is True else launcher_log
    where = f"{logs}/" + (f" ({name}: everything the processes printed; rank-N.log: the failed ranks' "
                          "tracebacks)" if launcher_log else " (rank-N.log: the tracebacks)")
    return f"{PREFIX}{cause}\ntessera-train: {resume}\ntessera-train: full logs: {where}"
