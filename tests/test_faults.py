"""Launch at scale and survive faults, on real processes (torchrun, gloo on loopback, the loopback data service).

- Two "nodes" (two `tessera-train --nnodes 2` launchers meeting at a c10d rendezvous on
  127.0.0.1, 2 processes each) against one launcher of 4 processes: every step's loss and
  gradient norm bitwise equal (same world, same ranks, same gloo reduction order). In the same
  run one rank is made slow, then hung (the fault-injection hook of core/watchdog.py): the
  metrics name it the slowest rank, and the watchdog (`train.hang_timeout_s`) prints one line
  naming rank, step and phase and writes the stacks to RUN_DIR; both nodes end, no process left.
- A worker killed with SIGKILL after a checkpoint, under `--max-restarts 1`: torchrun restarts
  the group, which continues from the newest complete checkpoint; every step's loss equals
  the uninterrupted run's, one metrics record per step.
- The whole job killed with SIGKILL while an asynchronous save (`checkpoint.async_save`) is
  half written (one rank's writer held back by the same hook): the save never became
  `latest`, and `--resume` continues from the previous one on the reference trajectory.

The reference for the 2-process runs is the uninterrupted run of tests/test_run_lifecycle.py
(same data, same config); resumed and restarted runs match it within rel 1e-6 (RTOL of
tests/support/lifecycle.py: the reduction order of a restarted gloo group is the only difference).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest

from core.state.checkpoint import latest_checkpoint
from core.train.failure import first_failure, record_cause
from core.watchdog import HANG_EXIT_CODE, STALL_ENV
from tests.support.cli import ROOT, assert_one_line, run_entry_point
from tests.support.distributed import free_port
from tests.support.lifecycle import (RTOL, STEPS, assert_only_complete_checkpoints, resume_and_check, start,
                                     train_cmd, wait_for_no_process, wait_until)
from tests.support.runs import metrics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture
def dataset(lifecycle_dataset) -> Path:
    return lifecycle_dataset  # the lifecycle runs' dataset, built once per session (tests/conftest.py)


@pytest.fixture
def reference(lifecycle_reference) -> dict[int, float]:
    return lifecycle_reference  # the uninterrupted run of train_cmd, once per session (tests/conftest.py)


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _run_processes(tag: str) -> list[tuple[int, dict[str, str], str]]:
    """(pid, environment, command line) of every live process of the run tagged `tag`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        env = _environ(int(entry))
        if env.get("TESSERA_TEST_RUN") != tag:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found.append((int(entry), env, cmdline))
    return found


def _worker(tag: str, rank: int) -> tuple[int, dict[str, str]]:
    for pid, env, cmdline in _run_processes(tag):
        if env.get("RANK") == str(rank) and "core.train.cli" in cmdline:
            return pid, env
    raise AssertionError(f"no worker of rank {rank} runs")


def _crash(tag: str) -> None:
    """SIGKILL every process of the run, workers first (as a node's power cut): nobody cleans up."""
    procs = _run_processes(tag)
    for pid, env, _ in sorted(procs, key=lambda p: "RANK" not in p[1]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("args, words", [
    (["--nnodes", "2"], ["need --nproc-per-node N"]),
    (["--nnodes", "2", "--nproc-per-node", "2"], ["--nnodes 2 needs --rdzv-endpoint HOST:PORT"]),
    (["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "node0:http"], ["'node0:http' must read HOST:PORT"]),
    (["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "node0:29500", "--node-rank", "2"],
     ["--node-rank 2 must be in [0, 1]"]),
    (["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "node0:29500", "--node-rank", "0", "--max-restarts", "1"],
     ["--max-restarts needs c10d rendezvous", "leave out --node-rank"]),
    (["--nproc-per-node", "2", "--max-restarts", "-1"], ["--max-restarts -1 must be >= 0"]),
    (["--nproc-per-node", "2", "--auto-resume", "--overwrite"], ["--auto-resume and --overwrite contradict"]),
])
def test_launch_misuse_is_one_line(args, words):
    assert_one_line(run_entry_point("core.train.cli", "--config", ROOT / "launch" / "configs" / "tiny_dense.toml", *args),
                    "tessera-train: error:", *words)


def test_the_hung_rank_that_got_least_far_is_the_cause(tmp_path):
    """Rank 1 waits in step 4's gradient reduction (its third phase) for rank 3, stuck in step 4's
    forward/backward (its second), whose phase began later because it was slow to reach it: rank
    3 is the cause. A rank that raised is dated when it raised, and the earliest cause wins."""
    record_cause(tmp_path, 1, "hang: in gradient reduction", HANG_EXIT_CODE, when=100.0, progress=(4, 3))
    record_cause(tmp_path, 3, "hang: in forward/backward", HANG_EXIT_CODE, when=100.5, progress=(4, 2))
    record_cause(tmp_path, 0, "hang: in step 5", HANG_EXIT_CODE, when=99.0, progress=(5, 1))
    assert first_failure(tmp_path)["rank"] == 3
    record_cause(tmp_path, 2, "RuntimeError: boom", 1, when=100.2)
    assert first_failure(tmp_path)["rank"] == 2
    record_cause(tmp_path, 2, "RuntimeError: boom", 1, when=101.0)
    assert first_failure(tmp_path)["rank"] == 3


@pytest.mark.slow
def test_two_nodes_equal_one_and_a_hung_rank_ends_both(tmp_path, dataset):
    """World 4 as one launcher of 4 processes and as two launchers ("nodes") of 2 at a c10d
    rendezvous: the same losses, bit for bit. In the two-node run rank 3 (the second node's
    second process) is one second late in step 2's forward/backward, then stuck in step 4's."""
    short = ["--set", "train.max_steps=4", "--set", "checkpoint.interval=0", "--set", "train.plot=false"]
    tag = uuid.uuid4().hex
    # argparse keeps the last --nproc-per-node, --set applies in order: these override train_cmd's.
    one = start(train_cmd(tmp_path / "one", dataset, *short, "--nproc-per-node", "4"), tag)
    run_dir = tmp_path / "two"
    endpoint = f"127.0.0.1:{free_port()}"
    rendezvous = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", f"faults-{tag[:8]}"]
    nodes = [start(train_cmd(run_dir, dataset, *short, "--set", "train.hang_timeout_s=3", *rendezvous), tag,
                   **{STALL_ENV: "3:2:forward/backward:1.0,3:4:forward/backward"}) for _ in range(2)]
    (_, one_err), *node_outputs = [proc.communicate(timeout=240) for proc in [one, *nodes]]
    assert one.returncode == 0, one_err[-4000:]
    assert wait_for_no_process(tag) == []  # both nodes' launchers, torchruns, workers and the data server

    single, multi = metrics(tmp_path / "one"), metrics(run_dir)
    assert [r["step"] for r in multi] == [1, 2, 3]
    assert [(r["loss"], r["grad_norm"]) for r in multi] == [(r["loss"], r["grad_norm"]) for r in single[:3]]
    # The straggler figures cover the four ranks of both nodes.
    for r in multi:
        assert 0 <= r["slowest_rank"] < 4 and 0 < r["busy_s_min"] <= r["busy_s_median"] <= r["busy_s_max"], r
    slow = multi[1]
    assert slow["slowest_rank"] == 3 and slow["busy_s_max"] >= 1.0 and slow["busy_s_max"] - slow["busy_s_min"] > 0.5, slow
    # The workers' rank 0 saved the launch a bare --resume starts again on each node.
    assert tomllib.loads((run_dir / "launch.toml").read_text()) == {
        "nproc_per_node": 2, "nnodes": 2, "rdzv_backend": "c10d", "rdzv_endpoint": endpoint,
        "rdzv_id": f"faults-{tag[:8]}", "max_restarts": 0}

    stderr = "\n".join(err for _, err in node_outputs)
    # Each launcher ends with the hang watchdog's exit code and names the hung rank as the cause:
    # of the hung ranks it got least far into step 4 (the others wait for it in gradient
    # reduction), and both nodes' launchers read the one run directory here.
    assert all(proc.returncode == HANG_EXIT_CODE for proc in nodes), stderr[-4000:]
    for _, err in node_outputs:
        reports = [line for line in err.splitlines() if line.startswith("tessera-train: failed: ")]
        assert len(reports) == 1 and reports[0].startswith("tessera-train: failed: rank 3: hang: spent "), err[-4000:]
        assert "in forward/backward of step 4" in reports[0] and "hang-rank3.txt" in reports[0], reports
        assert "ChildFailedError" not in err, err[-4000:]  # torchrun's account stays in the log
    # One log per node launcher (the run directory may be shared), each with its own torchrun's account.
    logs = sorted((run_dir / "logs").glob("launcher-*.log"))
    assert len(logs) == 2 and all("ChildFailedError" in log.read_text() for log in logs), logs
    named = {word.strip("(:") for _, err in node_outputs for word in err.split() if word.startswith("(launcher-")}
    assert named == {log.name for log in logs}, (named, logs)  # each report names its own node's log
    hangs = [line for line in stderr.splitlines() if line.startswith("tessera-train: hang: ")]
    culprit = [line for line in hangs if "rank 3 " in line]
    assert len(culprit) == 1, hangs
    assert "in forward/backward of step 4" in culprit[0] and f"{run_dir / 'hang-rank3.txt'}" in culprit[0], culprit
    # The others wait for rank 3 in step 4's gradient reduction; a rank whose own watchdog fired
    # before torchrun stopped it says so, once.
    others = [line.split(" spent ")[0] for line in hangs if line not in culprit]
    assert len(others) == len(set(others)) and all(" of step 4 " in line for line in hangs), hangs
    stacks = (run_dir / "hang-rank3.txt").read_text()
    assert stacks.startswith("rank 3, step 4, phase forward/backward"), stacks[:3000]
    assert "in stall_point" in stacks and "in step" in stacks and "in _watch" in stacks  # every thread's stack


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_continues_from_the_newest_checkpoint(tmp_path, dataset, reference):
    rng = random.Random("kill-worker")
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    proc = start(train_cmd(run_dir, dataset, "--max-restarts", "1", "--set", "train.plot=false"), tag)
    try:
        target = rng.randint(2, 4)
        wait_until(lambda: len(metrics(run_dir)) >= target and latest_checkpoint(run_dir / "checkpoints") is not None)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere in the next step (or its save)
        pid, env = _worker(tag, rank=0)  # rank 0: the loopback data server, the metrics file and the publisher
        os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    assert wait_for_no_process(tag) == []
    assert "loaded " in stderr, stderr[-4000:]  # the restarted group resumed from a checkpoint
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=RTOL), (r["step"], records, reference)
    assert_only_complete_checkpoints(run_dir)
    # The launcher sets NCCL's flight recorder up for its workers (gloo ignores it).
    assert env.get("TORCH_NCCL_DUMP_ON_TIMEOUT") == "1"
    assert env.get("TORCH_FR_DUMP_TEMP_FILE") == str(run_dir.absolute() / "nccl-trace-rank-")


@pytest.mark.slow
def test_a_job_killed_during_an_async_save_resumes_from_the_previous_checkpoint(tmp_path, dataset, reference):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    ckpt = run_dir / "checkpoints"
    # Rank 1's background writer never writes its part of step 3; rank 0 writes its own and
    # trains on, until step 4's save waits for step 3's.
    proc = start(train_cmd(run_dir, dataset, "--set", "checkpoint.async_save=true"), tag,
                 **{STALL_ENV: "1:3:checkpoint write"})
    try:
        wait_until(lambda: len(metrics(run_dir)) >= 3 and (ckpt / "step_000003.tmp" / "__0_0.distcp").is_file()
                   and (ckpt / "step_000002").is_dir())
        time.sleep(1.0)  # rank 0 has had every chance to publish step 3, were it to do so wrongly
        assert (ckpt / "latest").read_text().strip() == "step_000002"
        assert not (ckpt / "step_000003").exists() and not (ckpt / "step_000003.tmp" / ".metadata").exists()
        assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
        assert "save_s" not in metrics(run_dir)[0]  # asynchronous: step 1's save was published after its step
        _crash(tag)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert wait_for_no_process(tag) == []
    assert (ckpt / "step_000003.tmp").is_dir() and latest_checkpoint(ckpt) == ckpt / "step_000002"
    resume_and_check(run_dir, reference)  # sweeps step 3's debris, loads step 2, finishes on the trajectory
    assert_only_complete_checkpoints(run_dir)
    assert latest_checkpoint(ckpt) == ckpt / f"step_{STEPS:06d}"
