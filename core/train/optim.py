"""AdamW over the data-parallel layout (plain or ZeRO-1), warmup + cosine LR, global grad clipping.

`AdamW(dp, ...)` updates each `ParamSlot`'s fp32 master chunk from its reduced gradient
(`slot.shard_grad`) with torch's AdamW arithmetic (decoupled weight decay, bias-corrected
moments), then `dp.gather_params()` writes the new weights into the model. On a GPU with
Triton the update also writes the new weights in the param dtype in the same pass
(`core.kernels.adamw`; elsewhere torch's fused or foreach AdamW, then a copy). With
`distributed_optimizer` the masters and both moments cover only this rank's chunk, so optimizer
memory per rank falls as 1/dp_cp; otherwise every rank holds them whole.

Offload (`train.optimizer_offload`, `dp.host` set): masters and moments are host tensors and
the update runs on the CPU, bucket by bucket, with torch's fused CPU AdamW kernel (one pass
over the state; on 4M and 16M fp32 elements it ran 3 to 5 times faster than the foreach ops,
docs/performance-notes.md); each bucket's new weights are queued for the device
(`HostOffload.push`) while the CPU updates the next bucket. The clip factor reaches the host
as one number, the kernel's grad_scale (the same place as on the device).

bf16 moments (`train.optimizer_moments_dtype = "bf16"`, `dp.moments_dtype`): both moments are
stored in bf16, on the device or on the host, 4 bytes per element instead of 8; the masters stay
fp32. Every update runs in fp32 and rounds the new moments to nearest even: the Triton kernel
widens and rounds them in its own pass; the torch paths (fused, foreach, the host's) copy the
moments of at most `MOMENT_CHUNK` elements at a time into an fp32 scratch buffer kept between
steps (8 MiB on the device, or on the host under offload), update there, and round back
(`_fp32_moments`). Range: bf16 has fp32's exponent, so a small exp_avg_sq does not underflow
(fp16's would flush gradients below 2e-4 to a zero v), and eps is added to sqrt(v) in fp32, as
with fp32 moments. Precision: 8 significant bits, so a step changes a moment only where the
change, (1 - beta) of the gap to the new gradient term, exceeds half a unit in the last place
(2^-9 to 2^-8 of the value): with beta2 = 0.95 v follows any g^2 more than 8% away from it; at
beta >= 1 - 2^-8 a moment would stop decaying, which validation refuses (core.validation).

Weight decay: applied to every parameter with >= 2 dims (linear weights, embeddings, output
head, stacked experts); not to 1-D params (norm gains, biases). This is Megatron-LM's and
nanoGPT's rule; decaying embeddings too is their common practice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import torch
import torch.distributed as dist

from core import placement
from core.kernels.adamw import AdamWTables, multi_tensor_adamw, multi_tensor_adamw_supported
from core.config import Config
from core.mesh import ParallelMesh
from core.parallel.data import DataParallel
from core.parallel.offload import check_host_memory
from core.planner.state import state_bytes

log = logging.getLogger(__name__)
# Elements whose bf16 moments the torch paths update at once in fp32. On one CPU core the host
# step over 16M elements took 1.2x the time of fp32 moments at 1M (the scratch in cache), 1.6x at 4M.
MOMENT_CHUNK = 1 << 20


def uses_weight_decay(param: torch.Tensor) -> bool:
    """Decay matrices and embeddings, not norm gains or biases."""
    return param.dim() >= 2


class AdamW:
    """AdamW on fp32 master chunks owned by a `DataParallel` handle (ZeRO-1 when it shards)."""

    def __init__(self, dp: DataParallel, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, fused: bool | None = None):
        for name, value, ok in (
            ("lr", lr, lr >= 0), ("eps", eps, eps >= 0), ("weight_decay", weight_decay, weight_decay >= 0),
            ("beta1", betas[0], 0 <= betas[0] < 1), ("beta2", betas[1], 0 <= betas[1] < 1),
        ):
            if not ok or not math.isfinite(value):
                raise ValueError(f"AdamW {name}={value} is out of range (lr, eps, weight_decay >= 0; 0 <= beta < 1)")
        self.dp = dp
        self.fused = dp.device.type == "cuda" if fused is None else fused  # torch's fused kernel also runs on CPU
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        self._step_tensor: torch.Tensor | None = None
        self._tables = AdamWTables()
        self._scratch: dict[torch.device, torch.Tensor] = {}  # bf16 moments' fp32 copies (_upcast)
        self.moments_dtype = dp.moments_dtype
        # On the host under offload; fp32 or bf16 (dp.moments_dtype), always updated in fp32.
        self.exp_avg = [torch.zeros_like(s.master, dtype=self.moments_dtype) for s in dp.slots]
        self.exp_avg_sq = [torch.zeros_like(s.master, dtype=self.moments_dtype) for s in dp.slots]
        self._decayed = [uses_weight_decay(s.param) for s in dp.slots]
        self._groups = [[i for i, d in enumerate(self._decayed) if d], [i for i, d in enumerate(self._decayed) if not d]]

    @torch.no_grad()
    def step(self) -> None:
        """One update of the local master chunks, then the params are refreshed everywhere."""
        self.dp.finish_grad_sync()
        self.step_count += 1
        clip = self.dp.pending_grad_scale
        self.dp.pending_grad_scale = None
        if self.dp.host is not None:
            self._host_step(clip)
            return
        if self.fused and self._triton_step(clip):
            self.dp.gather_params(targets_written=True)
            return
        masters = [s.master for s in self.dp.slots]  # split masters: fp32 copies, written back below
        if self.fused:
            self._fused_step(masters, clip)
        else:
            if clip is not None:
                torch._foreach_mul_(self.dp.local_grads(), clip)
            self._foreach_step(masters)
        if self.dp.split_masters:
            for slot, master in zip(self.dp.slots, masters):
                slot.write_master(master)
        self.dp.gather_params()

    def _triton_step(self, clip: torch.Tensor | None) -> bool:
        """The update and the cast of the new weights into the params (or the all-gather's send
        buffer) in one launch (core.kernels.adamw); False where it cannot run here."""
        slots, split = self.dp.slots, self.dp.split_masters
        masters = [s.master_high() for s in slots] if split else [s.master for s in slots]
        lows = [s.master_low for s in slots] if split else None
        grads = [s.shard_grad for s in slots]
        fp32 = grads + ([] if split else masters)
        if not multi_tensor_adamw_supported(fp32, [], self.exp_avg + self.exp_avg_sq) or (
                split and not all(t.is_contiguous() for t in masters + lows)):
            return False
        targets = self.dp.weight_targets()  # asked only here: under ZeRO it allocates the send buffers
        if not multi_tensor_adamw_supported(grads, targets):
            return False
        decays = [self.weight_decay if decayed else 0.0 for decayed in self._decayed]
        multi_tensor_adamw(self._tables, masters, grads, self.exp_avg, self.exp_avg_sq, targets, decays,
                           lr=self.lr, betas=self.betas, eps=self.eps, step=self.step_count,
                           grad_scale=None if clip is None else clip.reshape(1).to(torch.float32), lows=lows)
        return True

    def _fused_step(self, masters: list[torch.Tensor], clip: torch.Tensor | None = None) -> None:
        """torch's fused AdamW kernel: one pass over master, grad and moments. The foreach
        form below makes ~8 passes over fp32 state, which on a 1B model costs more than a
        quarter of the step (memory bound). A pending clip factor rides in as the kernel's
        grad_scale (it divides), which saves a separate pass over the grads."""
        inverse_clip = None if clip is None else (1.0 / clip).reshape(1).to(torch.float32)
        if self._step_tensor is None:
            self._step_tensor = torch.zeros((), dtype=torch.float32, device=self.dp.device)
        self._step_tensor.fill_(self.step_count)
        beta1, beta2 = self.betas
        grads = [s.shard_grad for s in self.dp.slots]
        for group, wd in zip(self._groups, (self.weight_decay, 0.0)):
            for ps, gs, ms, vs in self._fp32_moments(group, masters, grads):
                torch._fused_adamw_(ps, gs, ms, vs, [], [self._step_tensor] * len(ps), lr=self.lr, beta1=beta1,
                                    beta2=beta2, weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False,
                                    grad_scale=inverse_clip)

    def _host_step(self, clip: torch.Tensor | None) -> None:
        """Offload: the update of each bucket's host masters from its host grads on the CPU, then
        that bucket's weights queued for the device; the all-gathers once all are queued."""
        grads = self.dp.local_grads()  # waits for the gradient copies
        inverse_clip = None if clip is None else (1.0 / clip).reshape(1).to("cpu", torch.float32)
        if self._step_tensor is None:
            self._step_tensor = torch.zeros((), dtype=torch.float32)
        self._step_tensor.fill_(self.step_count)
        index = {id(s): i for i, s in enumerate(self.dp.slots)}
        slots, beta1, beta2 = self.dp.slots, *self.betas
        masters = [s.master for s in slots]
        for bucket in self.dp.buckets:
            mine = [index[id(s)] for s in bucket.slots]
            for wd, group in ((self.weight_decay, [i for i in mine if self._decayed[i]]),
                              (0.0, [i for i in mine if not self._decayed[i]])):
                for ps, gs, ms, vs in self._fp32_moments(group, masters, grads):
                    torch._fused_adamw_(ps, gs, ms, vs, [], [self._step_tensor] * len(ps), lr=self.lr, beta1=beta1,
                                        beta2=beta2, weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False,
                                        grad_scale=inverse_clip)
            self.dp.host.push(bucket)
        self.dp.gather_params(targets_written=True)

    def _foreach_step(self, masters: list[torch.Tensor]) -> None:
        beta1, beta2 = self.betas
        bias1 = 1 - beta1**self.step_count
        bias2_sqrt = math.sqrt(1 - beta2**self.step_count)
        all_grads = [s.shard_grad for s in self.dp.slots]
        for group, wd in zip(self._groups, (self.weight_decay, 0.0)):
            for params, grads, m, v in self._fp32_moments(group, masters, all_grads):
                if wd:
                    torch._foreach_mul_(params, 1 - self.lr * wd)
                torch._foreach_lerp_(m, grads, 1 - beta1)
                torch._foreach_mul_(v, beta2)
                torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
                denom = torch._foreach_sqrt(v)
                torch._foreach_div_(denom, bias2_sqrt)
                torch._foreach_add_(denom, self.eps)
                torch._foreach_addcdiv_(params, m, denom, value=-self.lr / bias1)

    def _fp32_moments(self, group: list[int], masters: list[torch.Tensor], grads: list[torch.Tensor]):
        """(masters, grads, exp_avgs, exp_avg_sqs) of the slots in `group` for a torch AdamW
        kernel, moments in fp32: fp32 moments as they are, in one piece; bf16 moments in pieces
        of at most MOMENT_CHUNK elements (tensors cut by rows), each piece's moments copied into
        an fp32 scratch buffer and, once the caller has updated them there, rounded back to
        nearest even (torch's fp32 -> bf16 cast). Empty tensors (empty ZeRO chunks) are left out."""
        group = [i for i in group if masters[i].numel()]
        if self.moments_dtype == torch.float32:
            if group:
                yield ([masters[i] for i in group], [grads[i] for i in group], [self.exp_avg[i] for i in group],
                       [self.exp_avg_sq[i] for i in group])
            return
        piece, size = [], 0
        for i in group:
            for views in _rows((masters[i], grads[i], self.exp_avg[i], self.exp_avg_sq[i]), MOMENT_CHUNK):
                if size + views[0].numel() > MOMENT_CHUNK and piece:
                    yield from self._upcast(piece, size)
                    piece, size = [], 0
                piece.append(views)
                size += views[0].numel()
        if piece:
            yield from self._upcast(piece, size)

    def _upcast(self, piece: list[tuple[torch.Tensor, ...]], size: int):
        """One piece of `_fp32_moments`: the bf16 moments into the fp32 scratch (kept from step to
        step: a fresh allocation each piece costs the host more than the update, by page faults),
        yielded, then rounded back. The scratch is 2 x 4 bytes x MOMENT_CHUNK: 8 MiB."""
        device = piece[0][0].device
        scratch = self._scratch.get(device)
        if scratch is None or scratch.numel() < 2 * size:
            scratch = self._scratch[device] = torch.empty(2 * max(size, MOMENT_CHUNK), dtype=torch.float32,
                                                          device=device)
        m32, v32, offset = [], [], 0
        for _, _, m, v in piece:
            n = m.numel()
            m32.append(scratch[offset:offset + n].view(m.shape))
            v32.append(scratch[size + offset:size + offset + n].view(v.shape))
            offset += n
        moments = [m for *_, m, _ in piece] + [v for *_, v in piece]
        torch._foreach_copy_(m32 + v32, moments)
        yield [p[0] for p in piece], [p[1] for p in piece], m32, v32
        torch._foreach_copy_(moments, m32 + v32)

    def zero_grad(self) -> None:
        self.dp.zero_grad()

    def state_bytes(self) -> int:
        """Bytes this rank holds for optimizer state: both moments (4 or 2 bytes an element each),
        plus fp32 masters where they are not the params themselves (in host memory under offload)."""
        moments = sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)
        masters = sum(s.master_low.numel() * 2 if s.master_low is not None else s.master.numel() * 4
                      for s in self.dp.slots if not s.master_is_param)
        return moments + masters


def _rows(tensors: tuple[torch.Tensor, ...], limit: int):
    """Views of same-shaped `tensors` that cover them, each of at most `limit` elements where
    rows allow it: whole, runs of rows of dim 0, or each row cut the same way."""
    first = tensors[0]
    if first.numel() <= limit or first.dim() == 0:
        yield tensors
        return
    rows = first.shape[0]
    per_row = first.numel() // rows
    if per_row > limit:
        for r in range(rows):
            yield from _rows(tuple(t[r] for t in tensors), limit)
        return
    step = limit // per_row
    for start in range(0, rows, step):
        yield tuple(t.narrow(0, start, min(step, rows - start)) for t in tensors)


class WarmupCosine:
    """Linear warmup from lr/warmup to lr over `warmup_steps`, then cosine to `min_lr` at
    `max_steps` (held after). Call `step()` after each optimizer step, like torch's schedulers."""

    def __init__(self, optimizer: AdamW, lr: float, min_lr: float, warmup_steps: int, max_steps: int):
        if not 0 <= min_lr <= lr:
            raise ValueError(f"min_lr={min_lr} must lie between 0 and lr={lr}")
        if warmup_steps < 0 or max_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 and max_steps={max_steps} >= 1")
        self.optimizer, self.lr, self.min_lr = optimizer, lr, min_lr
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.last_step = 0
        optimizer.lr = self.lr_at(0)

    def lr_at(self, step: int) -> float:
        """Learning rate of the optimizer step with 0-based index `step`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def step(self) -> None:
        self.last_step += 1
        self.optimizer.lr = self.lr_at(self.last_step)

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "lr": self.lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "max_steps": self.max_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the schedule's shape stays as configured now."""
        self.last_step = int(state["last_step"])
        self.optimizer.lr = self.lr_at(self.last_step)


@torch.no_grad()
def clip_grad_norm_(dp: DataParallel, max_norm: float | None, mesh: ParallelMesh, defer: bool = False) -> torch.Tensor:
    """Scale every reduced gradient so the global L2 norm is at most `max_norm`; return the
    norm before clipping (a tensor: no host sync). Each unique gradient element is counted
    once over the whole mesh: TP-replicated params on tp rank 0 only, unsharded grads on rank 0
    of their reduction group only (ZeRO chunks, TP shards, expert shards and pipeline stages are
    disjoint; the last stage's copy of a tied embedding, tagged `pp_tied_duplicate`, is skipped).
    One all-reduce over all ranks. With `defer`, the grads are left as they are and the factor is
    handed to the next `AdamW.step()` (`dp.pending_grad_scale`), which applies it in its own pass."""
    dp.finish_grad_sync()
    tp_rank = mesh.coordinate("tp")
    counted = [
        s.shard_grad for s in dp.slots
        if s.counts_in_norm
        and (placement.tp_shard_dim(s.param) is not None or tp_rank == 0)
        and not getattr(s.param, "pp_tied_duplicate", False)  # the first stage counts the tied weight
    ]
    if counted:
        total = torch.stack(torch._foreach_norm(counted)).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=dp.device)
    if mesh.distributed:
        dist.all_reduce(total)
    total = total.sqrt()
    if max_norm is not None and max_norm > 0:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if defer:
            dp.pending_grad_scale = scale
        else:
            torch._foreach_mul_(dp.local_grads(), scale)
    return total


def build_optimizer(dp: DataParallel, train) -> tuple[AdamW, WarmupCosine]:
    """AdamW and its schedule from a `TrainConfig`."""
    if dp.host is not None and dp.device.type == "cuda":
        # The CPU runs the update: torchrun starts workers with one thread (OMP_NUM_THREADS=1).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        torch.set_num_threads(max(threads, torch.get_num_threads()))
        log.info("optimizer offload: AdamW on the host with %d CPU threads per rank", torch.get_num_threads())
    optimizer = AdamW(dp, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, weight_decay=train.weight_decay)
    return optimizer, WarmupCosine(optimizer, train.lr, train.min_lr, train.warmup_steps, train.max_steps)


def check_offload_memory(config: Config, precision: str, ranks_per_node: int | None = None) -> None:
    """At start, before any model is built: the host memory `train.optimizer_offload` takes on the
    most loaded rank (each stage's dp rank 0 holds the longest ZeRO-1 chunks; the planner's count,
    equal to the trainer's buffers: tests/test_planner_memory.py) against this rank's share of the
    host (core.parallel.offload.check_host_memory). `precision`: what train.precision is on this
    device ('auto' resolved). `DataParallel` checks its own buffers again before allocating them."""
    p = config.parallel
    resolved = dataclasses.replace(config, train=dataclasses.replace(config.train, precision=precision))
    stage = p.tp * p.cp * p.dp
    worst = max((state_bytes(resolved, pp * stage) for pp in range(p.pp)), key=lambda s: s.host)
    check_host_memory(worst.host, worst.chunk_numel, config.train.optimizer_offload_host_gb, ranks_per_node)
