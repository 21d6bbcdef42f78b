"""The inputs of recomputed modules in host memory between the forward and the backward
(`train.offload_checkpoints`).

A recomputed module (core/parallel/recompute.py) keeps only its checkpoint's inputs for the
backward: a whole block keeps its input, [tokens, dim]. `CheckpointOffload` moves those inputs
to host buffers while the forward goes on and brings them back one module ahead in the backward:

- **pack** (the forward, as the checkpoint saves its inputs): a D2H copy into a buffer of the
  `HostPool` on a side stream, after the compute stream's kernels that wrote the tensor; the
  tensor's device memory returns to the allocator once the copy has read it.
- **unpack** (the backward, when the module's recompute starts): the module's tensors are brought
  back if they are not yet (an H2D copy on a second side stream), and so are those of the module
  that ran before it in the same forward, whose backward comes next; the compute stream waits only
  for its own module's copy. The host buffer returns to the pool once the copy back is queued (the
  next copy into it waits for that one on the device, not on the host).

The schedule knows the forward order through the passes it sees: each wrapped module has a place
(model chunk, block position); a chunk's forward opens a new pass when a module packs at or before
the last place packed in the current one. A pass is one micro-batch through one chunk, so groups
are keyed by (chunk, micro-batch, block): gradient accumulation and the pipeline's schedules (several
micro-batches in flight, interleaved chunks) need no other bookkeeping. Compiled blocks keep their
checkpoint outside the compiled region (`compile_inside_checkpoint`), so the hooks run eagerly.

`train.offload_checkpoints_layers` = N > 0 places only the first N recomputed blocks of each
chunk (core/parallel/recompute.py); the rest keep their inputs on the device, for a host too small
for all of them. The first, because the backward runs in reverse: the earliest blocks' inputs wait
the whole rest of the forward and backward for their use, the last block's are needed at once, so
moving the earliest frees the device longest per byte of host memory and leaves the copies back
the most compute to hide behind.

On a machine without CUDA the same path runs with synchronous host copies into the pool's (unpinned)
buffers: the tests see the order, the prefetch and which tensors move. The copies move bytes and
change no value: training is bit for bit the same.

What moves: the floating-point tensors among a checkpoint's arguments (the rotary tables and the
micro-batch's meta are not tensors there, position ids not floating), which are activations
([tokens, features]), so no size floor is needed. What stays on the device: parameters,
non-contiguous tensors, and leaves that require a gradient (a pipeline stage's received activation,
which the schedule keeps anyway for its gradient).
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from core.parallel.host_copies import SideStreams, wait_for_stores

log = logging.getLogger(__name__)

STORES_IN_FLIGHT = 2  # groups of a pass whose copies to the host may still run when the next one packs


class _Slot:
    """One host buffer of the pool and the copy back that last read it (a CUDA event)."""

    __slots__ = ("buffer", "read")

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.read = buffer, None


class HostPool:
    """Host buffers made once and reused. `sizes`: {bytes: count}, from the planner's model of
    what a rank keeps in flight. A request takes the smallest free buffer that holds it; with none
    free a new one is made and kept (logged once: the plan was short)."""

    def __init__(self, sizes: dict[int, int], pin: bool):
        self.pin = pin
        self.free: list[_Slot] = []
        self.made = 0
        self.grown = 0
        for nbytes, count in sizes.items():
            for _ in range(count):
                self.free.append(self._make(nbytes))
        self.planned = self.made

    def _make(self, nbytes: int) -> _Slot:
        self.made += 1
        return _Slot(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin))

    @property
    def bytes(self) -> int:
        return sum(s.buffer.numel() for s in self.free)

    def take(self, nbytes: int) -> _Slot:
        fits = [s for s in self.free if s.buffer.numel() >= nbytes]
        if fits:
            slot = min(fits, key=lambda s: s.buffer.numel())
            self.free.remove(slot)
            return slot
        if not self.grown:
            log.warning("checkpoint offload: the host pool of %d buffers is short; adding buffers of %d bytes",
                        self.planned, nbytes)
        self.grown += 1
        return self._make(nbytes)

    def give(self, slot: _Slot) -> None:
        self.free.append(slot)


class _Stored:
    """One offloaded tensor: its host buffer and, once brought back, its device copy."""

    __slots__ = ("owner", "slot", "shape", "dtype", "device", "stored", "loaded", "back", "group", "key",
                 "__weakref__")

    def __init__(self, owner, slot, t: torch.Tensor, stored, group, key):
        self.owner, self.slot, self.shape, self.dtype, self.device = owner, slot, t.shape, t.dtype, t.device
        self.stored, self.loaded, self.back, self.group, self.key = stored, None, None, group, key

    def host(self) -> torch.Tensor:
        nbytes = self.shape.numel() * self.dtype.itemsize
        return self.slot.buffer[:nbytes].view(self.dtype).view(self.shape)

    def __del__(self):  # dropped without a backward (a graph freed unused): the buffer goes back
        if self.slot is not None:
            self.owner.pool.give(self.slot)
            self.slot = None


class _Group:
    """The tensors one checkpoint saved, in one pass."""

    __slots__ = ("key", "members", "pass_", "index", "started")

    def __init__(self, key, pass_, index):
        self.key, self.members, self.pass_, self.index, self.started = key, [], pass_, index, False


class _Pass:
    """One forward of one chunk (a micro-batch): its groups in forward order."""

    __slots__ = ("chunk", "micro", "groups", "last", "modules", "__weakref__")

    def __init__(self, chunk: int, micro: int):
        self.chunk, self.micro, self.groups, self.last, self.modules = chunk, micro, [], -1, set()


class CheckpointOffload:
    """The step's schedule of checkpoint-input copies, and the hooks that make them.

    `record=True` keeps `events`: ("store" | "load" | "use", (chunk, micro, position)[, why]) in
    the order they happened (what the tests read)."""

    def __init__(self, pool: HostPool | None = None, record: bool = False):
        self.pool = pool or HostPool({}, pin=False)
        self.events: list[tuple] | None = [] if record else None
        self.stats = {"tensors": 0, "bytes": 0}
        self._open: dict[int, _Pass] = {}  # the pass each chunk's forward is in
        self._passes: dict[int, int] = {}  # passes opened per chunk (the micro-batch count)
        self._streams = SideStreams()

    def place(self, module: nn.Module, chunk: int, position: int) -> None:
        """Offload the inputs of `module`'s checkpoint, the `position`-th block of chunk `chunk`."""
        module._checkpoint_offload = self
        module._checkpoint_place = (chunk, position)

    @contextmanager
    def around(self, module: nn.Module):
        """The hooks around one forward of a placed module's checkpoint."""
        chunk, position = module._checkpoint_place
        current = self._open.get(chunk)
        if current is None or position < current.last or id(module) in current.modules:
            micro = self._passes.get(chunk, 0)
            self._passes[chunk] = micro + 1
            current = self._open[chunk] = _Pass(chunk, micro)
        current.last = position
        current.modules.add(id(module))
        group = _Group((chunk, current.micro, position), current, len(current.groups))
        current.groups.append(group)
        self._wait_for_stores(current)
        with saved_tensors_hooks(lambda t: self._pack(t, group), self._unpack):
            yield

    def _wait_for_stores(self, current: _Pass) -> None:
        """Hold the host until the copies of the group `STORES_IN_FLIGHT` back have read their
        tensors (host_copies.wait_for_stores)."""
        if len(current.groups) > STORES_IN_FLIGHT:
            wait_for_stores(current.groups[-STORES_IN_FLIGHT - 1].members)

    def _note(self, *event) -> None:
        if self.events is not None:
            self.events.append(event)

    def _pack(self, t: torch.Tensor, group: _Group):
        nbytes = t.numel() * t.element_size()
        if (isinstance(t, nn.Parameter) or not t.is_floating_point() or not t.is_contiguous()
                or (t.is_leaf and t.requires_grad)):
            return t
        slot = self.pool.take(nbytes)
        stored = _Stored(self, slot, t, None, group, group.key)
        host = stored.host()
        if t.is_cuda:
            stored.stored = self._streams.store(t, host, after=slot.read)
        else:  # without CUDA: the same path with a synchronous copy
            host.copy_(t)
        slot.read = None
        group.members.append(weakref.ref(stored))
        self.stats["tensors"] += 1
        self.stats["bytes"] += nbytes
        self._note("store", group.key)
        return stored

    def _load(self, stored: _Stored, why: str) -> None:
        if stored.back is not None or stored.slot is None:
            return
        host = stored.host()
        if stored.device.type == "cuda":
            back, stored.loaded = self._streams.load(host, stored.device, stored.stored)
            stored.slot.read = stored.loaded
        else:
            back = host.clone()
        stored.back = back
        self.pool.give(stored.slot)  # the next copy into it waits for this one (slot.read)
        stored.slot = None
        self._note("load", stored.key, why)

    def _load_group(self, group: _Group, why: str) -> None:
        for ref in group.members:
            if (stored := ref()) is not None:
                self._load(stored, why)

    def _unpack(self, stored):
        if not isinstance(stored, _Stored):
            return stored
        group = stored.group
        if not group.started:  # the module's backward begins: its recompute reads its inputs
            group.started = True
            self._load_group(group, "demand")  # nothing where the prefetch brought them
            # The backward goes from later blocks to earlier ones: bring the one before back now.
            if group.index:
                self._load_group(group.pass_.groups[group.index - 1], "prefetch")
        if stored.loaded is not None:
            torch.cuda.current_stream(stored.device).wait_event(stored.loaded)
            stored.loaded = None  # waited for once
        self._note("use", stored.key)
        return stored.back

    def pop_stats(self) -> dict:
        stats, self.stats = self.stats, {"tensors": 0, "bytes": 0}
        return stats
