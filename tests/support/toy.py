"""The models, batches and trainers of the data-parallel and checkpoint tests, with their
single-process references.

- A small GPT (CFG; 66 and 54 give uneven ZeRO chunks) on random global batches (ROWS x SEQ):
  `make_trainer` + `train_steps` under data (and tensor) parallelism, `reference_run` in one
  process with torch.optim.AdamW on the whole global batch, same hyperparameters (HYPER).
- ToyTP: a two-matrix toy whose params carry the tensor-parallel tags, small enough to give
  empty ZeRO chunks: `toy_train` on a mesh, `toy_reference` in one process.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core.config import ModelConfig
from core.layers import AttentionMeta
from core.parallel.data import apply_data_parallel
from core.parallel.tensor import apply_tp
from core.train.loss import cross_entropy_sum
from core.train.model import build_model
from core.train.optim import AdamW, WarmupCosine, clip_grad_norm_, uses_weight_decay

CFG = dict(vocab_size=66, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=54)  # 66, 54: uneven ZeRO chunks
ROWS, SEQ = 8, 12
HYPER = dict(lr=1e-2, min_lr=1e-3, warmup=2, max_steps=6, wd=0.1, betas=(0.9, 0.95), eps=1e-8)


def global_batch(step: int, rows: int = ROWS, seq: int = SEQ, vocab: int = CFG["vocab_size"]):
    """Random rows (one document each) with ~15% of labels ignored, so ranks' token counts differ."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[torch.rand(rows, seq, generator=g) < 0.15] = -100
    return tokens[:, :-1], labels


def batch_loss(model, inputs, labels, global_count, tp_group=None):
    """Sum cross entropy over a packed micro-batch of rows, divided by the global label count
    (vocab-parallel cross entropy when the model is tensor-parallel)."""
    rows, seq = inputs.shape
    dev = inputs.device
    meta = AttentionMeta(cu_seqlens=torch.arange(rows + 1, dtype=torch.int32, device=dev) * seq, max_seqlen=seq)
    logits = model(inputs.reshape(-1), torch.arange(seq, device=dev).repeat(rows), meta)
    if tp_group is not None:
        return cross_entropy_sum(logits, labels.reshape(-1), tp_group)[0] / global_count
    return F.cross_entropy(logits.float(), labels.reshape(-1), ignore_index=-100, reduction="sum") / global_count


def reference_run(steps: int, clip: float | None, start_params=None):
    """Single process, torch.optim.AdamW: (losses, grad norms, final params)."""
    model = build_model(ModelConfig(**CFG), seed=7)
    decay = [p for p in model.parameters() if uses_weight_decay(p)]
    no_decay = [p for p in model.parameters() if not uses_weight_decay(p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": HYPER["wd"]}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])
    sched = WarmupCosine(SimpleNamespace(lr=0.0), HYPER["lr"], HYPER["min_lr"], HYPER["warmup"], HYPER["max_steps"])
    losses, norms = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = sched.lr_at(step)
        inputs, labels = global_batch(step)
        loss = batch_loss(model, inputs, labels, (labels != -100).sum())
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def make_trainer(mesh, *, zero=True, bucket_mb=0.01, param_dtype=torch.float32, device="cpu", split=False,
                 offload=False, host_limit_gb=0.0, moments_dtype=torch.float32):
    """The CFG model (seed 7) under data parallelism on `mesh` (tensor parallelism with sequence
    parallelism first where mesh.tp > 1): (model, DataParallel, AdamW, WarmupCosine) at HYPER;
    `offload`: the optimizer state in host memory; `moments_dtype`: AdamW's moments (fp32 or bf16)."""
    model = build_model(ModelConfig(**CFG), seed=7).to(device)
    if mesh.tp > 1:
        apply_tp(model, mesh, sequence_parallel=True)
    dp = apply_data_parallel(model, mesh, bucket_mb=bucket_mb, distributed_optimizer=zero, param_dtype=param_dtype,
                             split_masters=split, offload=offload,
                             host_limit_gb=host_limit_gb, moments_dtype=moments_dtype)
    opt = AdamW(dp, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], weight_decay=HYPER["wd"])
    sched = WarmupCosine(opt, HYPER["lr"], HYPER["min_lr"], HYPER["warmup"], HYPER["max_steps"])
    return model, dp, opt, sched


def train_steps(model, dp, opt, sched, mesh, steps, *, accum=1, clip=None, start=0, no_host_sync=False, defer_clip=False):
    """DP training: rank takes rows [r*B/dp, (r+1)*B/dp), split into `accum` micro-batches;
    only the last one synchronises. Returns (global losses, grad norms). `no_host_sync`
    (CUDA): backward (with the bucket hooks), grad sync, clipping and the optimizer step run
    under torch.cuda.set_sync_debug_mode("error"), so any host sync among them fails."""
    dp_size, dp_rank = mesh.size("dp_cp"), mesh.coordinate("dp")
    tp_group = mesh.group("tp") if mesh.tp > 1 else None
    device = dp.device
    strict = _sync_debug if no_host_sync else contextlib.nullcontext
    losses, norms = [], []
    for step in range(start, start + steps):
        inputs, labels = (t.to(device) for t in global_batch(step))
        count = (labels != -100).sum()
        rows = ROWS // dp_size
        mine_in, mine_lab = inputs[dp_rank * rows:(dp_rank + 1) * rows], labels[dp_rank * rows:(dp_rank + 1) * rows]
        micro = rows // accum
        total = torch.zeros((), device=device)
        for k in range(accum):
            sync = contextlib.nullcontext() if k == accum - 1 else dp.no_sync()
            with sync:
                loss = batch_loss(model, mine_in[k * micro:(k + 1) * micro], mine_lab[k * micro:(k + 1) * micro], count, tp_group)
                with strict():
                    loss.backward()
            total += loss.detach()
        with strict():
            dp.finish_grad_sync()
            norm = clip_grad_norm_(dp, clip, mesh, defer=defer_clip)
            opt.step()
            sched.step()
            opt.zero_grad()
        if mesh.distributed:
            dist.all_reduce(total, group=mesh.group("dp_cp"))
        losses.append(float(total))
        norms.append(float(norm))
    return losses, norms


@contextlib.contextmanager
def _sync_debug():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class ToyTP(nn.Module):
    """Pieces p of a global batch use row-slice t = p % 2 of W [4,3] and column-slice t of
    V [3,4]; g [3] scales inputs (a norm-like weight). Under tp=2 each rank holds slice t =
    tp rank (tp_shard_dim 0 / 1) and its tokens, so g's grads are sequence-parallel partials."""

    def __init__(self, tp: int, tp_rank: int):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        w, v, gain = torch.randn(4, 3, generator=g), torch.randn(3, 4, generator=g), 1 + 0.1 * torch.randn(3, generator=g)
        rows = slice(2 * tp_rank, 2 * tp_rank + 2) if tp == 2 else slice(None)
        self.w, self.v, self.g = nn.Parameter(w[rows].clone()), nn.Parameter(v[:, rows].clone()), nn.Parameter(gain)
        self.w.tp_shard_dim, self.w.tp_full_shape = 0, (4, 3)
        self.v.tp_shard_dim, self.v.tp_full_shape = 1, (3, 4)
        self.g.tp_shard_dim, self.g.sequence_parallel_partial = None, tp > 1
        self.tp = tp

    def forward(self, x: torch.Tensor, piece: int) -> torch.Tensor:
        t = piece % 2
        w = self.w if self.tp == 2 else self.w[2 * t:2 * t + 2]
        v = self.v if self.tp == 2 else self.v[:, 2 * t:2 * t + 2]
        return torch.tanh(v @ torch.tanh(w @ (self.g * x).T)).sum()


def toy_pieces(step: int):
    """The 4 pieces (5 x 3 inputs) of global step `step`."""
    g = torch.Generator().manual_seed(50 + step)
    return [torch.randn(5, 3, generator=g) for _ in range(4)]


def toy_train(model, dp, opt, mesh, steps, start=0, clip=0.5):
    """Rank (d, t) handles piece 2d + t at tp=2; rank d handles piece d at tp=1 (dp=4)."""
    losses = []
    piece = 2 * mesh.coordinate("dp") + mesh.coordinate("tp") if mesh.tp == 2 else mesh.coordinate("dp")
    for step in range(start, start + steps):
        loss = model(toy_pieces(step)[piece], piece)
        loss.backward()
        clip_grad_norm_(dp, clip, mesh)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def toy_reference(steps, clip=0.5):
    """Single process, torch.optim.AdamW, every piece each step: (losses, trained model)."""
    model = ToyTP(1, 0)
    opt = torch.optim.AdamW([{"params": [model.w, model.v], "weight_decay": 0.1}, {"params": [model.g], "weight_decay": 0.0}],
                            lr=0.05, betas=(0.9, 0.95))
    losses = []
    for step in range(steps):
        loss = sum(model(x, p) for p, x in enumerate(toy_pieces(step)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model
