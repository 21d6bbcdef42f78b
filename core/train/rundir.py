"""A run directory that protects itself: an owner lock, the run's own config, and start rules.

    RUN_DIR/run.lock      host and pid of the process that owns the run while it is running
    RUN_DIR/config.toml   the effective config (after every --set), written at start
    RUN_DIR/launch.toml   how its processes were started (core/train/launch_shape.py), written at start
    RUN_DIR/metrics.jsonl one record per step, across resumes
    RUN_DIR/checkpoints/  complete checkpoints only (partial `.tmp` saves are removed at start)

A second run on a directory in use is refused; a lock whose owner died (same host, no such
process) is taken over with a message. Starting into a directory that holds a run needs
`--resume` (continue it) or `--overwrite` (start again); resuming a run that already reached
its last step says so (`nothing_left`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
from pathlib import Path

import tomli_w

from core.state.checkpoint import latest_checkpoint, step_of
from core.config import Config, ConfigError, leaf_values, load_config

LOCK_NAME = "run.lock"
CONFIG_NAME = "config.toml"
LAUNCH_NAME = "launch.toml"
METRICS_NAME = "metrics.jsonl"
# Set by `tessera-train` for the workers it launches: the launcher holds the lock for them.
LOCK_OWNER_ENV = "TESSERA_RUN_LOCK_OWNER"
# torchrun names the job in its workers' environment (--rdzv-id; a fresh id per standalone run):
# a restarted worker group, or a requeued batch job, takes over the lock of its own earlier attempt,
# wherever that ran.
JOB_ENV = "TORCHELASTIC_RUN_ID"

# Resuming with these changed is refused: the checkpoint's tensors would not fit the model.
SHAPE_KEYS = {
    "model.vocab_size", "model.dim", "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.ffn_dim",
    "model.tie_embeddings", "model.moe.num_experts", "model.moe.ffn_dim", "model.moe.num_shared_experts",
    "model.moe.shared_ffn_dim", "model.moe.first_k_dense", "model.moe.moe_every", "model.moe.n_groups",
    "model.head_dim", "model.qk_norm", "model.attention_bias", "model.moe.dense_layers",
}
# Resuming with these changed is refused too: the data stream's order and the checkpoint's
# resume token (a position in packed rows) follow them.
STREAM_KEYS = {"train.seed", "train.seq_len"}
# Changes that leave the trajectory alone: layout (proved equal to the single process),
# speed settings, logging and where things go.
NEUTRAL_PREFIXES = ("parallel.", "checkpoint.")
NEUTRAL_KEYS = {
    "train.stop_at_step", "train.run_dir", "train.log_interval", "train.tensorboard", "train.plot", "train.device",
    "train.hang_timeout_s",
    "train.compile", "train.recompute", "train.fp8_weight_cache", "data.prefetch", "data.consumer", "data.address",
    "data.cp_cost", "data.auth_token_file", "data.tls_ca_file", "data.tls_cert_file", "data.tls_key_file", "train.micro_batch_size",
}


class RunDirError(Exception):
    """A run directory the run cannot start in; the message is meant for the user (exit 2)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """`RUN_DIR/run.lock`, created exclusively; released on `release()` (and taken over once stale)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def acquire(self) -> str | None:
        """Take the lock or raise RunDirError; returns a message when a stale lock was taken over."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        job = os.environ.get(JOB_ENV, "") if "RANK" in os.environ else ""
        if job:
            me["job"] = job
        message = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self.owner()
                if owner is None:  # being written right now, or torn: look again once
                    time.sleep(0.2)
                    owner = self.owner() or {}
                host, pid = owner.get("host", "?"), int(owner.get("pid", 0) or 0)
                if str(pid) == os.environ.get(LOCK_OWNER_ENV) or (host == me["host"] and pid == me["pid"]):
                    return None  # our launcher holds it for us
                if job and owner.get("job") == job and pid != me["pid"]:
                    message = f"{self.path.parent}: taking over the lock of an earlier attempt of job {job} ({host}, pid {pid})"
                    self.path.unlink(missing_ok=True)
                    continue
                if host == me["host"] and not _pid_alive(pid):
                    message = f"{self.path.parent}: taking over the lock of process {pid}, which no longer runs"
                    self.path.unlink(missing_ok=True)
                    continue
                raise RunDirError(
                    f"run directory '{self.path.parent}' is in use by process {pid} on {host} "
                    f"(since {owner.get('since', '?')}); wait for it, stop it, or choose another train.run_dir")
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return message
        raise RunDirError(f"could not take the lock {self.path}: another process took it at the same time")

    def release(self) -> None:
        if self.held:
            owner = self.owner() or {}
            if owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False


def holds_a_run(run_dir: Path, ckpt_dir: Path) -> bool:
    metrics = run_dir / METRICS_NAME
    return (metrics.is_file() and metrics.stat().st_size > 0) or any(ckpt_dir.glob("step_*")) \
        or (run_dir / CONFIG_NAME).is_file()


def prepare(run_dir: Path, ckpt_dir: Path, resume: bool, overwrite: bool) -> None:
    """Apply the start rules to a locked run directory."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: continue the run or start it again")
    if holds_a_run(run_dir, ckpt_dir) and not resume:
        if not overwrite:
            raise RunDirError(f"run directory '{run_dir}' already holds a run: continue it with --resume {run_dir}, "
                              f"start it again with --overwrite, or choose another train.run_dir")
        for name in (METRICS_NAME, CONFIG_NAME, LAUNCH_NAME, "loss.png"):
            (run_dir / name).unlink(missing_ok=True)
        for folder in (ckpt_dir, run_dir / "tensorboard"):
            shutil.rmtree(folder, ignore_errors=True)
    remove_partial_checkpoints(ckpt_dir)
    if resume and latest_checkpoint(ckpt_dir) is None:
        raise RunDirError(f"--resume: no complete checkpoint in '{ckpt_dir}'; start the run again with --overwrite")


def nothing_left(run_dir: Path, ckpt_dir: Path, max_steps: int, stop_at_step: int = 0) -> str | None:
    """On resume: the line saying that the run already reached its last step, or None."""
    latest = latest_checkpoint(ckpt_dir)
    if latest is None:
        return None  # nothing to resume: `prepare` says so
    step = step_of(latest)
    if step >= max_steps:
        return (f"the run in {run_dir} already reached train.max_steps={max_steps} (its newest checkpoint is step "
                f"{step}): nothing to train; to train further, resume with --set train.max_steps=N (N > {step})")
    if stop_at_step and step >= stop_at_step:
        return (f"the run in {run_dir} already reached train.stop_at_step={stop_at_step} (its newest checkpoint is "
                f"step {step}): nothing to train; continue with --set train.stop_at_step=0 (to train.max_steps="
                f"{max_steps}) or a later step")
    return None


def remove_partial_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Saves that died leave `step_N.tmp` (and `.old` from a re-save); they are never loaded."""
    removed = []
    for pattern in ("step_*.tmp", "step_*.old", "latest.tmp.*"):
        for path in ckpt_dir.glob(pattern):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def config_dict(config: Config) -> dict:
    data = dataclasses.asdict(config)
    data["parallel"]["dp"] = 0  # derived from the world size: a resume may run on another one
    return data


def save_config(run_dir: Path, config: Config) -> Path:
    path = run_dir / CONFIG_NAME
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text("# The effective config of this run (written at start); `tessera-train --resume RUN_DIR` reads it.\n"
                   + tomli_w.dumps(config_dict(config)))
    os.replace(tmp, path)
    return path


def load_saved_config(run_dir: Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    path = run_dir / CONFIG_NAME
    if not path.is_file():
        raise RunDirError(f"'{run_dir}' has no {CONFIG_NAME}: it is not a run directory "
                          f"(resume a run by its train.run_dir, or pass --config as well)")
    return load_config(path, overrides)


def compare(saved: Config, new: Config) -> tuple[list[str], list[str]]:
    """(changes that alter the trajectory, changes that cannot work) from `saved` to `new`."""
    before, after = leaf_values(saved), leaf_values(new)
    altering, impossible = [], []
    for key in sorted(after):
        if before.get(key) == after[key]:
            continue
        text = f"{key} {before.get(key)!r} -> {after[key]!r}"
        if key in SHAPE_KEYS or key in STREAM_KEYS:
            impossible.append(text)
        elif key not in NEUTRAL_KEYS and not key.startswith(NEUTRAL_PREFIXES):
            altering.append(text)
    return altering, impossible


def check_resume_changes(saved: Config, new: Config) -> str | None:
    """None, or the one line listing trajectory changes; raises ConfigError for shape changes."""
    altering, impossible = compare(saved, new)
    if impossible:
        raise ConfigError(f"cannot resume with {'; '.join(impossible)}: the checkpoint's tensors (model shape) or "
                          f"its data position (seed, seq_len) would not fit; start a new run (another "
                          f"train.run_dir, or --overwrite) instead")
    if altering:
        return "resuming with changes that alter the trajectory: " + "; ".join(altering)
    return None
