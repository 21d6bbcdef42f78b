"""Data parallelism: bucketed gradient reduction overlapped with backward, fp32 main grads, ZeRO-1 layout.

`apply_data_parallel(model, mesh, ...)` returns a `DataParallel` handle; the model stays a plain
module. Each parameter's AccumulateGrad node gets a pre-hook that adds the incoming gradient into an
fp32 `main_grad` (a view into its bucket's flat buffer) and hands AccumulateGrad nothing, so
`param.grad` stays None. When the last
gradient of a bucket arrives on a synchronising micro-batch, the bucket's collective is launched
asynchronously, so communication overlaps the rest of backward; `finish_grad_sync()` waits for
all of them before clipping and the optimizer step. Buckets launch strictly in order on every
rank, so collectives on overlapping groups can never be issued in different orders.

Reduction groups: dense params over "dp_cp" (data x context ranks), expert params
(`param.expert_parallel`) over "edp". Gradients are SUMMED by default (`grad_reduce="sum"`): the
training loss is already divided by the global token count; "mean" divides by the group size.

Distributed optimizer (ZeRO-1, `shard_optimizer=True`): each parameter is chunked like
`torch.chunk` along a dim that tensor (or expert) parallelism does not already split
(`zero_shard_dim`), so every optimizer state is a valid DTensor shard of a (dp, tp) mesh. A
bucket's gradients are packed rank-major (rank j's chunks of all the bucket's params contiguous,
padded to rank 0's length) and reduce-scattered in one collective; after the step,
`gather_params()` all-gathers the updated chunks the same way.

Other sums: params tagged `sequence_parallel_partial` get their reduced grads summed over TP
(here, on main grads: `core.parallel.tensor.sync_sequence_parallel_grads` reads `.grad`, which
this step frees), and copies of a weight tied across pipeline stages tagged `pp_tied_group`
(the first/last-stage process group) over that group.

Precision: params may be cast to `param_dtype` (bf16 on GPU); fp32 master weights are kept per
local chunk (`slot.master`). With fp32 params the master IS the param's own chunk (a view), so
nothing is duplicated. With `split_masters` (bf16) the master is the bf16 weight itself (its
upper 16 bits, rounded half away from zero) plus an int16 low half (`slot.master_low`): exact,
2 bytes per parameter where a separate fp32 copy takes 4; `slot.master` joins a copy,
`slot.write_master` splits one back.

Optimizer offload (`offload=True`, core.parallel.offload): the fp32 masters are host tensors,
each bucket's reduced shard is copied to a pinned host buffer as it is ready (on a GPU during
the backward, on a side stream), and `gather_params` copies the host's new weights back in.
The main grads stay on the device: every micro-batch's backward accumulates into them.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from core import placement
from core.kernels.adamw import join_master, split_master
from core.kernels.fused import accumulate_fp32_
from core.mesh import ParallelMesh
from core.parallel.offload import HostOffload, check_host_memory
from core.rules import offload_host_bytes

GRAD_REDUCE_OPS = ("sum", "mean")
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.optimizer_moments_dtype
# torch 2.13 renamed the flat-tensor collectives; older releases only have the *_tensor names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of each of `parts` chunks of `size`, as torch.chunk / DTensor Shard cut
    them: ceil-sized chunks, a shorter last one, then empty ones."""
    step = -(-size // parts) if size else 0
    out = []
    for j in range(parts):
        start = min(j * step, size)
        out.append((start, min(size, start + step) - start))
    return out


def zero_shard_dim(param: torch.Tensor) -> int | None:
    """The dim ZeRO-1 chunks a parameter along: the first one that tensor parallelism
    (`tp_shard_dim`) and expert parallelism (`ep_shard_dim`, default 0) leave whole."""
    taken = {placement.tp_shard_dim(param)}
    if placement.is_expert(param):
        taken.add(placement.ep_shard_dim(param))
    for dim in range(param.dim()):
        if dim not in taken:
            return dim
    return None


class ParamSlot:
    """One parameter's place in the layout: its grads, its chunk, its fp32 master."""

    def __init__(self, name: str, param: nn.Parameter, group_name: str, group_size: int, group_rank: int, sharded: bool):
        self.name, self.param, self.group_name = name, param, group_name
        self.group_size, self.group_rank = group_size, group_rank
        self.shard_dim = zero_shard_dim(param) if sharded else None
        if sharded and self.shard_dim is None:
            raise ValueError(
                f"parameter '{name}' of shape {tuple(param.shape)} has no dim left for the distributed optimizer "
                f"(tp_shard_dim={placement.tp_shard_dim(param)}); use parallel.distributed_optimizer=false"
            )
        size = param.shape[self.shard_dim] if sharded else 0
        # Without sharding the "chunk" of every rank is the whole parameter.
        self.bounds = chunk_bounds(size, group_size) if sharded else [(0, -1)] * group_size
        self.sharded = sharded
        self.ready = False
        self.written = False  # main_grad holds this step's gradient (else stale: zeroed before use)
        self.fused_pending = False  # a backward wrote its gradient into main_grad itself (see MainGradSink)
        self.bucket: Bucket | None = None
        self.offset = 0  # into bucket.grad_buffer
        self.region_offsets: list[int] = []  # into each rank's region of the packed layout
        self.main_grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None  # the grad the optimizer reads (reduced)
        self._master: torch.Tensor | None = None  # fp32 weights of this rank's chunk
        self.master_low: torch.Tensor | None = None  # split masters: the fp32 master's low 16 bits
        self.master_is_param = False

    @property
    def master(self) -> torch.Tensor:
        """This rank's fp32 master chunk: the tensor itself, or with split masters a new tensor
        joined from the bf16 weight and the low half (read-only: write with `write_master`)."""
        if self.master_low is None:
            return self._master
        return join_master(self.chunk(self.param.data, self.group_rank), self.master_low)

    @master.setter
    def master(self, value: torch.Tensor | None) -> None:
        self._master = value

    def master_high(self) -> torch.Tensor:
        """With split masters: this rank's chunk of the bf16 weight, the master's upper half."""
        return self.chunk(self.param.data, self.group_rank)

    def write_master(self, value: torch.Tensor) -> None:
        """Set this rank's master chunk to fp32 `value` (split: its bf16 weight chunk too)."""
        if self.master_low is None:
            self._master.copy_(value)
            return
        high, low = split_master(value)
        self.master_high().copy_(high)
        self.master_low.copy_(low)

    def chunk(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s chunk of a param-shaped tensor (a view)."""
        if not self.sharded:
            return tensor
        start, length = self.bounds[rank]
        return tensor.narrow(self.shard_dim, start, length)

    def chunk_shape(self, rank: int) -> torch.Size:
        if not self.sharded:
            return self.param.shape
        shape = list(self.param.shape)
        shape[self.shard_dim] = self.bounds[rank][1]
        return torch.Size(shape)

    @property
    def counts_in_norm(self) -> bool:
        """Whether this rank's `shard_grad` holds gradient elements no other rank counts:
        TP-replicated params count on tp rank 0 only (decided by the caller), replicated
        (unsharded) grads on group rank 0 only."""
        return self.sharded or self.group_rank == 0


class Bucket:
    """Consecutive params of one reduction group and dtype, reduced by one collective."""

    def __init__(self, slots: list[ParamSlot], group: dist.ProcessGroup | None, device: torch.device):
        self.slots, self.group = slots, group
        first = slots[0]
        self.size, self.rank, self.sharded = first.group_size, first.group_rank, first.sharded and first.group_size > 1
        self.param_dtype = first.param.dtype
        offset = 0
        for slot in slots:
            slot.offset, slot.bucket = offset, self
            offset += slot.param.numel()
        self.grad_buffer = torch.zeros(offset, dtype=torch.float32, device=device)
        for slot in slots:
            # `.data`: a version counter of its own, not the bucket's. A compiled block saves the
            # main grads its linears add into (core.parallel.wgrad) for its backward, and autograd
            # would refuse them once another parameter's accumulation bumped a shared counter.
            slot.main_grad = self.grad_buffer[slot.offset:slot.offset + slot.param.numel()].view(slot.param.shape).data
        if self.sharded:
            region_lengths = [0] * self.size
            for slot in slots:
                slot.region_offsets = list(region_lengths)
                for j in range(self.size):
                    region_lengths[j] += math.prod(slot.chunk_shape(j))
            self.region = region_lengths[0]  # torch.chunk puts the largest chunks first
            self.shard_buffer = torch.zeros(self.region, dtype=torch.float32, device=device)
            for slot in slots:
                slot.shard_grad = self._region_view(self.shard_buffer, slot, self.rank, 0)
        else:
            self.region = offset
            self.shard_buffer = self.grad_buffer
            for slot in slots:
                slot.region_offsets = [slot.offset] * self.size
                slot.shard_grad = slot.main_grad
        self.pending = len(slots)
        self.index = 0  # place in DataParallel.buckets
        self.work = None
        self.packed: torch.Tensor | None = None  # kept alive until the collective finished
        self.send: torch.Tensor | None = None  # the weights' all-gather input, where an optimizer writes it
        self.fallback = False

    def _region_view(self, flat: torch.Tensor, slot: ParamSlot, rank: int, base: int) -> torch.Tensor:
        shape = slot.chunk_shape(rank)
        start = base + slot.region_offsets[rank]
        return flat[start:start + math.prod(shape)].view(shape)

    def pack_grads(self, packed: torch.Tensor) -> None:
        """Copy rank j's chunk of every main_grad into region j of `packed` (rank-major)."""
        dst, src = [], []
        for j in range(self.size):
            for slot in self.slots:
                if slot.bounds[j][1]:
                    dst.append(self._region_view(packed, slot, j, j * self.region))
                    src.append(slot.chunk(slot.main_grad, j))
        if dst:
            torch._foreach_copy_(dst, src)

    def pack_masters(self, send: torch.Tensor) -> None:
        """This rank's master chunks, cast to the param dtype, into one send buffer."""
        pairs = [(self._region_view(send, s, self.rank, 0), s.master_high() if s.master_low is not None else s.master)
                 for s in self.slots if s.bounds[self.rank][1]]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [m for _, m in pairs])

    def unpack_params(self, flat: torch.Tensor, skip_rank: int | None) -> None:
        """The inverse for parameters: every rank region of `flat` into the params' chunks."""
        dst, src = [], []
        for j in range(self.size):
            if j == skip_rank:
                continue
            for slot in self.slots:
                if slot.bounds[j][1]:
                    dst.append(slot.chunk(slot.param.data, j))
                    src.append(self._region_view(flat, slot, j, j * self.region))
        if dst:
            torch._foreach_copy_(dst, src)


class MainGradSink:
    """`param.main_grad_sink`: lets a backward write the param's gradient into its fp32 main grad
    itself (gradient-accumulation fusion, e.g. a GEMM epilogue that adds to it) instead of
    returning it. `write(fill)` calls fill(main_grad, accumulate) with accumulate False on the
    step's first gradient (fill must overwrite) and True after (fill must add); the backward then
    returns `stand_in()` as the param's gradient, so the hook still does the bucket bookkeeping."""

    def __init__(self, slot: ParamSlot):
        self.slot = slot

    def write(self, fill) -> None:
        slot = self.slot
        fill(slot.main_grad, slot.written)
        slot.written = True
        slot.fused_pending = True

    def stand_in(self) -> torch.Tensor:
        """A gradient-shaped zero that owns one element (expanded: all strides 0)."""
        param = self.slot.param
        return param.new_zeros(()).expand(param.shape)


class DataParallel:
    """Handle returned by `apply_data_parallel`; owns hooks, buckets and fp32 master chunks."""

    def __init__(
        self,
        model: nn.Module,
        mesh: ParallelMesh,
        *,
        bucket_mb: float = 25.0,
        shard_optimizer: bool = True,
        param_dtype: torch.dtype = torch.float32,
        grad_reduce: str = "sum",
        gradient_accumulation_fusion: bool = True,
        split_masters: bool = False,
        offload: bool = False,
        host_limit_gb: float = 0.0,
        moments_dtype: torch.dtype = torch.float32,
    ):
        if split_masters and offload:
            raise ValueError("offload keeps whole fp32 masters in host memory: split_masters has nothing to split")
        if split_masters and param_dtype != torch.bfloat16:
            raise ValueError(f"split_masters keeps the fp32 master as the bf16 weight plus its low half: it needs "
                             f"param_dtype=torch.bfloat16, got {param_dtype}")
        self.split_masters, self.offload, self.host_limit_gb = split_masters, offload, host_limit_gb
        if moments_dtype not in MOMENT_DTYPES.values():
            raise ValueError(f"moments_dtype={moments_dtype} must be torch.float32 or torch.bfloat16")
        self.moments_dtype = moments_dtype  # AdamW's (core.train.optim), counted by the host check here
        if grad_reduce not in GRAD_REDUCE_OPS:
            raise ValueError(f"grad_reduce={grad_reduce!r} must be one of {', '.join(GRAD_REDUCE_OPS)}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be a positive number of megabytes (e.g. 25)")
        if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype={param_dtype} must be torch.float32, torch.bfloat16 or torch.float16")
        self.model, self.mesh = model, mesh
        self.shard_optimizer, self.param_dtype, self.grad_reduce = shard_optimizer, param_dtype, grad_reduce
        self.sync_grads = True  # False: accumulate only (earlier micro-batches); see no_sync()
        self.use_reduce_scatter = True  # False: all_reduce + slice (gloo builds without reduce_scatter)
        # fused_grads: gradients a backward wrote into main_grad itself (gradient_accumulation_fusion)
        self.stats = {"launched_in_backward": 0, "launched_at_finish": 0, "fused_grads": 0}
        self._finished = False
        self._next = 0
        self.pending_grad_scale: torch.Tensor | None = None  # a clip factor the optimizer applies
        # Called after gather_params() wrote new weights (through .data, unseen by version
        # counters): e.g. core.precision.weight_cache drops the quantised weights it keeps for the step.
        self.on_new_weights: list[Callable[[], None]] = []
        self.slots = self._make_slots(model)
        if not self.slots:
            raise ValueError("the model has no parameters that require gradients")
        self.device = self.slots[0].param.device
        self.buckets = self._make_buckets(int(bucket_mb * 2**20))
        for i, bucket in enumerate(self.buckets):
            bucket.index = i
        self.host = HostOffload(self.buckets, self.device) if offload else None
        # The hook sits before each param's AccumulateGrad node and consumes the gradient, so
        # `param.grad` is never allocated or stored.
        self._grad_nodes = [torch.autograd.graph.get_gradient_edge(slot.param).node for slot in self.slots]
        self._hooks = [node.register_prehook(self._hook(slot)) for node, slot in zip(self._grad_nodes, self.slots)]
        # Ops that can compute a weight gradient straight into fp32 (the experts' grouped GEMM)
        # find the sink on the param; the rest keep handing bf16 gradients to the hook.
        for slot in self.slots:
            slot.param.main_grad_sink = MainGradSink(slot) if gradient_accumulation_fusion else None
        # Ops that add weight gradients into `param.main_grad` themselves and flag it in
        # `param.grad_added_to_main_grad` (Megatron's protocol; Transformer Engine's
        # fuse_wgrad_accumulation): their main grads are exposed, and zeroed at each step's start.
        self._accumulating = [slot for slot in self.slots if getattr(slot.param, "accumulates_main_grad", False)]
        if self._accumulating and not gradient_accumulation_fusion:
            raise ValueError(f"parameter '{self._accumulating[0].name}' adds its gradient into main_grad itself "
                             "(gradient-accumulation fusion): build DataParallel with gradient_accumulation_fusion=True")
        for slot in self._accumulating:
            slot.param.main_grad, slot.param.grad_added_to_main_grad = slot.main_grad, False
            slot.written = True  # the buffers start at zero

    # ------------------------------------------------------------------ layout
    def _make_slots(self, model: nn.Module) -> list[ParamSlot]:
        slots = []
        for name, param in model.named_parameters():  # deduplicated: tied weights once
            if not param.requires_grad:
                continue
            group_name = "edp" if placement.is_expert(param) else "dp_cp"
            group = self.mesh.group(group_name)
            size = dist.get_world_size(group) if group is not None else 1
            rank = dist.get_rank(group) if group is not None else 0
            slots.append(ParamSlot(name, param, group_name, size, rank, self.shard_optimizer and size > 1))
        if self.offload:  # before anything is allocated on the host
            shard = sum(math.prod(s.chunk_shape(s.group_rank)) for s in slots)
            region = sum(math.prod(s.chunk_shape(0)) for s in slots)  # buckets pad to rank 0's chunk
            moments = next(k for k, v in MOMENT_DTYPES.items() if v == self.moments_dtype)
            check_host_memory(offload_host_bytes(shard, region, moments), shard, self.host_limit_gb)
        with torch.no_grad():
            for slot in slots:
                self._make_master(slot)
        return slots

    def _make_master(self, slot: ParamSlot) -> None:
        # fp32 masters come from the fp32 init values, before params are cast down.
        param, rank = slot.param, slot.group_rank
        if self.offload:
            chunk = slot.chunk(param.data, rank)
            slot.master = torch.empty(chunk.shape, dtype=torch.float32, device="cpu").copy_(chunk)
            param.data = param.data.to(self.param_dtype)
        elif self.param_dtype == torch.float32 and param.dtype == torch.float32:
            slot.master, slot.master_is_param = slot.chunk(param.data, rank), True
        elif self.split_masters:  # the bf16 weight is the master's rounded upper half
            high, low = split_master(param.data)
            slot.master_low = slot.chunk(low, rank).clone()
            param.data = high
        else:
            slot.master = slot.chunk(param.data, rank).float().clone()
            param.data = param.data.to(self.param_dtype)

    def _make_buckets(self, cap_bytes: int) -> list[Bucket]:
        # Backward produces grads roughly in reverse registration order: bucket in that order.
        buckets, open_ = [], {}  # (group, dtype) -> [slots, fp32 bytes]
        for unit in self._bucket_units():
            key = (unit[0].group_name, unit[0].param.dtype)
            entry = open_.setdefault(key, [[], 0])
            entry[0].extend(unit)
            entry[1] += sum(slot.param.numel() for slot in unit) * 4
            if entry[1] >= cap_bytes:
                buckets.append(Bucket(entry[0], self.mesh.group(key[0]), self.device))
                open_[key] = [[], 0]
        for key, (members, _) in open_.items():
            if members:
                buckets.append(Bucket(members, self.mesh.group(key[0]), self.device))
        return buckets

    def _bucket_units(self) -> list[list[ParamSlot]]:
        """The slots in reverse registration order, each a unit of its own, except parameters
        that one op uses as a single joined weight (`param.joined_params`, core.precision.te_fused):
        those form one unit in their own order, so their main grads lie back to back and the
        op can add its joined weight gradient into them through one view."""
        by_param = {id(slot.param): slot for slot in self.slots}
        units, placed = [], set()
        for slot in reversed(self.slots):
            if id(slot.param) in placed:
                continue
            group = getattr(slot.param, "joined_params", None) or (slot.param,)
            unit = [by_param.get(id(p)) for p in group]
            if any(u is None or (u.group_name, u.param.dtype) != (slot.group_name, slot.param.dtype) for u in unit):
                unit = [slot]
            placed.update(id(u.param) for u in unit)
            units.append(unit)
        return units

    # ------------------------------------------------------------------ backward
    def _hook(self, slot: ParamSlot):
        def on_grad(grads: tuple[torch.Tensor | None, ...]) -> tuple[None]:
            if grads[0] is None:
                return (None,)
            if getattr(slot.param, "main_grad_added_in_graph", False):  # a compiled backward added it
                self.stats["fused_grads"] += 1  # (core.parallel.wgrad); grads[0] is a stand-in
            elif getattr(slot.param, "grad_added_to_main_grad", False):  # grads[0] is a placeholder
                slot.param.grad_added_to_main_grad = False
                self.stats["fused_grads"] += 1
            elif slot.fused_pending:  # the backward already wrote main_grad (grads[0] is a stand-in)
                slot.fused_pending = False
                self.stats["fused_grads"] += 1
                if any(grads[0].stride()):  # stand-ins have all-zero strides: the param was also used
                    self._accumulate(slot, grads[0])  # elsewhere, and autograd summed that gradient in
            else:
                self._accumulate(slot, grads[0])
            return self._mark_ready(slot)

        return on_grad

    @staticmethod
    def _accumulate(slot: ParamSlot, grad: torch.Tensor) -> None:
        # fp32 accumulation whatever the param dtype. The step's first grad is copied, not
        # added: zero_grad() then needs no pass over the buffers, and the copy moves 6 bytes
        # per element where zero + add move 14 (memory-bound: ~3 ms per step on a 1B model).
        # On CUDA one vectorised Triton pass (PyTorch's mixed-dtype add_ is not vectorised).
        accumulate_fp32_(slot.main_grad, grad, copy=not slot.written)
        slot.written = True

    def _mark_ready(self, slot: ParamSlot) -> tuple[None]:
        if not self.sync_grads:
            return (None,)
        if slot.ready or self._finished:
            raise RuntimeError(
                f"gradient of '{slot.name}' arrived twice in synchronised backward passes: run earlier "
                "micro-batches under DataParallel.no_sync() and call zero_grad() after each optimizer step"
            )
        slot.ready = True
        slot.bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1
            self.stats["launched_in_backward"] += 1
        return (None,)  # nothing left for AccumulateGrad to store

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside accumulate into main_grad without any communication."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    def _launch(self, bucket: Bucket) -> None:
        self._start_collective(bucket)
        if self.host is not None and self.host.streams:  # on a GPU: queued behind the collective now
            self.host.copy_grads(bucket)

    def _start_collective(self, bucket: Bucket) -> None:
        for slot in bucket.slots:
            if not slot.written:  # no grad this step (an unused param): it reduces as zeros
                slot.main_grad.zero_()
                slot.written = True
        if self.grad_reduce == "mean" and bucket.size > 1:
            bucket.grad_buffer.div_(bucket.size)
        if bucket.size == 1:
            return
        if not bucket.sharded:
            bucket.work = dist.all_reduce(bucket.grad_buffer, group=bucket.group, async_op=True)
            return
        packed = torch.empty(bucket.size * bucket.region, dtype=torch.float32, device=self.device)
        bucket.pack_grads(packed)
        bucket.packed = packed
        if self.use_reduce_scatter:
            try:
                bucket.work = _reduce_scatter(bucket.shard_buffer, packed, group=bucket.group, async_op=True)
                return
            except (RuntimeError, NotImplementedError):
                if dist.get_backend(bucket.group) != "gloo":
                    raise
                self.use_reduce_scatter = False  # this gloo build lacks it: same on every rank
        bucket.fallback = True
        bucket.work = dist.all_reduce(packed, group=bucket.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch buckets whose params got no grad this step, wait for every collective, sum
        sequence-parallel partial grads over TP. Idempotent until the next zero_grad()."""
        if self._finished:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
            self.stats["launched_at_finish"] += 1
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # on NCCL: the compute stream waits, the host does not
                bucket.work = None
            if bucket.fallback:
                start = bucket.rank * bucket.region
                bucket.shard_buffer.copy_(bucket.packed[start:start + bucket.region])
                bucket.fallback = False
            bucket.packed = None
            if self.host is not None:
                self.host.copy_grads(bucket)
        summed = self._sum_sequence_parallel_grads() + self._sum_tied_copies()
        if self.host is not None:
            self.host.refresh(summed)
        self._finished = True

    def _sum_sequence_parallel_grads(self) -> list[ParamSlot]:
        # LayerNorm-like weights under sequence parallelism see only this TP rank's tokens; their
        # (already DP-reduced) grads are partial sums over TP. Chunks match across TP ranks.
        partial = [s for s in self.slots if placement.is_sequence_parallel_partial(s.param)]
        grads = [s.shard_grad for s in partial]
        if not grads or self.mesh.tp == 1 or not self.mesh.distributed:
            return []
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.mesh.group("tp"))
        torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])
        return partial

    def _sum_tied_copies(self) -> list[ParamSlot]:
        # A weight tied across pipeline stages (embedding on the first, output head on the last)
        # lives as one copy per stage, tagged `pp_tied_group`: each copy's grad becomes the sum.
        # Both copies have the same shape and dp group, so their ZeRO chunks line up.
        by_group: dict = {}
        for slot in self.slots:
            group = getattr(slot.param, "pp_tied_group", None)
            if group is not None:
                by_group.setdefault(group, []).append(slot)
        for group, tied in by_group.items():
            grads = [s.shard_grad for s in tied]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])
        return [s for tied in by_group.values() for s in tied]

    def zero_grad(self) -> None:
        """Clear main grads and per-step bookkeeping; call after each optimizer step."""
        if not self._finished and self._next:
            raise RuntimeError("zero_grad() called while gradient collectives are in flight: call finish_grad_sync() first")
        for bucket in self.buckets:
            bucket.pending = len(bucket.slots)
        for slot in self.slots:
            slot.ready = slot.written = slot.fused_pending = False
            slot.param.grad = None
        if self._accumulating:
            torch._foreach_zero_([slot.main_grad for slot in self._accumulating])
            for slot in self._accumulating:
                slot.written = True
        self.pending_grad_scale = None
        self._next, self._finished = 0, False
        if self.host is not None:
            self.host.new_step()

    # ------------------------------------------------------------------ after the step
    def weight_targets(self) -> list[torch.Tensor | None]:
        """Per slot, where an optimizer may write its updated weights in the param dtype as it
        updates the master (one pass instead of two): the param itself in an unsharded bucket,
        this rank's region of the all-gather's send buffer in a sharded one; None where there
        is nothing to write (the master is the param, or this rank's chunk is empty). After
        writing all of them, call `gather_params(targets_written=True)`."""
        targets: dict[int, torch.Tensor] = {}
        for bucket in self.buckets:
            if not bucket.sharded:  # (split masters: the kernel writes the weight as the master's upper half)
                targets.update((id(s), s.param.data) for s in bucket.slots
                               if not s.master_is_param and s.master_low is None)
                continue
            if bucket.send is None:  # kept: the optimizer's tables stay valid while addresses do
                bucket.send = torch.empty(bucket.region, dtype=bucket.param_dtype, device=self.device)
            targets.update((id(s), bucket._region_view(bucket.send, s, bucket.rank, 0))
                           for s in bucket.slots if s.bounds[bucket.rank][1])
        return [targets.get(id(s)) for s in self.slots]

    def gather_params(self, targets_written: bool = False) -> None:
        """Write the updated fp32 master chunks back into the (possibly bf16) params: an
        all-gather per sharded bucket, a local copy otherwise. With `targets_written` the
        optimizer already wrote every `weight_targets()` entry: no local copy or packing. With
        offload the host's masters are copied in (`HostOffload.push`; `targets_written`: the
        optimizer pushed every bucket already)."""
        if self.host is not None:
            if not targets_written:
                for bucket in self.buckets:
                    self.host.push(bucket)
            self.host.wait_pushed()
            targets_written = True
        in_flight = []
        for bucket in self.buckets:
            if not bucket.sharded:
                pairs = [(s.param.data, s.master) for s in bucket.slots if not s.master_is_param and s.master_low is None]
                if pairs and not targets_written:
                    torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
                continue
            send = bucket.send
            if send is None or not targets_written:
                send = torch.empty(bucket.region, dtype=bucket.param_dtype, device=self.device)
                bucket.pack_masters(send)
            recv = torch.empty(bucket.size * bucket.region, dtype=bucket.param_dtype, device=self.device)
            in_flight.append((bucket, recv, _all_gather(recv, send, group=bucket.group, async_op=True)))
        for bucket, recv, work in in_flight:
            work.wait()
            skip = bucket.rank if all(s.master_is_param for s in bucket.slots) else None
            bucket.unpack_params(recv, skip)
        for callback in self.on_new_weights:
            callback()

    def local_grads(self) -> list[torch.Tensor]:
        """The reduced gradients this rank's optimizer consumes (ZeRO chunks or full grads); with
        offload their host copies, once every copy has landed."""
        if self.host is not None:
            self.host.wait_grads()
            return [self.host.host_grad(slot) for slot in self.slots]
        return [slot.shard_grad for slot in self.slots]

    def remove(self) -> None:
        """Detach the hooks and sinks (the model is left with its current params)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for slot in self.slots:
            slot.param.main_grad_sink = None
        for slot in self._accumulating:
            del slot.param.main_grad, slot.param.grad_added_to_main_grad


def apply_data_parallel(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    bucket_mb: float = 25.0,
    distributed_optimizer: bool = True,
    param_dtype: torch.dtype = torch.float32,
    grad_reduce: str = "sum",
    gradient_accumulation_fusion: bool = True,
    split_masters: bool = False,
    offload: bool = False,
    host_limit_gb: float = 0.0,
    moments_dtype: torch.dtype = torch.float32,
) -> DataParallel:
    """Attach bucketed, overlapped gradient reduction (and the ZeRO-1 layout when
    `distributed_optimizer`) to a plain model; returns the handle the optimizer uses.
    `gradient_accumulation_fusion`: ops that can (the experts' grouped GEMM) write weight
    gradients straight into the fp32 main grads through `param.main_grad_sink`; params tagged
    `accumulates_main_grad` (Transformer Engine's linears) get `param.main_grad` to add into.
    `split_masters` (bf16 params): each fp32 master is kept as the bf16 weight (its upper 16
    bits, rounded) plus an int16 low half, exact, 2 bytes per parameter instead of 4.
    `offload`: fp32 masters in host memory, reduced grads streamed there by bucket
    (core.parallel.offload), at most `host_limit_gb` of it per rank (0: the host's available
    memory over the ranks per node). `moments_dtype`: what the optimizer keeps its two moments
    in (float32 or bfloat16, `train.optimizer_moments_dtype`; `core.train.optim.AdamW` reads it)."""
    return DataParallel(
        model, mesh, bucket_mb=bucket_mb, shard_optimizer=distributed_optimizer,
        param_dtype=param_dtype, grad_reduce=grad_reduce, gradient_accumulation_fusion=gradient_accumulation_fusion,
        split_masters=split_masters, offload=offload, host_limit_gb=host_limit_gb, moments_dtype=moments_dtype,
    )
