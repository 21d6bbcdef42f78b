"""`tessera-train` run as a command on a small dataset, and what its run directory records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dataservice.build import build_dataset, make_corpus
from tests.support.cli import ROOT, child_env

CONFIG = ROOT / "launch" / "configs" / "tiny_dense.toml"
MOE_CONFIG = ROOT / "launch" / "configs" / "tiny_moe.toml"
#: A model and batch small enough for 4 CPU processes: 4 steps of 8 packed rows of 64 tokens.
SMALL = [
    "model.dim=64", "model.num_layers=2", "model.ffn_dim=128", "train.seq_len=64",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.max_steps=4",
    "train.warmup_steps=1", "train.plot=false",
]
#: Layouts against the single process: fp32 on CPU, reduction order only, over a few AdamW steps.
RTOL = 2e-4
#: For a reference run whose checkpoint nothing reads: the save after its last step (a DCP
#: import and a collective write, about a second per rank) changes none of its losses.
NO_SAVE = "checkpoint.save_at_end=false"


def build_small_dataset(tmp: Path) -> Path:
    """300 documents of 16-600 bytes (byte tokenizer), built under `tmp`."""
    return build_dataset([make_corpus(tmp, n_docs=300, seed=3, min_len=16, max_len=600)], tmp / "shards")


def run_train(run_dir: Path, dataset: Path, nproc: int, *extra: str, resume: bool = False, check: bool = True,
              config: Path = CONFIG) -> subprocess.CompletedProcess:
    """`tessera-train` on `config` with SMALL, then `extra` (`--set` items), on `nproc` processes;
    fails the test on a non-zero exit unless `check` is false."""
    cmd = [sys.executable, "-m", "core.train.cli", "--config", str(config)]
    for item in [*SMALL, f"data.dataset={dataset}", f"train.run_dir={run_dir}", *extra]:
        cmd += ["--set", item]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    if resume:
        cmd.append("--resume")
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"tessera-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl, in order; none before the file exists."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(run_dir: Path) -> dict[int, float]:
    """{step: training loss} of a finished run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def val_records(run_dir: Path) -> dict[int, dict]:
    """{step: record} of the records that carry a validation loss."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "val_loss" in r}


def tail_mean(values: dict[int, float], n: int = 20) -> float:
    """The mean of the last `n` steps' values: where two long runs' losses are compared."""
    steps = sorted(values)[-n:]
    return sum(values[s] for s in steps) / len(steps)
