"""Autograd-aware all-to-all with uneven splits (the one collective core.parallel.comm lacks).

Forward sends rows [sum(in_splits[:j]), +in_splits[j]) of x to rank j of the group and
receives out_splits[i] rows from rank i; backward is the same exchange with the split lists
swapped. Split sizes are Python ints: NCCL and gloo need them on the host.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class ExchangeTimer:
    """Time spent in the token all-to-alls (dispatch and combine, forward and backward): the
    share of a step that expert parallelism spends on the network, waiting for peers included.
    On GPU, CUDA events around each collective on its stream (no host sync when recording; read
    at `pop_seconds`, after the step); on CPU (gloo, blocking) the host clock. Off unless the
    training loop turns it on, so nothing piles up for code that never pops."""

    def __init__(self):
        self.enabled = False
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_seconds = 0.0

    def run(self, x: torch.Tensor, exchange):
        if not self.enabled:
            return exchange()
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

    def pop_seconds(self) -> float:
        """Seconds since the last call (waits for the recorded collectives to finish)."""
        total = self._host_seconds
        for start, end in self._events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        self._events.clear()
        self._host_seconds = 0.0
        return total


EXCHANGE_TIMER = ExchangeTimer()


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    EXCHANGE_TIMER.run(x, lambda: dist.all_to_all_single(out, x, output_split_sizes=out_splits,
                                                         input_split_sizes=in_splits, group=group))
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Uneven all-to-all of rows of x (see module doc); identity without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    if len(out_splits) != dist.get_world_size(group) or len(in_splits) != len(out_splits):
        raise ValueError(f"all_to_all: {len(in_splits)}/{len(out_splits)} splits for a group of {dist.get_world_size(group)}")
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [ep, n] (row j: what this rank sends to rank j) -> [ep, n] (row i: what rank i
    sends to this rank). Plain tensor exchange, no autograd."""
    if group is None or dist.get_world_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


# ---- expert-major exchange: point-to-point segments instead of one all-to-all -------------


class SegmentPlan:
    """Where each (peer, local expert) segment of rows goes, for `exchange_segments`.

    sends/recvs: (peer's rank in the group, first row, rows, local expert), in local-expert
    order per peer (both ends post in that order, and tag by the expert: NCCL matches by order,
    gloo by tag); copies: (source row, destination
    row, rows) of the segments this rank keeps; out_rows: rows of the result."""

    def __init__(self, sends, recvs, copies, out_rows: int, in_rows: int):
        self.sends, self.recvs, self.copies = sends, recvs, copies
        self.out_rows, self.in_rows = out_rows, in_rows

    def reversed(self) -> "SegmentPlan":
        return SegmentPlan(self.recvs, self.sends, [(d, s, n) for s, d, n in self.copies], self.in_rows, self.out_rows)

    @staticmethod
    def by_expert(send: list[list[int]], recv: list[list[int]], rank: int) -> "SegmentPlan":
        """The dispatch plan. send[p][e]: rows this rank sends for expert e of rank p (laid out
        p-major, e-minor, as sorting by global expert id leaves them); recv[s][e]: rows rank s
        sends for this rank's expert e. The result is grouped by local expert, then source rank:
        the grouped GEMM's layout, with no regrouping gather after the exchange."""
        ep, local = len(send), len(send[0])
        send_at, row = [], 0
        for p in range(ep):
            send_at.append([])
            for e in range(local):
                send_at[p].append(row)
                row += send[p][e]
        in_rows = row
        recv_at = [[0] * local for _ in range(ep)]
        row = 0
        for e in range(local):
            for s in range(ep):
                recv_at[s][e] = row
                row += recv[s][e]
        sends, recvs, copies = [], [], []
        for p in range(ep):
            for e in range(local):
                if p == rank:
                    if send[p][e]:
                        copies.append((send_at[p][e], recv_at[p][e], send[p][e]))
                    continue
                if send[p][e]:
                    sends.append((p, send_at[p][e], send[p][e], e))
                if recv[p][e]:
                    recvs.append((p, recv_at[p][e], recv[p][e], e))
        return SegmentPlan(sends, recvs, copies, row, in_rows)


def _run_segments(x: torch.Tensor, plan: SegmentPlan, group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((plan.out_rows, *x.shape[1:]))

    def exchange():
        ops = [dist.P2POp(dist.isend, x[a:a + n], dist.get_global_rank(group, p), group, tag)
               for p, a, n, tag in plan.sends]
        ops += [dist.P2POp(dist.irecv, out[a:a + n], dist.get_global_rank(group, p), group, tag)
                for p, a, n, tag in plan.recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        for s, d, n in plan.copies:  # runs while the transfers are in flight
            out[d:d + n].copy_(x[s:s + n])
        for w in works:
            w.wait()
        return out

    return EXCHANGE_TIMER.run(x, exchange)


class _SegmentExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group):
        ctx.plan, ctx.group = plan, group
        return _run_segments(x, plan, group)

    @staticmethod
    def backward(ctx, grad):
        return _run_segments(grad, ctx.plan.reversed(), ctx.group), None, None


def exchange_segments(x: torch.Tensor, plan: SegmentPlan, group) -> torch.Tensor:
    """Rows of x moved as `plan` says (autograd: the backward runs the reversed plan)."""
    if x.shape[0] != plan.in_rows:
        raise ValueError(f"exchange_segments: {x.shape[0]} rows, the plan expects {plan.in_rows}")
    return _SegmentExchange.apply(x, plan, group)
