"""`tessera-plan --measure K`: run the best K plans for a few steps with the real trainer on this
node's GPUs and read back what they did.

Each plan runs as `tessera-train --config PLAN.toml --nproc-per-node N` in a run directory of
its own, on the config's data (`data.dataset` or `data.address`) or, when it names none, on a
synthetic dataset built once with `tessera-data build`'s code (documents close to seq_len
tokens, so most rows are one document, as the time model assumes). Read back from rank 0's
`metrics.jsonl`: the median `step_s` after the warm-up steps and the largest `mem_gb`
(torch.cuda.max_memory_allocated, GiB), the figures the planner predicts as `step_s` and
`peak_allocated` of rank 0.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from core.config import Config
from core.planner.search import config_toml
from core.metrics import read_metrics
from dataservice.build import build_dataset, make_corpus

WARMUP_STEPS = 2
RUN_TIMEOUT_S = 900


@dataclass
class Measured:
    step_s: float | None
    mem_gib: float | None
    error: str = ""  # why nothing was measured (the run's last line)


def synthetic_dataset(workdir: Path, seq_len: int) -> Path:
    """A small dataset of documents a little shorter than seq_len bytes (byte tokenizer: one
    token per byte, plus multi-byte characters); the data service repeats it in new epochs."""
    out = workdir / f"synthetic-{seq_len}"
    if (out / "manifest.json").is_file():
        return out
    length = max(16, int(seq_len * 0.9))
    corpus = make_corpus(workdir, n_docs=64, seed=0, min_len=length, max_len=length)
    build_dataset([corpus], out)
    return out


def run_plan(config: Config, world: int, steps: int, workdir: Path, name: str, device: str = "cuda") -> Measured:
    """Train `config` for `steps` steps on `world` local GPUs (or CPU processes: the tests); the
    figures of rank 0."""
    run = copy.deepcopy(config)
    t = run.train
    t.max_steps, t.stop_at_step, t.run_dir, t.device = steps, 0, str(workdir / name), device
    t.log_interval, t.plot, t.tensorboard = 1, False, False
    run.checkpoint.interval, run.checkpoint.save_at_end, run.checkpoint.init_from = 0, False, ""
    run.eval.interval = 0
    if not run.data.dataset and not run.data.address:
        run.data.dataset = str(synthetic_dataset(workdir, t.seq_len))
    path = workdir / f"{name}.toml"
    path.write_text(config_toml(run))
    command = [sys.executable, "-m", "core.train.cli", "--config", str(path), "--nproc-per-node", str(world), "--overwrite"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return Measured(None, None, f"no result within {RUN_TIMEOUT_S} s")
    records = [r for r in read_metrics(Path(t.run_dir) / "metrics.jsonl") if r.get("step_s")]
    if done.returncode != 0 or not records:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        return Measured(None, None, lines[-1][:200] if lines else f"exit code {done.returncode}")
    timed = records[WARMUP_STEPS:] or records[-1:]
    mems = [r["mem_gb"] for r in records if r.get("mem_gb") is not None]
    return Measured(statistics.median(r["step_s"] for r in timed), max(mems) if mems else None)
