"""Optimizer offload, the host side (`train.optimizer_offload`): what lives in host memory and
how gradients and weights cross the link.

With offload, each `ParamSlot`'s fp32 master (this rank's ZeRO-1 chunk, or the whole param)
is a host tensor, and so are AdamW's two moments (`core.train.optim`; fp32, or bf16 under
`train.optimizer_moments_dtype`): 12 bytes per element (8 with bf16 moments) of
the shard leave the device. What stays there: the params (param dtype) and the fp32 main grads,
which every micro-batch's backward accumulates into (gradient-accumulation fusion adds into
them from the GEMMs), plus the reduce-scatter targets of ZeRO-1 buckets. One pinned host
buffer per bucket, laid out like the bucket's reduced shard (`bucket.region` fp32 elements,
`Bucket._region_view`), carries the traffic both ways:

- out, `grads[i]`: the bucket's reduced gradient. On a GPU the copy is queued on a side stream
  as soon as the bucket's collective is: that stream waits for the collective, the compute
  stream goes on with the backward. On the CPU (gloo) it is copied once the collective finished
  (`DataParallel.finish_grad_sync`). Gradients summed after the reduction (sequence-parallel
  partials, tied pipeline copies) are copied again (`refresh`).
- in, `weights(i)`: once the bucket's update has read its gradients, the same bytes take the
  updated masters cast to the param dtype (`copy_`, the device path's rounding), which the side
  stream copies into the params, or into the ZeRO-1 all-gather's send buffer, while the CPU
  updates the next bucket (`push`); the compute stream waits for them before it reads a weight
  (`wait_pushed`). The next step's gradient copy into that buffer is queued on the same stream,
  after this one.

Without CUDA the buffers are plain host tensors and every copy is synchronous, so the CPU
tests run this path. Host need per element: 12 bytes of the shard (master, moments; 8 with bf16
moments) + 4 of the
buckets' regions (the pinned buffers; ZeRO-1 pads each rank's region to rank 0's chunk),
checked against the host's available memory before any of it is allocated
(`check_host_memory`; the sum is `core.rules.offload_host_bytes`, which the planner reads too).
"""

from __future__ import annotations

import os

import torch

from core.config import ConfigError

GB = 1e9


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


def host_memory_available() -> int | None:
    """The kernel's estimate of memory available without swapping (/proc/meminfo MemAvailable),
    in bytes; None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(need: int, shard_numel: int, limit_gb: float = 0.0, ranks_per_node: int | None = None) -> None:
    """ConfigError unless `need` bytes fit this rank's share of host memory: `limit_gb` where set
    (train.optimizer_offload_host_gb), else MemAvailable over the ranks per node (LOCAL_WORLD_SIZE)."""
    ranks = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if limit_gb:
        available, source = int(limit_gb * GB), f"train.optimizer_offload_host_gb={limit_gb:g}"
    else:
        total = host_memory_available()
        if total is None:
            return  # no figure to check against (not Linux): the allocation itself will tell
        available, source = total // ranks, f"MemAvailable {_size(total)} over {ranks} rank(s) per node"
    if need <= available:
        return
    per_element = need / max(shard_numel, 1)
    fits = int(available / per_element) if per_element else 0
    raise ConfigError(
        f"train.optimizer_offload needs {_size(need)} of host memory on each rank ({shard_numel / 1e6:.2f}M "
        f"optimizer elements, {per_element:.0f} bytes each: fp32 master, two moments, the pinned transfer buffer), "
        f"but {_size(available)} is available ({source}): that fits {fits / 1e6:.2f}M elements; shard the "
        f"optimizer over more data-parallel ranks (parallel.distributed_optimizer=true), free host memory, or set "
        f"train.optimizer_offload=false")


class HostOffload:
    """The pinned gradient and weight buffers of a `DataParallel`'s buckets, and the side stream
    their copies run on (None without CUDA: synchronous copies)."""

    def __init__(self, buckets: list, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        pin = self.stream is not None
        self.grads = [torch.empty(b.region, dtype=torch.float32, pin_memory=pin) for b in buckets]
        self._dtypes = [b.param_dtype for b in buckets]
        self._queued = [False] * len(buckets)  # this step's gradient copy of bucket i is queued
        self._sent: list[torch.cuda.Event | None] = [None] * len(buckets)  # the last copy out of weights(i)

    @property
    def streams(self) -> bool:
        """Whether copies run on a side stream (a GPU): then they may be queued during the backward."""
        return self.stream is not None

    def weights(self, i: int) -> torch.Tensor:
        """Bucket i's buffer as `region` elements of the param dtype (its first bytes: params are
        at most 4 bytes wide), the new weights' way in once the update has read the gradients."""
        return self.grads[i].view(self._dtypes[i])[:self.grads[i].numel()]

    def host_grad(self, slot) -> torch.Tensor:
        """The host copy of `slot.shard_grad` (same shape, same place in the bucket's region)."""
        bucket = slot.bucket
        return bucket._region_view(self.grads[bucket.index], slot, bucket.rank, 0)

    def copy_grads(self, bucket) -> None:
        """Queue the copy of the bucket's reduced shard to the host, once per step. On a GPU the
        side stream waits for the bucket's collective (`work.wait()` on that stream)."""
        i = bucket.index
        if self._queued[i]:
            return
        self._queued[i] = True
        if self.stream is None:
            self.grads[i].copy_(bucket.shard_buffer)
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # the bucket's grads are written
        with torch.cuda.stream(self.stream):
            if bucket.work is not None:
                bucket.work.wait()
            self.grads[i].copy_(bucket.shard_buffer, non_blocking=True)

    def refresh(self, slots: list) -> None:
        """Copy these slots' reduced grads again (changed after their bucket's copy was queued)."""
        if not slots:
            return
        pairs = [(self.host_grad(s), s.shard_grad) for s in slots]
        if self.stream is None:
            torch._foreach_copy_([h for h, _ in pairs], [d for _, d in pairs])
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for host, grad in pairs:
                host.copy_(grad, non_blocking=True)

    def wait_grads(self) -> None:
        """Block the host until every queued gradient copy has landed."""
        if self.stream is not None:
            self.stream.synchronize()

    def new_step(self) -> None:
        self._queued = [False] * len(self._queued)

    def push(self, bucket) -> None:
        """The bucket's updated masters, cast to the param dtype, into the params (unsharded) or the
        all-gather's send buffer (ZeRO-1); queued on the side stream on a GPU. Overwrites the
        bucket's host gradients: call it after the update."""
        i = bucket.index
        if self._sent[i] is not None:
            self._sent[i].synchronize()  # the last copy out of weights(i) has read it
        own = [s for s in bucket.slots if s.bounds[bucket.rank][1]]
        weights = self.weights(i)
        staged = [bucket._region_view(weights, s, bucket.rank, 0) for s in own]
        if own:
            torch._foreach_copy_(staged, [s.master for s in own])  # fp32 -> param dtype, as on the device
        if bucket.sharded:
            if bucket.send is None:
                bucket.send = torch.empty(bucket.region, dtype=bucket.param_dtype, device=bucket.grad_buffer.device)
            pairs = [(bucket.send, weights)]
        else:
            pairs = [(s.param.data, view) for s, view in zip(own, staged)]
        if self.stream is None:
            for target, source in pairs:
                target.copy_(source)
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # queued work that reads the old weights
        with torch.cuda.stream(self.stream):
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
            self._sent[i] = torch.cuda.Event()
            self._sent[i].record()

    def wait_pushed(self) -> None:
        """The compute stream waits for every weight copy (before the all-gather and the forward)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
