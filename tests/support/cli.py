"""Running a command's entry point: in this process (seconds sooner: no new interpreter to
import torch) or as a subprocess from the repository root, and asserting its one-line error."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

from core.train.cli import main as train_main
from dataservice.cli import main as data_main

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"core.train.cli": train_main, "dataservice.cli": data_main}


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: one thread (the tests share few cores), this
    checkout first on the import path, then `extra`."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, **extra)


def run_process(module: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repository root: its exit code, stdout and stderr."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


def run_entry_point(module: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command's entry point called in this process (a new interpreter per case would cost
    seconds of imports each): what it writes to stdout/stderr and its exit code. An uncaught
    exception fails the test, as a traceback would. `timeout` is `run_process`'s, accepted so
    that the two are called alike; a call in this process is not cut short."""
    argv = list(map(str, args))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = ENTRY_POINTS[module](argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return subprocess.CompletedProcess([module, *argv], code, out.getvalue(), err.getvalue())


def assert_one_line(proc: subprocess.CompletedProcess, *words: str, code: int = 2) -> str:
    """Exit `code`, exactly one line on stderr, no traceback, and `words` in that line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]
