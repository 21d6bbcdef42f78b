"""Per-step metrics: `RUN_DIR/metrics.jsonl`, a progress line (with the time elapsed and an ETA),
optional TensorBoard (`train.tensorboard`, the `tensorboard` package), a loss plot."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# Dense bf16 / fp8 peak of an H100 SXM (datasheet); MFU is quoted against these.
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}


def flops_per_token(active_params: int, embedding_params: int, num_layers: int, dim: int, seq_len: int,
                    mtp_layers: int = 0, head_params: int = 0) -> float:
    """Training FLOPs per token: 6 per non-embedding weight a token uses (all of them in a
    dense model; top_k of E routed experts in a MoE layer) plus causal attention's
    6*layers*dim*seq (the usual accounting, as in BENCHMARKS.md, so MFUs compare); `dim` is the
    attention width, num_heads * head_dim (model.dim unless model.head_dim sets another size;
    multi-head latent attention: the mean of its query/key and value head sizes,
    core.rules.attention_width). Multi-token prediction: `active_params` holds its modules'
    weights once, each depth's block adds its attention, and each depth runs the shared output
    head again (`head_params`: the head's weights as counted above, 0 when tied to the embedding)."""
    return (6.0 * (active_params - embedding_params + mtp_layers * head_params)
            + 6.0 * (num_layers + mtp_layers) * dim * seq_len)


def tensorboard_missing() -> str | None:
    """Why TensorBoard events cannot be written here, or None (checked at start when asked for)."""
    try:
        importlib.import_module("torch.utils.tensorboard")  # imports the `tensorboard` package
    except ImportError as err:
        return f"the tensorboard package does not import here ({err})"
    return None


def format_duration(seconds: float) -> str:
    """12s, 3m05s, 2h14m, 1d03h: the progress line's clock."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a process killed mid-write) is skipped."""
    records = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


class MetricsWriter:
    """Only the writer rank writes files; every rank may call it."""

    def __init__(self, run_dir: str | Path, enabled: bool, max_steps: int, tensorboard: bool = False,
                 start_step: int = 0, last_step: int = 0, clock: Callable[[], float] = time.monotonic):
        """`start_step`: the step the run continues from. The records of earlier steps are kept
        (the plot shows the whole run); later ones, written by an interrupted attempt, are
        dropped, so each step has one record. `last_step`: where this launch stops (default
        `max_steps`), what the ETA counts to; `clock`: seconds, for the elapsed time and the ETA."""
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.max_steps = max_steps
        self.last_step = last_step or max_steps
        self.history: list[dict] = []
        self._tb = None
        self._clock = clock
        self._started = clock()
        self._first: tuple[int, float] | None = None  # (step, time) of this launch's first record
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        self.history = [r for r in read_metrics(path) if r["step"] <= start_step] if start_step else []
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        os.replace(tmp, path)
        self._file = open(path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: events of steps after the resume point are discarded.
                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
            except ImportError:
                log.warning("train.tensorboard=true but tensorboard is not installed: pip install tensorboard")

    def log(self, record: dict, show: bool = True) -> None:
        """Every step goes to metrics.jsonl; `show`: also the progress line and TensorBoard."""
        if not self.enabled:
            return
        now = self._clock()
        if self._first is None:
            self._first = (record["step"], now)
        self.history.append(record)
        self._file.write(json.dumps(record) + "\n")
        if not show:
            return
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])
        mfu = record.get("mfu")
        line = (
            f"step {record['step']:>5}/{self.max_steps} | loss {record['loss']:.4f} | grad {record['grad_norm']:.3f}"
            f" | lr {record['lr']:.2e} | {record['tokens_per_s'] / 1e3:8.1f}k tok/s"
            f" | mfu {'-' if mfu is None else f'{100 * mfu:.1f}%'} | mem {record['mem_gb']:.2f} GB"
        )
        if "mtp_loss" in record:  # the mean of the multi-token prediction depths' losses
            line += f" | mtp {record['mtp_loss']:.4f}"
        if "val_loss" in record:
            line += f" | val {record['val_loss']:.4f}"
        line += f" | {format_duration(now - self._started)} elapsed, eta {format_duration(self._eta(record, now))}"
        print(line, file=sys.stderr, flush=True)

    def _eta(self, record: dict, now: float) -> float:
        """Seconds to `last_step` at the pace since this launch's first record (evaluations and
        saves included; the first step's start-up is not), or the step's own time before that."""
        first_step, first_time = self._first
        done = record["step"] - first_step
        per_step = (now - first_time) / done if done > 0 else record["step_s"]
        return max(self.last_step - record["step"], 0) * per_step

    def close(self, plot: bool) -> Path | None:
        if not self.enabled:
            return None
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if plot and self.history:
            return self._plot()
        return None

    def _plot(self) -> Path:
        return plot_losses(self.run_dir, self.history)


def plot_losses(run_dir: Path, records: list[dict]) -> Path:
    """RUN_DIR/loss.png: the training loss of `records` by step, and the validation loss where
    they have one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, marker="." if len(steps) < 100 else None, label="training")
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if evals:
        ax.plot(*zip(*evals), marker="o", label="validation")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"Tessera: {Path(run_dir).name}")
    ax.grid(alpha=0.3)
    path = Path(run_dir) / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
