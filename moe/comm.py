"""Autograd-aware all-to-all with uneven splits (the one collective core.parallel.comm lacks).

Forward sends rows [sum(in_splits[:j]), +in_splits[j]) of x to rank j of the group and
receives out_splits[i] rows from rank i; backward is the same exchange with the split lists
swapped. Split sizes are Python ints: NCCL and gloo need them on the host. A run that times
its exchanges (`ExchangeTimer`) hands its timer to the dispatchers, which pass it here.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class ExchangeTimer:
    """Time spent in the token all-to-alls (dispatch and combine, forward and backward): the
    share of a step that expert parallelism spends on the network, waiting for peers included.
    On GPU, CUDA events around each collective on its stream (no host sync when recording; read
    at `pop_seconds`, after the step); on CPU (gloo, blocking) the host clock. One per run that
    reads the times (the trainer, under expert parallelism), so nothing piles up for code that
    never pops."""

    def __init__(self):
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_seconds = 0.0

    def run(self, x: torch.Tensor, exchange):
        """exchange(), timed."""
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = exchange()
            end.record()
            self._events.append((start, end))
            return out
        began = time.perf_counter()
        out = exchange()
        self._host_seconds += time.perf_counter() - began
        return out

    def take(self) -> tuple[float, list]:
        """What was recorded since the last call, to be read later by `seconds` (no sync)."""
        taken = (self._host_seconds, self._events)
        self._events, self._host_seconds = [], 0.0
        return taken

    @staticmethod
    def seconds(taken: tuple[float, list]) -> float:
        """The seconds of a `take` (waits for its collectives to finish)."""
        total, events = taken
        for start, end in events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total

    def pop_seconds(self) -> float:
        """Seconds since the last call (waits for the recorded collectives to finish)."""
        return self.seconds(self.take())


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
              timer: ExchangeTimer | None) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))

    def exchange():
        return dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)

    if timer is not None:
        timer.run(x, exchange)
    else:
        exchange()
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, timer):
        ctx.splits, ctx.group, ctx.timer = (out_splits, in_splits), group, timer
        return _exchange(x, out_splits, in_splits, group, timer)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.timer), None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
               timer: ExchangeTimer | None = None) -> torch.Tensor:
    """Uneven all-to-all of rows of x (see module doc), forward and backward timed by `timer`
    when given; identity without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    if len(out_splits) != dist.get_world_size(group) or len(in_splits) != len(out_splits):
        raise ValueError(f"all_to_all: {len(in_splits)}/{len(out_splits)} splits for a group of {dist.get_world_size(group)}")
    return _AllToAll.apply(x, out_splits, in_splits, group, timer)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [ep, n] (row j: what this rank sends to rank j) -> [ep, n] (row i: what rank i
    sends to this rank). Plain tensor exchange, no autograd."""
    if group is None or dist.get_world_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
