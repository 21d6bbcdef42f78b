"""Activation recomputation and offload, module by module.

`apply_recompute(model, mode, modules, offload)` rewrites each block of a plain GPT (or a
pipeline chunk) in place. The module kinds (`core.rules.RECOMPUTE_MODULES`):

| kind             | which modules                                      | what stays saved                  |
|------------------|----------------------------------------------------|-----------------------------------|
| `norms`          | attention_norm, ffn_norm, q/k (MLA: latent) norms  | the norm's input only             |
| `swiglu`         | silu(a) * b of the dense MLP, shared and routed experts | a and b only                 |
| `moe_experts`    | the routed experts (three grouped GEMMs)           | the dispatched rows               |
| `attention_core` | softmax(q k^T) v (what `recompute = "selective"` is) | q, k, v                         |
| `mla_up`         | MLA: the up-projections (q_norm+wq_b or wq, kv_norm+wkv_b), rotary and core | the latents |
| `attention`      | the attention sub-layer (projections, rotary, core) | its input                        |
| `mlp`            | the feed-forward sub-layer (dense or MoE), its norm | the norm's input                 |
| `block`          | the whole block (what `recompute = "full"` is)     | its input                         |

A recomputed module runs under non-reentrant checkpointing: its own saved tensors are dropped
after the forward and recomputed in the backward. For `norms` and `swiglu` the module's
*output* is dropped too (Megatron's "checkpoint without output"): the next layer saves it for
its weight gradient (wq/wk/wv the norm's output, w2 the product), and a saved-tensor hook
around that layer replaces it by a recipe that reruns the cheap module when the backward needs
it. Those hooks are not traceable by torch.compile; compiled blocks get the plain checkpoint
inside their graph instead, which the partitioner honours for the consumers in the same graph.

Offload (`offload`): the tensors a module saves for backward are copied to pinned host memory
on a side stream as they are saved (the forward goes on meanwhile) and copied back on a second
one in the backward; the first use of a module's tensors also starts bringing back the module that ran
before it, so the copies overlap the backward's compute. Parameters and tensors smaller than
`MIN_OFFLOAD_BYTES` stay on the device.

When an outer kind is chosen the inner ones inside it are skipped (`block` covers all). The
recomputed values are the forward's, bit for bit: the losses and gradients do not change.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from core.rules import RECOMPUTE_MODULES
from core.layers import FeedForward, RMSNorm, SwiGLU, model_blocks
from core.mla import MLAttention
from core.parallel.checkpoint_offload import CheckpointOffload
from core.parallel.host_copies import SideStreams, wait_for_stores

MODES = ("none", "selective", "full")
MIN_OFFLOAD_BYTES = 1 << 16  # below this a copy costs more in launch time than it saves
STORES_IN_FLIGHT = 2  # modules whose copies to the host may still run when the next one starts


def _recompute_forward(module: nn.Module) -> None:
    """Run `module` under non-reentrant checkpointing: its activations are dropped after
    forward and recomputed in backward. Replacing the instance's forward keeps parameter
    names (and so checkpoints) unchanged."""
    original = module.forward

    def forward(*args, **kwargs):
        return _checkpoint(module, original, args, kwargs)

    module.forward = forward
    module._recompute_original = original


def _checkpoint(module: nn.Module, fn, args, kwargs):
    """`fn` under non-reentrant checkpointing; inside the hooks of the module's checkpoint-input
    offload when it has one (core/parallel/checkpoint_offload.py)."""
    offload = module.__dict__.get("_checkpoint_offload")
    if offload is None or not torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    with offload.around(module):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _recompute_feed_forward_branch(block: nn.Module) -> None:
    """`mlp`: the feed-forward with its norm in one checkpoint, which keeps the residual stream
    (saved anyway) instead of the norm's output: one [tokens, dim] tensor less per block."""
    block.checkpoint_feed_forward = True


def compile_inside_checkpoint(module: nn.Module, **compile_options) -> bool:
    """Compile a recomputed module's own forward and keep the checkpoint outside it; False when
    `module` is not recomputed whole. Compiled from outside, the checkpoint becomes one region
    for dynamo, and a graph break inside it (the attention core and the MoE dispatch stay out
    of compile) runs that whole region eagerly: every block op uncompiled."""
    original = getattr(module, "_recompute_original", None)
    if original is None:
        return False
    compiled = torch.compile(original, **compile_options)

    def forward(*args, **kwargs):
        return _checkpoint(module, compiled, args, kwargs)

    module.forward = forward
    return True


class _Recipe:
    """Stands for a dropped output among a consumer's saved tensors: how to compute it again.
    One recipe serves every op that saved the output (wq, wk and wv the norm's): the first
    unpack computes it, the others share the value, which goes with the last of them."""

    __slots__ = ("run", "args", "value")

    def __init__(self, run, args):
        self.run, self.args, self.value = run, args, None

    def get(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.run(*self.args)
        return self.value


def _drop_output(producer: nn.Module, consumer: nn.Module) -> None:
    """Tensors that `consumer`'s forward saves and that are `producer`'s output are saved as a
    recipe (the producer's inputs, which its own checkpoint keeps anyway) and recomputed when
    the backward unpacks them. A consumer may have several producers (a dense FFN drops both the
    norm's output and the SwiGLU product): one pair of hooks serves them all, since only the
    innermost saved-tensor hooks see a saved tensor."""
    run = getattr(producer, "_recompute_original", producer.forward)
    live: list[tuple[torch.Tensor, _Recipe]] = []

    def note(module, args, output):  # the producer runs just before its consumer (or inside it)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor):
            live.append((output, _Recipe(run, args)))

    producer.register_forward_hook(note)
    producers = consumer.__dict__.get("_dropped_outputs")
    if producers is not None:
        producers.append(live)
        return
    producers = consumer.__dict__["_dropped_outputs"] = [live]

    def pack(t: torch.Tensor):
        for outputs in producers:
            for out, recipe in outputs:
                if t._cdata == out._cdata:  # the very tensor (its C++ object), never a look-alike
                    return recipe
        return t

    def unpack(saved):
        return saved.get() if isinstance(saved, _Recipe) else saved

    original = consumer.forward

    def forward(*args, **kwargs):
        try:
            with saved_tensors_hooks(pack, unpack):
                return original(*args, **kwargs)
        finally:
            for outputs in producers:
                outputs.clear()  # the outputs are referenced only until their consumer ran

    consumer.forward = forward


class _Saved:
    """One offloaded tensor: its host copy and, once brought back, its device copy."""

    __slots__ = ("host", "device", "dtype_device", "stored", "loaded", "group", "__weakref__")

    def __init__(self, host, device_type, stored, group):
        self.host, self.device, self.dtype_device = host, None, device_type
        self.stored, self.loaded, self.group = stored, None, group


class ActivationOffload:
    """Saved-tensor hooks that keep the activations of wrapped modules in host memory."""

    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.min_bytes = min_bytes
        self.stats = {"tensors": 0, "bytes": 0}
        self._groups: list[list[weakref.ref]] = []  # per wrapped forward, in forward order
        self._streams = SideStreams()
        self._current: list | None = None
        self._seen: dict | None = None

    def wrap(self, module: nn.Module) -> None:
        original = module.forward

        def forward(*args, **kwargs):
            outer = self._current, self._seen
            self._groups = [g for g in self._groups if any(r() is not None for r in g)]
            self._wait_for_stores()
            self._current, self._seen = [], {}
            self._groups.append(self._current)
            try:
                with saved_tensors_hooks(self._pack, self._unpack):
                    return original(*args, **kwargs)
            finally:
                self._current, self._seen = outer

        module.forward = forward

    def _wait_for_stores(self) -> None:
        """Hold the host until the copies of the module `STORES_IN_FLIGHT` back have finished
        (host_copies.wait_for_stores)."""
        if len(self._groups) >= STORES_IN_FLIGHT:
            wait_for_stores(self._groups[-STORES_IN_FLIGHT])

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) \
                or t.numel() * t.element_size() < self.min_bytes or self._current is None:
            return t
        # The same tensor saved by several ops (x for wq, wk and wv) gets one copy. Only the live
        # object itself matches: a freed tensor's memory (and address) is reused at once.
        key = t._cdata
        known = self._seen.get(key)
        if known is not None and known[0]() is t:
            return known[1]
        if t.is_cuda:
            # preserve_format keeps the strides of a dense layout (a transposed weight's input)
            # and makes a gapped view contiguous: the copy never reads or writes outside the view
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            stored = self._streams.store(t, host)
        else:  # CPU runs (the tests): a separate copy, so the path is the GPU's but for streams
            host, stored = t.clone(), None
        saved = _Saved(host, t.device, stored, self._current)
        self._current.append(weakref.ref(saved))
        self._seen[key] = (weakref.ref(t), saved)
        self.stats["tensors"] += 1
        self.stats["bytes"] += t.numel() * t.element_size()
        return saved

    def _load(self, saved: _Saved) -> None:
        if saved.device is not None:
            return
        if saved.host.device == saved.dtype_device:  # CPU
            saved.device = saved.host
            return
        device, saved.loaded = self._streams.load(saved.host, saved.dtype_device, saved.stored)
        saved.device = device

    def _load_group(self, group: list) -> None:
        for ref in group:
            if (s := ref()) is not None:
                self._load(s)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.device is None:
            self._load_group(saved.group)
            # The backward goes from later modules to earlier ones: bring the one before back now.
            index = next((i for i, g in enumerate(self._groups) if g is saved.group), None)
            if index:
                self._load_group(self._groups[index - 1])
        if saved.loaded is not None:
            current = torch.cuda.current_stream(saved.dtype_device)
            current.wait_event(saved.loaded)
            saved.loaded = None  # waited for once
        return saved.device

    def pop_stats(self) -> dict:
        stats, self.stats = self.stats, {"tensors": 0, "bytes": 0}
        return stats


def _experts(ffn: nn.Module) -> list[nn.Module]:
    """The routed experts of an MoE feed-forward layer (found by shape: core knows no MoE)."""
    return [m for m in ffn.modules() if isinstance(getattr(m, "act", None), SwiGLU) and not isinstance(m, FeedForward)
            and m is not ffn and not isinstance(m, SwiGLU)]


def _targets(block: nn.Module, kind: str) -> list[tuple[nn.Module, nn.Module | None]]:
    """(module, the consumer whose saved copy of its output is dropped, or None) of one kind."""
    attn, ffn = block.attention, block.feed_forward
    if kind == "block":
        return [(block, None)]
    if kind == "attention":
        return [(attn, None)]
    if kind == "mlp":
        return [(ffn, None)]
    if kind == "attention_core":
        return [(attn.core_attention, None)]
    if kind == "mla_up":
        if not isinstance(attn, MLAttention):
            raise ValueError("recompute 'mla_up' needs multi-head latent attention (model.attention = 'mla')")
        return [(attn, None)]
    if kind == "moe_experts":
        return [(m, None) for m in _experts(ffn)]
    if kind == "norms":
        out = [(block.attention_norm, attn), (block.ffn_norm, ffn)]
        inner = (attn.q_norm, attn.kv_norm) if isinstance(attn, MLAttention) else (attn.q_norm, attn.k_norm)
        return out + [(n, None) for n in inner if isinstance(n, RMSNorm)]
    if kind == "swiglu":
        return [(parent.act, parent) for parent in block.modules() if isinstance(getattr(parent, "act", None), SwiGLU)]
    raise ValueError(f"unknown module kind {kind!r}; choose from {', '.join(RECOMPUTE_MODULES)}")


def _outermost(chosen: list[tuple[nn.Module, nn.Module | None, str]]) -> list[tuple[nn.Module, nn.Module | None, str]]:
    """Drop the modules that sit inside another chosen one (its recompute covers them). `mla_up`
    covers its attention's latent norms and core, not the down-projections."""
    inside: set[int] = set()
    for module, _, kind in chosen:
        if kind == "mla_up":
            inside.update(id(m) for m in (module.q_norm, module.kv_norm, module.core_attention) if m is not None)
        else:
            inside.update(id(m) for m in module.modules() if m is not module)
    return [c for c in chosen if id(c[0]) not in inside]


def apply_recompute(model: nn.Module, mode: str = "none", modules=(), offload=(),
                    offloader: ActivationOffload | None = None, compiled: bool = False,
                    num_layers: int = 0, checkpoint_offload: CheckpointOffload | None = None,
                    offload_kinds=(), chunk: int = 0, offload_layers: int = 0) -> nn.Module:
    """Recompute `mode`'s modules and `modules`, offload `offload` (kinds in the module docstring).
    `num_layers` > 0: recompute in the model's (chunk's) first `num_layers` blocks only, so a
    memory budget between two recompute sets is used up block by block (offload: every block).

    mode: none, selective (= attention_core) or full (= block). Selective saves the most memory
    per FLOP recomputed among the old modes; the finer kinds trade further.
    compiled (the blocks will be compiled whole): `norms` and `swiglu` are plain checkpoints,
    traced into the block's graph, where the partitioner recomputes the module's output for
    every op that saved it; no saved-tensor hooks (compile cannot trace them).
    checkpoint_offload: the schedule that keeps the checkpoint inputs of the recomputed
    `offload_kinds` (`core.rules.offloaded_checkpoints`) in host memory; `chunk`: this model
    chunk's index among the rank's chunks (its passes are its own); `offload_layers` > 0: only the
    first that many recomputed blocks place theirs (the earliest inputs wait longest for their
    backward), the later ones keep them on the device."""
    if mode not in MODES:
        raise ValueError(f"recompute mode must be none, selective or full, got {mode!r}")
    kinds = set(modules) | {"none": set(), "selective": {"attention_core"}, "full": {"block"}}[mode]
    for kind in list(kinds) + list(offload):
        if kind not in RECOMPUTE_MODULES:
            raise ValueError(f"unknown module kind {kind!r}; choose from {', '.join(RECOMPUTE_MODULES)}")
    if "mla_up" in offload:
        raise ValueError("offload 'mla_up' is not a module of its own; offload 'attention' or 'attention_core'")
    if offload and offloader is None:
        offloader = ActivationOffload()
    placed = 0  # recomputed blocks whose checkpoint inputs go to the host
    for position, (_, block) in enumerate(model_blocks(model)):
        recomputed = kinds if not num_layers or position < num_layers else set()
        chosen = _outermost([(m, c, k) for k in sorted(recomputed) for m, c in _targets(block, k)])
        to_host = checkpoint_offload is not None and (not offload_layers or placed < offload_layers)
        placed += bool(recomputed)
        if any(k == "mlp" for _, _, k in chosen):  # the mlp's checkpoint holds its norm
            chosen = [c for c in chosen if c[0] is not block.ffn_norm]
        for module, _, kind in chosen:
            if kind == "mlp":
                _recompute_feed_forward_branch(block)
            elif kind == "mla_up":
                module.recompute_up = True
            else:
                _recompute_forward(module)
                if to_host and kind in offload_kinds:
                    checkpoint_offload.place(module, chunk, position)
        for module, consumer, _ in chosen:
            if consumer is not None and not compiled:
                _drop_output(module, consumer)
        for module, _, _ in _outermost([(m, None, k) for k in sorted(offload) for m, _ in _targets(block, k)]):
            offloader.wrap(module)
    model.activation_offload = offloader
    model.checkpoint_offload = checkpoint_offload
    return model
