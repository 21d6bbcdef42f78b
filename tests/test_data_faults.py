"""The trainer against a data service that stalls, dies or serves damaged data, on real processes.

- A replica stopped with SIGSTOP mid-run (data.address of two `tessera-data serve` processes):
  the client drops the silent stream after data.stream_idle_timeout_s and reads on from the
  other replica; every step's loss equals the uninterrupted run's.
- The trainer's own loopback server (data.dataset) that never says where it serves: one line
  with the server's log tail, within the start deadline, no process left.

The reference is one uninterrupted single-process run of the same config and data: the service
is deterministic and so is one CPU process, so a run that lost no row and repeated none has the
same losses, bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from core.lifecycle import children_of
from core.train.data import LocalServer
from tests.support.cli import ROOT, child_env
from tests.support.runs import CONFIG, SMALL, build_small_dataset, losses, metrics
from tests.support.service import start_server_process

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
