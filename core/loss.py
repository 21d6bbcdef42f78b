"""Token cross-entropy as a (sum, count) pair, optionally over vocab-sharded logits.

The training loop adds up `loss_sum` over micro-batches and divides by the global count of
labelled tokens (every micro-batch, every data-parallel rank), so the loss and gradients
equal the single-process mean over the whole global batch, whatever the split.

With `tp_group`, `logits` are this rank's vocab shard [T, V/tp] (rank r holds vocab ids
[r*V/tp, (r+1)*V/tp)) and labels are the full [T]: the row max, the sum of exponentials and
the target logit are combined over the group (two all-reduces of [T] and [2, T] floats);
the full logits are never gathered. The same code runs without a group.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from core.parallel.comm import group_rank, group_size

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of labelled tokens; logits may be a vocab shard.

    Memory: the only [T, V_local] fp32 tensor is the shifted logits, exponentiated in place
    and saved; the backward turns it into the gradient in place (fp32 logits) or writes the
    gradient straight into a tensor of the logits' dtype (bf16/fp16)."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        vocab_local = logits.shape[-1]
        vocab_start = group_rank(group) * vocab_local
        # The max in the logits' own dtype is exact; subtracting it as fp32 yields fp32
        # shifted logits in one pass, with no separate fp32 copy of the logits.
        row_max = logits.max(dim=-1).values.float()
        if group_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        # Type promotion makes this fp32 for bf16/fp16 logits (fp64 stays fp64); it is a new
        # tensor, so the in-place steps below never touch the caller's logits.
        shifted = logits - row_max.unsqueeze(-1)

        labelled = labels != IGNORE_INDEX
        local = labels.long() - vocab_start
        mine = labelled & (local >= 0) & (local < vocab_local)
        local = local.masked_fill(~mine, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)

        exp = shifted.exp_()  # in place: shifted is not needed any more
        stats = torch.stack((exp.sum(dim=-1), target))
        if group_size(group) > 1:
            dist.all_reduce(stats, group=group)
        sum_exp, target = stats
        per_token = (sum_exp.log() - target).masked_fill(~labelled, 0.0)

        # Unnormalised exp is saved; the division by sum_exp is folded into the backward's
        # single pass, which saves a read-write of the [T, V_local] fp32 tensor.
        ctx.save_for_backward(exp, sum_exp, local, mine, labelled)
        ctx.logits_dtype = logits.dtype
        ctx.used = False
        return per_token.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("vocab-parallel cross-entropy reuses its saved exp in place: backward runs once (no retain_graph)")
        ctx.used = True
        exp, sum_exp, local, mine, labelled = ctx.saved_tensors
        # d(loss)/d(logit) = (exp - sum_exp * one_hot(target)) / sum_exp for labelled tokens.
        # The one-hot is subtracted in fp32, before any rounding to the logits' dtype, so the
        # target entry (softmax - 1, often tiny) keeps its precision.
        rows = torch.arange(exp.shape[0], device=exp.device)
        exp[rows, local] -= sum_exp * mine.to(exp.dtype)
        coef = (labelled.to(exp.dtype) * grad_loss / sum_exp).unsqueeze(-1)
        if ctx.logits_dtype == exp.dtype:
            return exp.mul_(coef), None, None
        grad = torch.empty(exp.shape, dtype=ctx.logits_dtype, device=exp.device)
        return torch.mul(exp, coef, out=grad), None, None  # scale and round in one pass


def _plain_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), labels.long(), ignore_index=IGNORE_INDEX, reduction="sum")


@functools.cache
def _compiled_plain_sum():
    return torch.compile(_plain_sum)  # built on first use: importing this module stays cheap


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None = None, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the fp32 cross-entropy over tokens whose label is not -100, number of such tokens).

    logits: [T, V] or, with `tp_group`, this rank's vocab shard [T, V/tp]; any float dtype,
    computed in fp32 (fp64 stays fp64). labels: [T] integer ids in [0, V) or -100.
    Returns a scalar float tensor and an int64 scalar tensor; divide the sum by the global
    count, not this micro-batch's. Labels are range-checked only on CPU (a check on GPU would
    stall the stream); an out-of-range label on GPU counts with a zero target logit.
    `compiled` (CUDA, no vocab sharding): the same sum through a torch.compile'd cross-entropy."""
    if logits.dim() != 2 or labels.dim() != 1 or logits.shape[0] != labels.shape[0]:
        raise ValueError(
            f"cross_entropy_sum expects logits [T, V] and labels [T]; got logits {tuple(logits.shape)} "
            f"and labels {tuple(labels.shape)}"
        )
    if not logits.is_floating_point() or labels.is_floating_point():
        raise ValueError(f"logits must be floating point and labels integer; got {logits.dtype} and {labels.dtype}")
    if labels.device.type == "cpu" and labels.numel():
        vocab = logits.shape[-1] * group_size(tp_group)
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
        if bad.any():
            raise ValueError(
                f"labels must be in [0, {vocab}) or {IGNORE_INDEX}; found {labels[bad][0].item()}"
            )
    count = (labels != IGNORE_INDEX).sum()
    if compiled and logits.is_cuda and group_size(tp_group) == 1:
        # Whole logits on one GPU: inductor fuses the fp32 softmax into a couple of passes over
        # the bf16 logits, where the eager function above makes ~6 over fp32 copies.
        return _compiled_plain_sum()(logits, labels), count
    return _VocabParallelCrossEntropy.apply(logits, labels, tp_group), count
