"""Per-step metrics: `RUN_DIR/metrics.jsonl`, a progress line, optional TensorBoard, a loss plot."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# Dense bf16 / fp8 peak of an H100 SXM (datasheet); MFU is quoted against these.
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}


def flops_per_token(active_params: int, embedding_params: int, num_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per non-embedding weight a token uses (all of them in a
    dense model; top_k of E routed experts in a MoE layer) plus causal attention's
    6*layers*dim*seq (the usual accounting, as in BENCHMARKS.md, so MFUs compare)."""
    return 6.0 * (active_params - embedding_params) + 6.0 * num_layers * dim * seq_len


class MetricsWriter:
    """Only the writer rank writes files; every rank may call it."""

    def __init__(self, run_dir: str | Path, enabled: bool, max_steps: int, tensorboard: bool = False):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.max_steps = max_steps
        self.history: list[dict] = []
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                log.warning("train.tensorboard=true but tensorboard is not installed: pip install tensorboard")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.history.append(record)
        self._file.write(json.dumps(record) + "\n")
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
        print(line, file=sys.stderr, flush=True)

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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.history]
        losses = [r["loss"] for r in self.history]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, losses, marker="." if len(steps) < 100 else None)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"Tessera: {self.run_dir.name}")
        ax.grid(alpha=0.3)
        path = self.run_dir / "loss.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
