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

from core import placement
from core.layers import RMSNorm, rms_norm
from core.rules import FUSED_CHUNK_ELEMENTS
from core.kernels import cross_entropy as rows_ce
from core.kernels.fused import matmul_into_
from core.parallel.comm import all_gather_tokens, copy_to_group, group_rank, group_size
from dataservice.packing import IGNORE_INDEX


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
    Whole logits where Triton runs take `core.kernels.cross_entropy`; elsewhere `compiled` (CUDA,
    no vocab sharding, Triton off) takes a torch.compile'd cross-entropy."""
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
    if group_size(tp_group) == 1 and rows_ce.fits(logits):  # one Triton pass each way (core.kernels.cross_entropy)
        return rows_ce.cross_entropy_rows_sum(logits, labels, IGNORE_INDEX), count
    if compiled and logits.is_cuda and group_size(tp_group) == 1:
        # Whole logits on one GPU: inductor fuses the fp32 softmax into a couple of passes over
        # the bf16 logits, where the eager function above makes ~6 over fp32 copies.
        return _compiled_plain_sum()(logits, labels), count
    return _VocabParallelCrossEntropy.apply(logits, labels, tp_group), count


# -- the output projection and the loss in one pass over token chunks ---------------------------

def _chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, grad_scale: torch.Tensor):
    """(summed fp32 loss, d(loss * grad_scale)/d(logits) in the logits' dtype) of one chunk."""
    x = logits.float()
    vocab = x.shape[-1]
    labelled = labels != IGNORE_INDEX
    valid = labelled & (labels >= 0) & (labels < vocab)  # out of range on GPU: zero target logit
    target_ids = labels.long().masked_fill(~valid, 0)
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1).masked_fill(~valid, 0.0)
    loss = (lse - target).masked_fill(~labelled, 0.0).sum()
    one_hot = (torch.arange(vocab, device=x.device) == target_ids.unsqueeze(-1)) & valid.unsqueeze(-1)
    coef = (labelled.to(x.dtype) * grad_scale).unsqueeze(-1)
    grad = ((x - lse.unsqueeze(-1)).exp() - one_hot.to(x.dtype)) * coef
    return loss, grad.to(logits.dtype)


@functools.cache
def _compiled_chunk_loss_and_grad():
    return torch.compile(_chunk_loss_and_grad)  # two fused row passes over the bf16 chunk


def _vocab_parallel_chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, grad_scale: torch.Tensor,
                                        group: dist.ProcessGroup):
    """`_chunk_loss_and_grad` of one chunk whose logits are this rank's vocab shard: the row max,
    the sum of exponentials and the target logit are combined over `group` (two all-reduces of
    the chunk's rows), so every rank gets the whole loss and its own shard's logit gradient."""
    x = logits.float()
    vocab_local = x.shape[-1]
    labelled = labels != IGNORE_INDEX
    local = labels.long() - group_rank(group) * vocab_local
    mine = labelled & (local >= 0) & (local < vocab_local)  # out of range everywhere: zero target logit
    local = local.masked_fill(~mine, 0)
    row_max = x.max(dim=-1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    exp = (x - row_max.unsqueeze(-1)).exp()
    target = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    stats = torch.stack((exp.sum(dim=-1), target))
    dist.all_reduce(stats, group=group)
    sum_exp, target = stats
    loss = (sum_exp.log() + row_max - target).masked_fill(~labelled, 0.0).sum()
    one_hot = (torch.arange(vocab_local, device=x.device) == local.unsqueeze(-1)) & mine.unsqueeze(-1)
    coef = (labelled.to(x.dtype) * grad_scale).unsqueeze(-1)
    grad = (exp / sum_exp.unsqueeze(-1) - one_hot.to(x.dtype)) * coef
    return loss, grad.to(logits.dtype)


@functools.cache
def _compiled_rms_norm():
    return torch.compile(rms_norm)  # the chunk's norm in one row pass each way


def _chunk_norm(hidden_rows: torch.Tensor, gain: torch.Tensor, eps: float, compute_dtype: torch.dtype, compiled: bool):
    """(the chunk's normalised rows in `compute_dtype`, the autograd graph's input leaf): the model's
    own RMSNorm math on a detached slice, its graph alive only until the chunk's backward."""
    x = hidden_rows.detach().requires_grad_()
    with torch.enable_grad():
        y = (_compiled_rms_norm() if compiled else rms_norm)(x, gain, eps).to(compute_dtype)
    return y, x


class _FusedOutputCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `norm(hidden) @ weight.T` (or of `hidden @ weight.T` without a
    norm), chunk by chunk over the tokens, with every gradient computed in the forward: no [T, V]
    logits or logit gradients, and no whole fp32 copy of the hidden state, are ever alive.

    The weight's gradient goes straight into its fp32 main grad (`weight.main_grad_sink`) during
    the forward, scaled by `grad_scale`: the caller backpropagates exactly `grad_scale` into the
    loss (the trainer's 1 / global label count). The hidden state's gradient (through the norm,
    which each chunk runs forward and backward) and the norm gain's, summed over the chunks in
    fp32, are kept for the backward and scaled there by grad_loss / grad_scale, so they are exact
    for any incoming grad."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, grad_scale, compute_dtype, compiled, tp_group, norm_weight, norm_eps,
                norm_group):
        tokens, vocab = hidden.shape[0], weight.shape[0]
        chunk = max(1, min(tokens, FUSED_CHUNK_ELEMENTS // vocab))  # the same on every TP rank: equal shards
        w = weight.to(compute_dtype)
        if group_size(tp_group) > 1:  # eager: its all-reduces sit between the chunk's row passes
            loss_and_grad = functools.partial(_vocab_parallel_chunk_loss_and_grad, group=tp_group)
        else:
            loss_and_grad = _compiled_chunk_loss_and_grad() if compiled else _chunk_loss_and_grad
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        folded = norm_weight is not None
        if folded:
            # An fp32 gain: the product with the bf16 normalised rows is exact in fp32, so the
            # rounding to the compute dtype is the bf16 product's; its gradient sums in fp32.
            gain = norm_weight.detach().float().requires_grad_()
            grad_gain = torch.zeros(gain.shape, dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        else:
            h = hidden.to(compute_dtype)
            grad_hidden = torch.empty(hidden.shape, dtype=compute_dtype, device=hidden.device)
        sink = weight.main_grad_sink
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen here
            for start in range(0, tokens, chunk):
                rows = slice(start, min(start + chunk, tokens))
                if folded:
                    normed, leaf = _chunk_norm(hidden[rows], gain, norm_eps, compute_dtype, compiled)
                    x = normed.detach()
                else:
                    x = h[rows]
                loss, grad = loss_and_grad(torch.mm(x, w.t()), labels[rows], grad_scale)
                total += loss
                if folded:
                    grad_x, grad_g = torch.autograd.grad(normed, (leaf, gain), torch.mm(grad, w))
                    grad_hidden[rows] = grad_x
                    grad_gain += grad_g
                else:
                    torch.mm(grad, w, out=grad_hidden[rows])
                sink.write(lambda main_grad, accumulate: matmul_into_(main_grad, grad.t(), x, accumulate))
        if folded and group_size(norm_group) > 1:  # a replicated gain: each rank holds its vocab shard's part
            dist.all_reduce(grad_gain, group=norm_group)
        ctx.save_for_backward(grad_hidden, grad_scale, grad_gain if folded else None)
        ctx.sink, ctx.hidden_dtype, ctx.chunk = sink, hidden.dtype, chunk
        ctx.gain_dtype = norm_weight.dtype if folded else None
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_scale, grad_gain = ctx.saved_tensors
        factor = grad_loss / grad_scale  # 1 when the caller sends grad_scale, as the trainer does
        out = grad_hidden if grad_hidden.dtype == ctx.hidden_dtype else torch.empty_like(grad_hidden, dtype=ctx.hidden_dtype)
        # Scaled in fp32 a chunk at a time (in place when the dtypes agree): a whole fp32 copy of
        # [T, dim] would be the largest tensor of the head's backward.
        rows = max(ctx.chunk, FUSED_CHUNK_ELEMENTS // max(1, grad_hidden.shape[1]))
        for start in range(0, grad_hidden.shape[0], rows):
            part = slice(start, start + rows)
            out[part] = grad_hidden[part].float() * factor
        if grad_gain is not None:
            grad_gain = (grad_gain * factor).to(ctx.gain_dtype)
        return out, ctx.sink.stand_in(), None, None, None, None, None, grad_gain, None, None


def fused_output_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, grad_scale: torch.Tensor,
    compute_dtype: torch.dtype | None = None, compiled: bool = False, tp_group: dist.ProcessGroup | None = None,
    norm: RMSNorm | None = None, norm_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """cross_entropy_sum(norm(hidden) @ weight.T, labels)[0] without materialising the logits
    (without `norm`: of hidden @ weight.T).

    hidden: [T, d]; weight: [V, d], a data-parallel parameter with a `main_grad_sink` (its
    gradient is written into the fp32 main grad during this call, already multiplied by
    `grad_scale`, a 0-dim fp32 tensor: the gradient the caller sends into the returned sum).
    `norm`: the RMSNorm between the hidden state and the head (the model's final norm), run on
    each chunk forward and backward; its gain's gradient is the sum over the chunks.
    Peak extra memory: one chunk of ~FUSED_CHUNK_ELEMENTS logits and their gradient (and the
    norm's fp32 rows of that chunk), plus [T, d] for the hidden state's gradient, where the
    unfused loss holds [T, V] twice and the eager norm two fp32 copies of [T, d].

    With `tp_group`, `weight` is this rank's vocab shard [V/tp, d] (rank r: ids [r*V/tp,
    (r+1)*V/tp)) and `hidden` the whole [T, d] on every rank (after the head's input
    collective: `head_input`); the loss is the whole one on every rank, and the hidden state's
    gradient (and the gain's) this shard's part: the collective's backward sums the first over
    the group, `norm_group` (given where nothing else sums the gain over it) the second."""
    if getattr(weight, "main_grad_sink", None) is None:
        raise ValueError("fused_output_cross_entropy_sum needs a weight whose gradient goes to a fp32 main grad "
                         "(a DataParallel parameter with gradient_accumulation_fusion)")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"fused_output_cross_entropy_sum expects hidden [T, d], weight [V, d] and labels [T]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}")
    if norm is not None and not isinstance(norm, RMSNorm):
        raise ValueError(f"fused_output_cross_entropy_sum folds an RMSNorm into its chunks; got {type(norm).__name__}")
    dtype = compute_dtype or weight.dtype
    return _FusedOutputCrossEntropy.apply(hidden, weight, labels, grad_scale, dtype, compiled and hidden.is_cuda,
                                          tp_group, None if norm is None else norm.weight,
                                          None if norm is None else norm.eps, norm_group)


def head_input(head, hidden: torch.Tensor) -> torch.Tensor:
    """What `head` (the output projection) would multiply: `hidden` after a tensor-parallel head's
    input collective (all-gather of the token shards under sequence parallelism, else a copy whose
    backward sums over the group); `hidden` itself for a plain linear."""
    comm = getattr(head, "input_comm", "none")
    if comm == "gather":
        return all_gather_tokens(hidden, head.group)
    if comm == "copy":
        return copy_to_group(hidden, head.group)
    return hidden


def fused_head_loss(model, hidden: torch.Tensor, labels: torch.Tensor, grad_scale: torch.Tensor,
                    compute_dtype: torch.dtype | None = None, compiled: bool = False,
                    norm: RMSNorm | None = None) -> torch.Tensor:
    """The model's output head and the loss fused (`fused_output_cross_entropy_sum`), on a plain or
    a tensor-parallel head: the summed loss of `hidden` (what `model.hidden_states` returns), or
    with `norm` of `norm(hidden)`, the norm run chunk by chunk inside the loss (`hidden` then is
    what `model.hidden_states(..., normed=False)` returns: the last block's output)."""
    head = model.output
    tp_group = head.group if getattr(head, "input_comm", "none") != "none" else None
    # A gain whose gradient data parallelism sums over tp (sequence parallelism: each rank's norm
    # saw its own tokens) needs no sum here; a replicated one does.
    norm_group = tp_group if norm is not None and not placement.is_sequence_parallel_partial(norm.weight) else None
    return fused_output_cross_entropy_sum(head_input(head, hidden), head.weight, labels, grad_scale,
                                          compute_dtype, compiled, tp_group, norm, norm_group)
