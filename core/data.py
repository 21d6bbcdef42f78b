"""The trainer's side of the data service: find or start a server, open this rank's stream,
and turn a packed batch into model inputs on the device."""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.config import Config
from core.layers import AttentionMeta
from core.mesh import ParallelMesh
from dataservice.client import DataClient


@dataclass
class StepInputs:
    """One micro-batch, flattened and on the device."""

    tokens: torch.Tensor  # [T] long
    labels: torch.Tensor  # [T] long, -100 ignored
    position_ids: torch.Tensor  # [T] long
    meta: AttentionMeta
    num_tokens: float  # non-padding tokens this rank accounts for (host number, from the message)
    num_labels: float  # labels the loss counts, this rank's share


class LocalServer:
    """A data service on loopback in its own process, for `data.dataset`; stopped at exit."""

    def __init__(self, dataset: str, timeout: float = 120.0, cp_cost: str = ""):
        cmd = [sys.executable, "-m", "dataservice.cli", "serve", "--data", dataset, "--host", "127.0.0.1", "--port", "0",
               "--exit-with-parent"]
        if cp_cost:
            cmd += ["--cp-cost", cp_cost]
        # The server's log goes to a file: a pipe nobody reads would fill and stall it, and
        # the file's tail explains a failed start.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tessera-dataservice-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        self.address = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("serving on "):
                self.address = line.split("serving on ", 1)[1].strip()
                return
        self.stop()
        self.log.seek(0)
        tail = self.log.read()[-2000:]
        raise RuntimeError(f"the data service for '{dataset}' did not start (exit code {self.proc.poll()}):\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)  # the open handle still reads it


def resolve_address(config: Config) -> tuple[str, LocalServer | None]:
    """`data.address`, or a loopback server over `data.dataset` started by rank 0 and shared."""
    if config.data.address:
        return config.data.address, None
    if not config.data.dataset:
        raise ValueError("set data.address (a running data service) or data.dataset (a shard folder)")
    server = None
    box = [""]
    if not dist.is_initialized() or dist.get_rank() == 0:
        server = LocalServer(config.data.dataset, cp_cost=config.data.cp_cost)
        box[0] = server.address
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0], server


def open_stream(config: Config, mesh: ParallelMesh, address: str, resume_token: str | None = None):
    """This rank's stream: every tp/cp/pp peer of a data-parallel rank reads the same rows
    (the service is deterministic), so no broadcast inside the model-parallel group. With
    dynamic CP every tp/pp peer of a (dp, cp) rank reads the same plan entries."""
    t, p = config.train, config.parallel
    # Dynamic CP: the stream of this (dp, cp) rank carries its entries of each step's plan.
    cp = dict(cp_rank=mesh.coordinate("cp"), cp_size=mesh.size("cp"), dynamic_cp=True,
              cp_token_budget=p.cp_token_budget, rows_per_step=t.global_batch_size) if p.dynamic_cp else {}
    return DataClient(
        address.split(","),
        dp_rank=mesh.coordinate("dp"),
        dp_size=mesh.size("dp"),
        seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size,
        seed=t.seed,
        consumer=config.data.consumer,
        prefetch=config.data.prefetch,
        resume_token=resume_token,
        **cp,
    )


def to_inputs(batch, device: torch.device) -> StepInputs:
    seq_lens = batch.seq_lens
    max_seqlen = int(seq_lens.max()) if seq_lens.numel() else int(batch.tokens.shape[-1])
    labels = batch.labels.reshape(-1).to(device, torch.long, non_blocking=True)
    return StepInputs(
        tokens=batch.tokens.reshape(-1).to(device, torch.long, non_blocking=True),
        labels=labels,
        position_ids=batch.position_ids.reshape(-1).to(device, torch.long, non_blocking=True),
        meta=AttentionMeta(cu_seqlens=batch.cu_seqlens.to(device, torch.int32, non_blocking=True), max_seqlen=max_seqlen,
                           doc_lengths=tuple(batch.cu_seqlens.diff().tolist())),  # the client's tensors are on the host
        num_tokens=int(batch.num_tokens),
        num_labels=int((batch.labels != -100).sum()),
    )
