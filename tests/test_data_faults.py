"""The trainer against a data service that stalls, dies or serves damaged data, on real processes.

- A replica stopped with SIGSTOP mid-run (data.address of two `tessera-data serve` processes):
  the client drops the silent stream after data.stream_idle_timeout_s and reads on from the
  other replica; every step's loss equals the uninterrupted run's.
- The trainer's own loopback server (data.dataset) that never says where it serves: one line
  with the server's log tail, within the start deadline, no process left.
- That server killed (SIGKILL) mid-run: restarted on its port, the run finishes with the
  uninterrupted run's losses.
- A damaged shard reached mid-run (1 process, and 2 under the launcher): exit 1 and three lines,
  the cause from the rank that failed first (DATA_LOSS naming the shard), the last checkpoint
  with the resume command, and where the logs are; no traceback on the terminal.
- A data service that dies for good: the run fails after data.retry_s, saying so.

The reference is one uninterrupted single-process run of the same config and data: the service
is deterministic and so is one CPU process, so a run that lost no row and repeated none has the
same losses, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from core.lifecycle import children_of, descendants_of
from core.state.checkpoint import latest_checkpoint, step_of
from core.train.data import LocalServer
from dataservice.build import build_dataset, make_corpus
from tests.support.cli import ROOT, child_env
from tests.support.runs import CONFIG, SMALL, build_small_dataset, losses, metrics
from tests.support.service import start_server_process
from tests.support.damage import flip_token

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]
#: Long enough (about 30 ms a step here) that a fault lands mid-run; one process, one rank.
STEPS = 150
RUN = [*SMALL, f"train.max_steps={STEPS}", "train.log_interval=50", "data.prefetch=1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return build_small_dataset(tmp_path_factory.mktemp("faults-data"))


def train_cmd(run_dir: Path, *sets: str) -> list[str]:
    cmd = [sys.executable, "-m", "core.train.cli", "--config", str(CONFIG)]
    for item in [*RUN, f"train.run_dir={run_dir}", *sets]:
        cmd += ["--set", item]
    return cmd


def start_train(run_dir: Path, *sets: str) -> subprocess.Popen:
    return subprocess.Popen(train_cmd(run_dir, *sets), cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def when_at_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(metrics(run_dir)) < step:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached the step"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("faults-reference") / "run"
    proc = subprocess.run(train_cmd(run_dir, f"data.dataset={data}"), cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return losses(run_dir)


def test_a_stalled_replica_is_left_within_the_idle_timeout_and_no_row_is_lost(data, reference, tmp_path):
    (a, addr_a, _), (b, addr_b, _) = start_server_process([data]), start_server_process([data])
    run_dir = tmp_path / "run"
    try:
        proc = start_train(run_dir, f"data.address={addr_a},{addr_b}", "data.stream_idle_timeout_s=2")
        when_at_step(run_dir, 3, proc)
        a.send_signal(signal.SIGSTOP)
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-4000:]
    finally:
        for server in (a, b):
            server.kill()
            server.wait()
    assert f"from {addr_a} lost (no message for 2 s)" in err, err[-3000:]
    assert f"back from {addr_b}" in err, err[-3000:]
    assert losses(run_dir) == reference


def test_a_loopback_server_that_never_says_where_it_serves_is_one_line(data, tmp_path):
    # The server is stopped (SIGSTOP) as soon as it exists: alive, silent, like a wedged start.
    stopped: list[int] = []

    def stall() -> None:
        deadline = time.monotonic() + 30
        while not stopped and time.monotonic() < deadline:
            for pid in children_of(os.getpid()):
                if b"dataservice.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            time.sleep(0.005)

    watcher = threading.Thread(target=stall)
    watcher.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        LocalServer(str(data), timeout=3)
    watcher.join()
    assert stopped and 3 <= time.monotonic() - start < 20
    message = str(failed.value)
    assert "\n" not in message and "did not say where it serves within 3 s; its log ends: " in message
    assert not Path(f"/proc/{stopped[0]}").exists() or "Z" in Path(f"/proc/{stopped[0]}/stat").read_text().split()[2]


def test_a_killed_loopback_server_is_restarted_and_the_run_equals_the_uninterrupted_one(data, reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_train(run_dir, f"data.dataset={data}")
    when_at_step(run_dir, 3, proc)
    servers = [pid for pid in descendants_of(proc.pid) if b"dataservice.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(servers) == 1
    os.kill(servers[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-4000:]
    assert "the loopback data service for" in err and "ended (exit code -9); restarting it on 127.0.0.1:" in err, \
        err[-3000:]
    assert "lost (" in err and "back from 127.0.0.1:" in err, err[-3000:]
    assert losses(run_dir) == reference


# ---- why a run stopped -----------------------------------------------------------------------

def damaged_dataset(root: Path) -> Path:
    """Small shards, one of them with a token flipped: the server marks the shard damaged and the
    stream that reaches it ends with DATA_LOSS naming it, a few steps into the run."""
    (root / "corpus").mkdir(parents=True)
    corpus = make_corpus(root / "corpus", 300, seed=1, min_len=40, max_len=600)
    data = build_dataset([corpus], root / "a", shard_size_mb=0.02)
    flip_token(data, shard=3)
    return data


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_damaged_shard_mid_run_ends_it_with_the_cause_the_checkpoint_and_the_resume_command(tmp_path, nproc):
    data, run_dir = damaged_dataset(tmp_path), tmp_path / "run"
    cmd = train_cmd(run_dir, f"data.dataset={data}", "train.max_steps=40", "checkpoint.interval=1")
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tessera-train: ")]
    assert len(lines) == 3, proc.stderr[-4000:]
    cause, resume, logs = lines
    first = min((json.loads(p.read_text()) for p in (run_dir / "logs").glob("failure-rank-*.json")),
                key=lambda r: r["time"])
    who = f"rank {first['rank']}: " if nproc > 1 else ""
    assert cause.startswith(f"tessera-train: failed: {who}data service at 127.0.0.1:"), cause
    assert "refused the stream: DATA_LOSS: dataset 'a' shard shard-00003 is damaged" in cause, cause
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None, proc.stderr[-3000:]  # the shard is reached a few steps in
    assert resume == (f"tessera-train: the last complete checkpoint is step {step_of(latest)} ({latest}); "
                      f"continue with: tessera-train --resume {run_dir}")
    assert logs.startswith(f"tessera-train: full logs: {run_dir / 'logs'}/")
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-4000:]
    traceback = (run_dir / "logs" / f"rank-{first['rank']}.log").read_text()
    assert "Traceback (most recent call last)" in traceback and "DATA_LOSS" in traceback
    if nproc > 1:  # torchrun's account is kept, in the launcher's log
        assert "ChildFailedError" in (run_dir / "logs" / "launcher.log").read_text()


def test_a_dead_data_service_fails_the_run_after_retry_s(data, tmp_path):
    server, address, _ = start_server_process([data])
    run_dir = tmp_path / "run"
    try:
        proc = start_train(run_dir, f"data.address={address}", "data.retry_s=3")
        when_at_step(run_dir, 3, proc)
        server.kill()
        server.wait()
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
    finally:
        server.kill()
        server.wait()
    assert proc.returncode == 1, err[-3000:]
    assert time.monotonic() - killed < 60
    cause = [line for line in err.splitlines() if line.startswith("tessera-train: failed: ")]
    assert len(cause) == 1 and re.search(r"no data service replica answered for 3 s \(\d+ attempts\)", cause[0]), \
        err[-3000:]
    assert f"{address} (connection refused)" in cause[0]
