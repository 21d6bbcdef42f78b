"""Dense linears whose weight gradient is added straight into the fp32 main grad, inside the
compiled blocks' backward (Megatron's gradient-accumulation fusion), and the token embedding's.

Without it a block's backward returns each weight's bf16 gradient and data parallelism adds it
into the fp32 main grad in a pass of its own: a bf16 read and a fp32 read-modify-write per
parameter and micro-batch, ~13 ms of a ~1B model's step at four micro-batches. Here the weight
gradient GEMM adds into the main grad in its epilogue, the main grads are zeroed once per step
(`DataParallel.zero_grad`), and the gradient autograd sees is a stand-in with all-zero
strides, which the data-parallel hook takes as "already added" and only counts.

The linear and its weight-gradient GEMM are library operators (the latter mutates the main grad), so
torch.compile traces them and the partitioner may recompute the linear under a checkpoint; it
runs for the plain bf16 `nn.Linear`s without bias in the attention and feed-forward modules
(tensor-parallel, FP8 and Transformer Engine linears keep their own backward).

The token embedding (`fuse_embedding_grad`): autograd's backward writes a dense [vocab, dim]
bf16 gradient (a zero fill and a scatter) that data parallelism then adds into the fp32 main
grad, a pass over every row of the table per micro-batch (0.7 ms at vocab 102400 and dim 2048
on an H100) for the few thousand rows the micro-batch used. Here the backward adds the used
rows into the main grad itself, in fp32 and in a fixed order (`core.kernels.embedding`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.kernels.embedding import add_embedding_grad_
from core.kernels.fused import add_weight_grad_
from core.layers import FeedForward, model_blocks


# Library ops, not `torch.library.custom_op`: its Python wrappers cost the host ~8 us a call of
# the linear (on a CPU core: 38 against 30), paid for every linear of every block and micro-batch.
_LIB = torch.library.Library("tessera", "FRAGMENT")
# F.linear(x, weight), whose backward adds the weight gradient into `main_grad`. An op rather
# than an autograd function: inside a compiled checkpoint (recompute `mlp`, `attention`, `block`)
# torch 2.11's partitioner recomputes an op's output but keeps an autograd function's (measured:
# the w1/w3 outputs of every block, +3.4 GiB on the ~1B model).
_LIB.define("linear_into_main_grad(Tensor x, Tensor weight, Tensor main_grad) -> Tensor")
_LIB.impl("linear_into_main_grad", lambda x, weight, main_grad: F.linear(x, weight), "CompositeExplicitAutograd")
torch.library.register_fake("tessera::linear_into_main_grad",
                            lambda x, weight, main_grad: x.new_empty(*x.shape[:-1], weight.shape[0]), lib=_LIB)
linear_into_main_grad = torch.ops.tessera.linear_into_main_grad.default


def _save_for_weight_grad(ctx, inputs, output) -> None:
    x, weight, main_grad = inputs
    ctx.save_for_backward(x, weight)
    ctx.main_grad = main_grad  # held, not saved: its own backward mutates it


def _backward_into_main_grad(ctx, grad_out: Tensor):
    x, weight = ctx.saved_tensors
    add_weight_grad_(ctx.main_grad, grad_out, x)
    return grad_out @ weight, weight.new_zeros(()).expand(weight.shape), None


torch.library.register_autograd("tessera::linear_into_main_grad", _backward_into_main_grad,
                                setup_context=_save_for_weight_grad, lib=_LIB)


def _forward_into_main_grad(self: nn.Linear, x: Tensor) -> Tensor:
    return linear_into_main_grad(x, self.weight, self.weight.main_grad)


def _fuse(linear: nn.Module) -> None:
    if type(linear) is nn.Linear and linear.bias is None:
        linear.weight.accumulates_main_grad = True
        linear.weight.main_grad_added_in_graph = True
        linear.forward = _forward_into_main_grad.__get__(linear)


def _tied(chunk: nn.Module) -> bool:
    """The chunk's output head shares the embedding's weight."""
    return getattr(getattr(chunk, "cfg", None), "tie_embeddings", False)


def fuse_weight_grads(chunks: list[nn.Module]) -> None:
    """Route the plain bias-free linears of every block's attention and feed-forward modules,
    and an untied output head, through the fused weight gradient, and tag their weights for
    data parallelism (call after `apply_recompute` and before `apply_data_parallel`, which gives
    them `main_grad`)."""
    for chunk in chunks:
        for _, block in model_blocks(chunk):
            parents = [block.attention] + [m for m in block.feed_forward.modules() if isinstance(m, FeedForward)]
            for parent in parents:
                for linear in parent.children():
                    _fuse(linear)
        head = getattr(chunk, "output", None)
        if head is not None and not _tied(chunk):
            _fuse(head)


def _add_embedding_grad(main_grad: Tensor, tokens: Tensor, grad_out: Tensor, accumulate: bool) -> None:
    if not accumulate:  # the step's first micro-batch: rows it did not use must read zero
        main_grad.zero_()
    add_embedding_grad_(main_grad, tokens, grad_out)


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """F.embedding(tokens, weight) whose backward adds the used rows' gradients into the
    weight's fp32 main grad through `weight.main_grad_sink` (core.parallel.data)."""

    @staticmethod
    def forward(ctx, tokens, weight):
        ctx.save_for_backward(tokens)
        ctx.sink = weight.main_grad_sink
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (tokens,) = ctx.saved_tensors
        ctx.sink.write(lambda main_grad, accumulate: _add_embedding_grad(main_grad, tokens, grad_out, accumulate))
        return None, ctx.sink.stand_in()


def _forward_embedding_into_main_grad(self: nn.Embedding, tokens: Tensor) -> Tensor:
    weight = self.weight
    if getattr(weight, "main_grad_sink", None) is not None and weight.requires_grad and torch.is_grad_enabled():
        return _EmbeddingIntoMainGrad.apply(tokens, weight)
    return F.embedding(tokens, weight)


def fuse_embedding_grad(chunks: list[nn.Module]) -> None:
    """Route a plain `nn.Embedding` token table (no padding row, norm limit or frequency scaling;
    not tied to the output head, whose gradient arrives the plain way and may sit on another
    pipeline stage) through the fused gradient.
    Takes effect once data parallelism gives the weight its `main_grad_sink`; without one (no
    gradient-accumulation fusion) it is the plain embedding."""
    for chunk in chunks:
        table = getattr(chunk, "tok_embeddings", None)
        if type(table) is not nn.Embedding or _tied(chunk):
            continue
        if table.padding_idx is not None or table.max_norm is not None or table.scale_grad_by_freq or table.sparse:
            continue
        table.forward = _forward_embedding_into_main_grad.__get__(table)
