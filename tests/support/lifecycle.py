"""The 2-process run whose life the lifecycle and fault tests follow: its command, its processes
(tagged through their environment, so what is left of a run is read from /proc), the moments to
interrupt it, and the check that a resume finishes it on the uninterrupted trajectory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.cli import ROOT, child_env
from tests.support.runs import CONFIG, metrics

STEPS = 6
SMALL = [
    "model.dim=64", "model.num_layers=2", "model.ffn_dim=128", "train.seq_len=64", "train.micro_batch_size=2",
    "train.global_batch_size=8", f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.plot=true",
    "checkpoint.interval=1", "checkpoint.keep=3",
]
#: A resumed run against the uninterrupted one, same layout and data: only the fp32 reduction
#: order of a restarted gloo group differs.
RTOL = 1e-6


def tagged_env(tag: str, **extra: str) -> dict[str, str]:
    """A child's environment (`child_env`) carrying the run's tag, which its own children inherit."""
    return child_env(TESSERA_TEST_RUN=tag, **extra)


def train_cmd(run_dir: Path, dataset: Path, *extra: str, launcher: bool = True) -> list[str]:
    """The run on 2 processes: through `tessera-train --nproc-per-node 2`, or torchrun started by hand."""
    sets = []
    for item in [*SMALL, f"data.dataset={dataset}", f"train.run_dir={run_dir}"]:
        sets += ["--set", item]
    if launcher:
        return [sys.executable, "-m", "core.train.cli", "--config", str(CONFIG), *sets, "--nproc-per-node", "2", *extra]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "core.train.cli",
            "--config", str(CONFIG), *sets, *extra]


def start(cmd: list[str], tag: str, **env: str) -> subprocess.Popen:
    """`cmd` started in the background, tagged `tag`, with `env` added (a fault-injection hook)."""
    return subprocess.Popen(cmd, cwd=ROOT, env=tagged_env(tag, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # its own process group, as a terminal job has


def run(cmd: list[str], tag: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`cmd` run to its end, tagged `tag` (a fresh tag when none is given)."""
    return subprocess.run(cmd, cwd=ROOT, env=tagged_env(tag or uuid.uuid4().hex), capture_output=True, text=True,
                          timeout=timeout)


def processes_tagged(tag: str) -> list[str]:
    """The command lines of the live processes (not zombies) tagged `tag`, other than this one."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            if f"TESSERA_TEST_RUN={tag}".encode() in environ.split(b"\0"):
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # a zombie has ended; only its exit status waits for a reaper
                    found.append(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:
            continue
    return found


def wait_for_no_process(tag: str, timeout: float = 60.0) -> list[str]:
    """[] once no process tagged `tag` is left; those still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not processes_tagged(tag):
            return []
        time.sleep(0.5)
    return processes_tagged(tag)


def wait_until(predicate, timeout: float = 120.0) -> None:
    """Return as soon as `predicate()` holds; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("the run never reached the moment to interrupt")


def assert_only_complete_checkpoints(run_dir: Path) -> None:
    """No half-written save is left where a resume would look: only `latest` and finished steps."""
    for path in (run_dir / "checkpoints").iterdir():
        assert path.name == "latest" or (path.name.startswith("step_") and (path / ".metadata").is_file()), path


def resume_and_check(run_dir: Path, reference: dict[int, float]) -> None:
    """`--resume RUN_DIR` alone (its 2 processes from RUN_DIR/launch.toml) finishes the run on the
    reference trajectory, one record per step, and draws the plot again."""
    plot = run_dir / "loss.png"
    drawn = plot.stat().st_mtime_ns if plot.exists() else 0
    # A stop that lands in the last step may come after its checkpoint: the run is then complete.
    finished = [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1))
    proc = run([sys.executable, "-m", "core.train.cli", "--resume", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    if finished:
        assert f"already reached train.max_steps={STEPS}" in proc.stderr, proc.stderr[-4000:]
        return
    assert "RNG state restored on 2 of 2 ranks" in proc.stderr, proc.stderr[-4000:]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=RTOL), (r["step"], records, reference)
    assert plot.stat().st_size > 1000 and plot.stat().st_mtime_ns > drawn
