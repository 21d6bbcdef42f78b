"""Dense linears whose weight gradient is added straight into the fp32 main grad, inside the
compiled blocks' backward (Megatron's gradient-accumulation fusion).

Without it a block's backward returns each weight's bf16 gradient and data parallelism adds it
into the fp32 main grad in a pass of its own: a bf16 read and a fp32 read-modify-write per
parameter and micro-batch, ~13 ms of a ~1B model's step at four micro-batches. Here the weight
gradient GEMM adds into the main grad in its epilogue, the main grads are zeroed once per step
(`DataParallel.zero_grad`), and the gradient autograd sees is a stand-in with all-zero
strides, which the data-parallel hook takes as "already added" and only counts.

The GEMM is a custom op that mutates the main grad, so torch.compile traces the linear's
backward around it; it runs for plain bf16 `nn.Linear`s without bias in the attention and
feed-forward modules that are not recomputed whole (tensor-parallel, FP8 and Transformer Engine
linears keep their own backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.layers import FeedForward


def matmul_into_(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """out (fp32) = [out +] a @ b, with a, b in a 16-bit dtype: on a GPU one GEMM whose epilogue
    adds in fp32 (Megatron's gradient-accumulation fusion), no 16-bit product in between."""
    if out.is_cuda and a.dtype != out.dtype:
        torch.addmm(out, a, b, out_dtype=out.dtype, beta=1 if accumulate else 0, out=out)
    elif accumulate:
        out.add_(torch.mm(a, b).to(out.dtype))
    else:
        out.copy_(torch.mm(a, b))


@torch.library.custom_op("tessera::add_weight_grad_", mutates_args=("main_grad",))
def add_weight_grad_(main_grad: Tensor, grad_out: Tensor, inputs: Tensor) -> None:
    """main_grad += grad_out^T @ inputs over all leading dims, accumulated in fp32."""
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    matmul_into_(main_grad, dy.t(), inputs.reshape(-1, inputs.shape[-1]), accumulate=True)


@add_weight_grad_.register_fake
def _(main_grad: Tensor, grad_out: Tensor, inputs: Tensor) -> None:
    return None


class _LinearIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, main_grad: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        # Held, not saved: main_grad is a view of its bucket's buffer, whose version counter
        # every other parameter's accumulation bumps (saved, autograd would refuse it).
        ctx.main_grad = main_grad
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        add_weight_grad_(ctx.main_grad, grad_out, x)
        return grad_out @ weight, weight.new_zeros(()).expand(weight.shape), None


def _forward_into_main_grad(self: nn.Linear, x: Tensor) -> Tensor:
    return _LinearIntoMainGrad.apply(x, self.weight, self.weight.main_grad)


def _recomputed_whole(module: nn.Module) -> bool:
    return hasattr(module, "_recompute_original")  # core.parallel.recompute's checkpoint wrapper


def fuse_weight_grads(chunks: list[nn.Module]) -> None:
    """Route the plain bias-free linears of every block's attention and feed-forward modules
    through the fused weight gradient, and tag their weights for data parallelism (call after
    `apply_recompute` and before `apply_data_parallel`, which gives them `main_grad`).

    Linears inside a module recomputed whole (`mlp`, `attention`, `block`) keep the plain
    backward: compiled by torch 2.11, a checkpoint around the autograd function keeps the
    function's outputs instead of recomputing them (measured: the w1/w3 outputs of every block,
    +3.4 GiB on the ~1B model)."""
    for chunk in chunks:
        for block in chunk.layers.values():
            if _recomputed_whole(block):
                continue
            parents = [block.attention] if not _recomputed_whole(block.attention) else []
            if not block.checkpoint_feed_forward and not _recomputed_whole(block.feed_forward):
                parents += [m for m in block.feed_forward.modules() if isinstance(m, FeedForward)]
            for parent in parents:
                for linear in parent.children():
                    if type(linear) is nn.Linear and linear.bias is None:
                        linear.weight.accumulates_main_grad = True
                        linear.weight.main_grad_added_in_graph = True
                        linear.forward = _forward_into_main_grad.__get__(linear)
