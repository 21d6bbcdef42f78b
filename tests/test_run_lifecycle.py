"""A run's life on real processes: stop signals at random moments, no orphans, self-protecting
run directories, resume without retyping (config and launch: `--resume RUN_DIR` alone).

Every process of a run carries a tag in its environment (inherited by torchrun, the workers and
the loopback data server), so "no process of the run remains" is read from /proc. Reference
for the loss trajectory: the same run (2 processes; 4 for the MoE model) without interruption;
a resumed run must match it step for step (same layout, same data order; 1e-6 relative covers
only the fp32 reduction order of a restarted gloo group).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest

from core.config import load_config
from core.validation import validate
from core.metrics import read_metrics
from core.state import checkpoint
from core.train.trainer import Trainer
from tests.support.cli import ROOT, run_entry_point
from tests.support.lifecycle import (RTOL, SMALL, STEPS, assert_only_complete_checkpoints, resume_and_check, run, start,
                                     train_cmd, wait_for_no_process, wait_until)
from tests.support.runs import CONFIG, MOE_CONFIG, metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

MOE_SMALL = ["model.dim=64", "model.num_layers=2", "model.ffn_dim=128", "model.moe.ffn_dim=32", "train.seq_len=64",
             "train.max_steps=3", "train.warmup_steps=1", "checkpoint.interval=1", "train.plot=false"]


@pytest.fixture
def dataset(lifecycle_dataset) -> Path:
    return lifecycle_dataset  # built once per session (tests/conftest.py)


@pytest.fixture
def reference(lifecycle_reference) -> dict[int, float]:
    return lifecycle_reference  # the uninterrupted run of train_cmd, once per session (tests/conftest.py)


# Moments: after a random step has been logged (during the next step's compute or collectives),
# and the instant a checkpoint save has started writing (a step_N.tmp folder exists).
def _during_step(run_dir: Path, rng: random.Random):
    target = rng.randint(2, 4)
    return lambda: len(metrics(run_dir)) >= target and (time.sleep(rng.uniform(0.0, 0.4)) or True)


def _during_save(run_dir: Path, rng: random.Random):
    target = rng.randint(2, 3)
    return lambda: len(metrics(run_dir)) >= target and any((run_dir / "checkpoints").glob("step_*.tmp"))


CASES = {
    "sigint-launcher-during-step": (True, signal.SIGINT, "launcher", _during_step),
    "sigterm-group-during-save": (True, signal.SIGTERM, "group", _during_save),
    "sigterm-torchrun-during-step": (False, signal.SIGTERM, "launcher", _during_step),
}


@pytest.mark.parametrize("case", CASES)
def test_stop_signal_leaves_no_process_and_resume_continues_the_trajectory(tmp_path, dataset, reference, case):
    launcher, sig, target, moment = CASES[case]
    rng = random.Random(case)
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    proc = start(train_cmd(run_dir, dataset, launcher=launcher), tag)
    try:
        wait_until(moment(run_dir, rng))
        if target == "group":
            os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C does
        else:
            os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert wait_for_no_process(tag) == []
    assert_only_complete_checkpoints(run_dir)
    assert (run_dir / "loss.png").stat().st_size > 1000  # the plot of the steps done, drawn at the stop
    if launcher:
        assert proc.returncode == 128 + sig, stderr[-3000:]
        lines = [line for line in stderr.splitlines() if "interrupted after step" in line]
        assert len(lines) == 1 and "continue with --resume" in lines[0], stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
    resume_and_check(run_dir, reference)


PUBLISH_STOPPED_MID_PRUNE = """
import os, shutil, signal, sys
from pathlib import Path
from core.state import checkpoint
from core.lifecycle import Interrupted, install_stop_handlers

delete = shutil.rmtree
def stop_then_delete(path, **kwargs):  # the stop arrives while an old step is being deleted
    os.kill(os.getpid(), signal.SIGINT)
    delete(path, **kwargs)
checkpoint.shutil.rmtree = stop_then_delete
install_stop_handlers()
try:
    checkpoint._publish(Path(sys.argv[1]), "step_000003", keep=2)
except Interrupted as stop:
    print("interrupted", stop.signum)
"""


def test_a_stop_during_publish_raises_only_once_the_checkpoint_is_published_and_pruned(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_000001", "step_000002", "step_000003.tmp"):
        (root / name).mkdir(parents=True)
        (root / name / ".metadata").write_bytes(b"m")
        (root / name / "__0_0.distcp").write_bytes(b"x" * 1000)
    proc = run([sys.executable, "-c", PUBLISH_STOPPED_MID_PRUNE, str(root)], timeout=60)
    assert proc.stdout.split() == ["interrupted", str(int(signal.SIGINT))], proc.stderr[-2000:]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (root / "latest").read_text().strip() == "step_000003"


SLOW_CLEANUP_AFTER_A_STOP = """
import os, signal, sys, time
from core.lifecycle import Interrupted, install_stop_handlers
install_stop_handlers(stuck_grace=0.5)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except Interrupted as stop:
    time.sleep(2)  # a cleanup (closing, the loss plot) slower than the grace on a loaded machine
    print("cleaned up", flush=True)
    sys.exit(stop.exit_code)
"""


def test_a_stop_the_main_thread_acted_on_finishes_its_cleanup_past_the_grace():
    # The grace ends only a process whose main thread never got the signal (blocked in C).
    proc = run([sys.executable, "-c", SLOW_CLEANUP_AFTER_A_STOP], timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and proc.stdout.split() == ["cleaned", "up"], proc.stderr[-2000:]
    assert "was not handled within" not in proc.stderr


def test_each_checkpoint_is_published_only_after_its_step_record_is_written(tmp_path, dataset, monkeypatch):
    # A process killed between the two must never leave a published step without its record: a
    # resume starts after that step and would not write it again (a record past the newest
    # published checkpoint is dropped on resume instead).
    sets = [item for item in SMALL if not item.startswith(("train.max_steps", "train.plot"))]
    config = load_config(CONFIG, [*sets, "train.max_steps=3", "train.plot=false", "train.device=cpu",
                                  f"data.dataset={dataset}", f"train.run_dir={tmp_path}"])
    validate(config, 1)
    published, publish_now = [], checkpoint._publish_now

    def publish(root, name, keep):
        published.append((name, [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]))
        publish_now(root, name, keep)

    monkeypatch.setattr(checkpoint, "_publish_now", publish)
    Trainer(config).run()
    assert published == [("step_000001", [1]), ("step_000002", [1, 2]), ("step_000003", [1, 2, 3])]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_run_that_fails_still_draws_its_loss_plot(tmp_path, dataset, monkeypatch):
    # The failure: publishing step 2's checkpoint raises (a full disk), after its record was written.
    sets = [item for item in SMALL if not item.startswith(("train.max_steps", "train.plot"))]
    config = load_config(CONFIG, [*sets, "train.max_steps=3", "train.plot=true", "train.device=cpu",
                                  f"data.dataset={dataset}", f"train.run_dir={tmp_path}"])
    validate(config, 1)
    publish_now = checkpoint._publish_now

    def publish(root, name, keep):
        if name == "step_000002":
            raise OSError(28, "No space left on device")
        publish_now(root, name, keep)

    monkeypatch.setattr(checkpoint, "_publish_now", publish)
    with pytest.raises(OSError, match="No space left"):
        Trainer(config).run()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_killed_launcher_takes_its_workers_along_and_the_stale_lock_is_taken_over(tmp_path, dataset, reference):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    proc = start(train_cmd(run_dir, dataset), tag)
    try:
        wait_until(lambda: len(metrics(run_dir)) >= 3)
        os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: the kernel tells the children
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert wait_for_no_process(tag) == []
    assert (run_dir / "run.lock").exists()  # left behind by the killed owner
    proc = run([sys.executable, "-m", "core.train.cli", "--resume", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "taking over the lock" in proc.stderr
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1))
    assert not (run_dir / "run.lock").exists()


def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path, dataset):
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    first = start(train_cmd(run_dir, dataset, "--set", "train.max_steps=200"), tag)
    try:
        wait_until(lambda: len(metrics(run_dir)) >= 1)
        second = run_entry_point("core.train.cli", *train_cmd(run_dir, dataset, "--overwrite")[3:])  # refused before torchrun
        assert second.returncode == 2
        assert second.stderr.strip().count("\n") == 0 and "is in use by process" in second.stderr, second.stderr
        assert first.poll() is None  # the first run goes on
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.communicate(timeout=90)
    assert wait_for_no_process(tag) == []


def test_run_directory_rules_and_resume_with_changes(tmp_path, dataset):
    """Single process (no torchrun): the same rules hold where rank 0 owns the directory."""
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "core.train.cli", "--config", str(CONFIG)]
    sets = []
    for item in [*SMALL, "train.max_steps=3", "train.plot=false", f"data.dataset={dataset}", f"train.run_dir={run_dir}"]:
        sets += ["--set", item]
    assert run(base + sets).returncode == 0
    saved = (run_dir / "config.toml").read_text()
    assert "max_steps = 3" in saved and f'dataset = "{dataset}"' in saved

    # Refusals and --print-config end before any training: the entry point in this process
    # (`run_entry_point`, tests/support/cli.py) says the same as a new interpreter, seconds sooner.
    again = run_entry_point("core.train.cli", *base[3:], *sets)  # the same command again, neither --resume nor --overwrite
    assert again.returncode == 2 and "already holds a run" in again.stderr and "--resume" in again.stderr
    assert len(metrics(run_dir)) == 3  # nothing was appended

    (run_dir / "checkpoints" / "step_000009.tmp").mkdir()  # a save that died
    shape = run_entry_point("core.train.cli", "--resume", run_dir, "--set", "model.dim=128")
    assert shape.returncode == 2 and "cannot resume with model.dim 64 -> 128" in shape.stderr
    seed = run_entry_point("core.train.cli", "--resume", run_dir, "--set", "train.seed=7")
    assert seed.returncode == 2 and "train.seed" in seed.stderr and seed.stderr.count("\n") == 1, seed.stderr

    printed = run_entry_point("core.train.cli", "--resume", run_dir, "--set", "train.max_steps=5", "--print-config")
    assert printed.returncode == 0 and "max_steps = 5" in printed.stdout and len(metrics(run_dir)) == 3

    more = run([sys.executable, "-m", "core.train.cli", "--resume", str(run_dir), "--set", "train.max_steps=5"])
    assert more.returncode == 0, more.stderr[-3000:]
    changes = [line for line in more.stderr.splitlines() if "alter the trajectory" in line]
    assert len(changes) == 1 and "train.max_steps 3 -> 5" in changes[0]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert "max_steps = 5" in (run_dir / "config.toml").read_text()

    fresh = run(base + sets + ["--overwrite"])
    assert fresh.returncode == 0 and [r["step"] for r in metrics(run_dir)] == [1, 2, 3]


def test_resume_alone_relaunches_the_runs_launch_and_a_finished_run_says_so(tmp_path, dataset):
    """The tiny MoE model at ep=2 on 4 processes (dp=4), stopped after step 1 (train.stop_at_step),
    then `tessera-train --resume RUN_DIR` and nothing else: 4 processes again (one could not hold
    ep=2), steps 2-3 on the uninterrupted 4-process run's losses (RTOL)."""
    def launch(run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
        args = []
        for item in [*MOE_SMALL, f"data.dataset={dataset}", f"train.run_dir={run_dir}", *sets]:
            args += ["--set", item]
        return run([sys.executable, "-m", "core.train.cli", "--config", str(MOE_CONFIG), *args, "--nproc-per-node", "4"])

    reference = launch(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-4000:]
    expected = {r["step"]: r["loss"] for r in metrics(tmp_path / "reference")}
    run_dir = tmp_path / "run"
    first = launch(run_dir, "train.stop_at_step=1")
    assert first.returncode == 0 and [r["step"] for r in metrics(run_dir)] == [1], first.stderr[-4000:]
    assert tomllib.loads((run_dir / "launch.toml").read_text())["nproc_per_node"] == 4

    resumed = run([sys.executable, "-m", "core.train.cli", "--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "RNG state restored on 4 of 4 ranks" in resumed.stderr, resumed.stderr[-4000:]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["loss"] == pytest.approx(expected[r["step"]], rel=RTOL), (r["step"], records, expected)

    # Resumed again, the run has nothing left: one line, exit 0 (a script that resumes until the
    # run is done succeeds), nothing started or written.
    done = run_entry_point("core.train.cli", "--resume", run_dir)
    assert done.returncode == 0 and done.stderr.count("\n") == 1, done.stderr
    assert f"the run in {run_dir} already reached train.max_steps=3 (its newest checkpoint is step 3)" in done.stderr
    assert "--set train.max_steps=N (N > 3)" in done.stderr
    assert len(metrics(run_dir)) == 3


def test_exit_without_teardown_ends_idle_pool_workers_and_keeps_the_code():
    """A library's idle thread pool (inductor's compile workers after a cold compile) must not hold
    the process: the interpreter's own exit hooks end them before the join. Exit handlers run."""
    code = (
        "import atexit, concurrent.futures\n"
        "from core.lifecycle import exit_without_teardown\n"
        "pool = concurrent.futures.ThreadPoolExecutor(2)\n"
        "pool.submit(lambda: 1).result()\n"
        "atexit.register(lambda: print('handler ran', flush=True))\n"
        "exit_without_teardown(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "handler ran" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
