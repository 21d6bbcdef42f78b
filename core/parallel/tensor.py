"""Tensor parallelism (Megatron layout) with optional sequence parallelism, applied to a plain GPT.

`apply_tp(model, mesh, sequence_parallel)` rewrites the model in place. Every rank must have
built the same full weights (`build_model(cfg, seed)`); each keeps its slice:

| module                              | becomes                  | weight slice (tp_shard_dim)        |
|-------------------------------------|--------------------------|------------------------------------|
| attention.wq / wk / wv, ffn.w1 / w3 | ColumnParallelLinear     | output features (0): whole heads   |
| attention.wo, ffn.w2                | RowParallelLinear        | input features (1)                 |
| tok_embeddings                      | VocabParallelEmbedding   | vocab rows (0)                     |
| output                              | ColumnParallelLinear     | vocab rows (0): logits [T, V/tp]   |
| norms                               | unchanged, replicated    | None                               |
| attention.q_norm / k_norm (qk-norm) | unchanged, replicated    | None (gradient summed over tp)     |
| MLA: wq / wq_b, wkv_b               | ColumnParallelLinear     | output features (0): whole heads   |
| MLA: wq_a, wkv_a, q_norm, kv_norm   | unchanged, replicated    | None (gradient summed over tp)     |

Multi-head latent attention (core/mla.py) splits its heads the same way: the up-projections
(wq or wq_b, wkv_b) are column-parallel over whole heads and wo is row-parallel. The
down-projections and the latent norms run on every rank on the gathered tokens (their output,
the latent, is a few hundred features per token, cheaper to recompute than to communicate);
each rank's up-projection reads only its heads' share of the latent, so their gradients are
partial over tp like the qk-norm gains and are summed by `sync_sequence_parallel_grads`, and
the sub-layer's input collective sums the input gradient that flows back through them.

Biases. A column-parallel layer's bias stays whole and replicated (ZeRO-1 needs a dim that
tensor parallelism leaves whole, and a bias has one): each rank adds its own slice of it, so
its gradient is nonzero on that slice only and is summed over tp like the qk-norm gains (one
gain shared by all heads, each rank seeing its own heads). A row-parallel bias is added once,
after the reduction.

Where the communication sits. Attention and the dense FFN each get one input collective on
the sub-layer (a forward pre-hook), not one per projection: wq, wk, wv (or w1, w3) then share
a single all-gather, and autograd sums their input gradients before the single backward
collective. The row-parallel output projection ends the region with the matching collective.

- sequence_parallel=False (classic Megatron): the residual stream is replicated [T, dim] on
  every TP rank; sub-layer input: identity fwd / all-reduce bwd; row output: all-reduce fwd.
- sequence_parallel=True: the residual stream, norms and dropout-free elementwise work hold
  only this rank's T/tp tokens (rows [r*T/tp, (r+1)*T/tp) of the flattened micro-batch).
  Sub-layer input: all-gather tokens fwd / reduce-scatter bwd; row output: reduce-scatter.
  Attention therefore always sees all T tokens, so `tokens`, `position_ids`, `cu_seqlens`
  and labels stay the full [T] micro-batch on every TP rank, and the rotary tables built in
  `GPT.forward` from position_ids line up with the gathered q/k. T must be divisible by tp.
  Norm gains then receive a partial gradient on each rank: they carry
  `param.sequence_parallel_partial = True`, and the training loop calls
  `sync_sequence_parallel_grads(model, mesh)` once per optimizer step, before the
  data-parallel reduction.

A foreign feed-forward module (the MoE layer, or anything not `core.train.model.FeedForward`) is
left alone and gets no pre-hook. It receives what the residual stream holds: under sequence
parallelism this rank's local token shard [T/tp, dim], and it must return the complete
(TP-reduced) output for exactly those tokens, [T/tp, dim]; without sequence parallelism it
receives the full [T, dim], identical on every TP rank, and must return the full output,
identical on every TP rank. Parameters it keeps replicated over TP that see only local
tokens (e.g. a router under SP) should set `sequence_parallel_partial = True` so
`sync_sequence_parallel_grads` sums them too. It may use `core.parallel.comm` for that.

For checkpoint resharding every parameter carries `tp_shard_dim` (0, 1, or None when
replicated) and `tp_full_shape` (the unsharded shape); shards are equal and in TP-rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core import placement
from core.layers import model_blocks
from core.mesh import ParallelMesh
from core.layers import Attention, FeedForward
from core.mla import MLAttention
from core.parallel.comm import (
    all_gather_tokens,
    copy_to_group,
    reduce_from_group,
    reduce_scatter_tokens,
)


def _shard(full: torch.Tensor, dim: int, rank: int, size: int, what: str) -> nn.Parameter:
    """This rank's equal slice of a full parameter, tagged for checkpoint resharding."""
    if full.shape[dim] % size:
        raise ValueError(f"{what}: size {full.shape[dim]} along dim {dim} is not divisible by tp={size}")
    chunk = full.shape[dim] // size
    param = nn.Parameter(full.detach().narrow(dim, rank * chunk, chunk).clone(), requires_grad=full.requires_grad)
    return placement.tag_tp(param, dim, full.shape)


def _replicated(param: nn.Parameter, partial_grad: bool) -> nn.Parameter:
    return placement.tag_tp(param, None, param.shape, partial_grad)


class ColumnParallelLinear(nn.Module):
    """y[:, shard] = x W[shard]^T: this rank's slice of the output features.

    `input_comm`: "gather" (x is a token shard: all-gather fwd / reduce-scatter bwd),
    "copy" (x is replicated: identity fwd / all-reduce bwd), or "none" (the caller already did
    one of these, e.g. a pre-hook shared by q/k/v). The output stays sharded."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, input_comm: str, bias_offset: int = 0):
        super().__init__()
        if input_comm not in ("gather", "copy", "none"):
            raise ValueError(f"input_comm={input_comm!r} must be 'gather', 'copy' or 'none'")
        self.weight, self.bias = weight, bias
        self.group, self.input_comm = group, input_comm
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias_offset = bias_offset  # where this rank's slice starts in a whole (replicated) bias
        self.matmul = F.linear  # core.precision.blockwise.apply_fp8 swaps in its FP8 GEMM

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, rank: int, size: int, input_comm: str, name: str):
        weight = _shard(linear.weight, 0, rank, size, f"{name}.weight")
        bias = _replicated(linear.bias, partial_grad=True) if linear.bias is not None else None
        return cls(weight, bias, group, input_comm, bias_offset=rank * weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_comm == "gather":
            x = all_gather_tokens(x, self.group)
        elif self.input_comm == "copy":
            x = copy_to_group(x, self.group)
        bias = self.bias
        if bias is not None and bias.shape[0] != self.out_features:
            bias = bias.narrow(0, self.bias_offset, self.out_features)
        return self.matmul(x, self.weight, bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out_local={self.out_features}, input_comm={self.input_comm}"


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[:, shard] W[:, shard]^T: input features are sharded.

    `sequence_parallel`: the partial sums are reduce-scattered along tokens (output [T/tp, out])
    instead of all-reduced (output [T, out]). The bias is added once, after the reduction."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, sequence_parallel: bool):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.matmul = F.linear  # core.precision.blockwise.apply_fp8 swaps in its FP8 GEMM

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, rank: int, size: int, sequence_parallel: bool, name: str):
        weight = _shard(linear.weight, 1, rank, size, f"{name}.weight")
        bias = _replicated(linear.bias, sequence_parallel) if linear.bias is not None else None
        return cls(weight, bias, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_partial(self.matmul(x, self.weight))

    def reduce_partial(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's x[:, shard] W[:, shard]^T, computed elsewhere (a tiled FFN), summed over the group."""
        out = reduce_scatter_tokens(partial, self.group) if self.sequence_parallel else reduce_from_group(partial, self.group)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"in_local={self.in_features}, out={self.out_features}, sequence_parallel={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocab rows split over TP ranks.

    Each rank looks up the tokens its rows cover and writes zeros for the rest; the partial
    results are summed by all-reduce (output [T, dim]) or, under sequence parallelism,
    reduce-scattered along tokens (output [T/tp, dim])."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.vocab_start, self.vocab_end = vocab_start, vocab_start + weight.shape[0]
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        # Index 0 stands in for foreign tokens; their rows are zeroed below, so no gradient
        # reaches row 0 from them.
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_tokens(out, self.group)
        return reduce_from_group(out, self.group)

    def extra_repr(self) -> str:
        return f"vocab=[{self.vocab_start}, {self.vocab_end}), dim={self.weight.shape[1]}, sequence_parallel={self.sequence_parallel}"


def _input_hook(group, sequence_parallel: bool):
    """Forward pre-hook: the sub-layer's first argument enters the tensor-parallel region."""

    def hook(module, args):
        x = all_gather_tokens(args[0], group) if sequence_parallel else copy_to_group(args[0], group)
        return (x, *args[1:])

    return hook


def _check_heads(attn: Attention, tp: int, prefix: str) -> None:
    for proj in ("wq", "wk"):
        heads = getattr(attn, proj).out_features // attn.head_dim
        if heads % tp:
            kind = "query" if proj == "wq" else "key/value"
            raise ValueError(
                f"{prefix}.{proj}: {heads} {kind} heads cannot be split over tp={tp}; "
                f"tp must divide num_heads and num_kv_heads"
            )


def _split_mla(attn: MLAttention, group, rank: int, size: int, sp: bool, prefix: str) -> None:
    heads = attn.wkv_b.out_features // (attn.nope_dim + attn.v_dim)
    if heads % size:
        raise ValueError(f"{prefix}: {heads} heads cannot be split over tp={size}; tp must divide num_heads")
    for proj in ("wq", "wq_b", "wkv_b"):
        linear = getattr(attn, proj)
        if linear is not None:
            setattr(attn, proj, ColumnParallelLinear.from_linear(linear, group, rank, size, "none", f"{prefix}.{proj}"))
    attn.wo = RowParallelLinear.from_linear(attn.wo, group, rank, size, sp, f"{prefix}.wo")
    # Replicated, but each rank's gradient covers only its own heads' use of the latents.
    for module in (attn.wq_a, attn.q_norm, attn.wkv_a, attn.kv_norm):
        if module is not None:
            for param in module.parameters():
                _replicated(param, partial_grad=True)


def apply_tp(model: nn.Module, mesh: ParallelMesh, sequence_parallel: bool = True) -> nn.Module:
    """Shard `model` in place over the mesh's "tp" group (see the module docstring); returns it.

    Works on a pipeline stage too: missing layers and `None` embeddings/norm/output are skipped.
    With tp == 1 only the checkpoint tags (`tp_shard_dim=None`) are added."""
    size = mesh.size("tp")
    if size > 1 and not mesh.distributed:
        raise ValueError(f"tp={size} needs torch.distributed initialised and a ParallelMesh built on it")
    group, rank = mesh.group("tp"), mesh.coordinate("tp")
    sp = sequence_parallel and size > 1

    if size > 1:
        for prefix, block in model_blocks(model):
            attn = block.attention
            if isinstance(attn.wo, RowParallelLinear):
                raise ValueError(f"{prefix}.attention is already tensor-parallel: apply_tp was applied twice")
            if isinstance(attn, MLAttention):
                _split_mla(attn, group, rank, size, sp, f"{prefix}.attention")
            else:
                _check_heads(attn, size, f"{prefix}.attention")
                for proj in ("wq", "wk", "wv"):
                    linear = getattr(attn, proj)
                    setattr(attn, proj, ColumnParallelLinear.from_linear(linear, group, rank, size, "none", f"{prefix}.attention.{proj}"))
                attn.wo = RowParallelLinear.from_linear(attn.wo, group, rank, size, sp, f"{prefix}.attention.wo")
            attn.register_forward_pre_hook(_input_hook(group, sp))

            ffn = block.feed_forward
            if isinstance(ffn, FeedForward):  # foreign FFNs (MoE) parallelise themselves
                for proj in ("w1", "w3"):
                    linear = getattr(ffn, proj)
                    setattr(ffn, proj, ColumnParallelLinear.from_linear(linear, group, rank, size, "none", f"{prefix}.feed_forward.{proj}"))
                ffn.w2 = RowParallelLinear.from_linear(ffn.w2, group, rank, size, sp, f"{prefix}.feed_forward.w2")
                ffn.register_forward_pre_hook(_input_hook(group, sp))

        tied = (
            model.tok_embeddings is not None
            and model.output is not None
            and model.output.weight is model.tok_embeddings.weight
        )
        if model.tok_embeddings is not None:
            weight = _shard(model.tok_embeddings.weight, 0, rank, size, "tok_embeddings.weight")
            model.tok_embeddings = VocabParallelEmbedding(weight, rank * weight.shape[0], group, sp)
        if model.output is not None:
            input_comm = "gather" if sp else "copy"
            if tied:  # one shard shared by both, so the two gradients accumulate into it
                bias = model.output.bias
                bias = _shard(bias, 0, rank, size, "output.bias") if bias is not None else None
                model.output = ColumnParallelLinear(model.tok_embeddings.weight, bias, group, input_comm)
            else:
                model.output = ColumnParallelLinear.from_linear(model.output, group, rank, size, input_comm, "output")

    # Under sequence parallelism the norms see only this rank's tokens, so their gains get
    # partial gradients (row-parallel biases were tagged in from_linear).
    # The MTP modules' norms and their replicated input projection likewise (they see the
    # residual stream's tokens).
    mtp = [m for module in (getattr(model, "mtp", None) or ()) for m in (module.enorm, module.hnorm, module.eh_proj, module.norm)]
    norms = [model.norm] + [m for _, block in model_blocks(model) for m in (block.attention_norm, block.ffn_norm)] + mtp
    for norm in norms:
        if norm is not None:
            for param in norm.parameters():
                _replicated(param, partial_grad=sp)
    # qk-norm gains are shared by the heads; each rank's gradient covers its own heads.
    for _, block in model_blocks(model):
        for norm in (block.attention.q_norm, getattr(block.attention, "k_norm", None)):
            if norm is not None:
                _replicated(norm.weight, partial_grad=size > 1)
    # Everything else not sharded above is replicated over TP; foreign modules that tagged
    # their own parameters keep their tags.
    for param in model.parameters():
        if not placement.has_tp_tags(param):
            _replicated(param, partial_grad=False)
    return model


@torch.no_grad()
def sync_sequence_parallel_grads(model: nn.Module, mesh: ParallelMesh) -> None:
    """Sum over the TP group the gradients of parameters tagged `sequence_parallel_partial`.

    One flattened all-reduce per dtype (one in practice). Call once per optimizer step, after
    the last micro-batch's backward and before the data-parallel gradient reduction."""
    group = mesh.group("tp")
    if mesh.size("tp") == 1 or group is None:
        return
    params = [p for p in model.parameters() if placement.is_sequence_parallel_partial(p) and p.requires_grad]
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:  # keep the flat layout identical on every rank
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group_params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group_params])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in group_params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
