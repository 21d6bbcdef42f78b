"""AdamW over many tensors in one Triton launch, writing the new weights in the params' dtype too.

torch's `_fused_adamw_` updates fp32 masters in one pass, but a bf16 model then needs a second
pass that reads every master again to cast it into the params (`_foreach_copy_`). Here the cast
rides in the update: each element's new master is also stored as bf16 where a destination is
given. Per element the pass reads master, grad and both moments (16 bytes) and writes them back
with the bf16 copy (14 bytes), where the two passes move 34.

One launch covers every tensor: a block table maps each program to (tensor, block of it), and
per-tensor tables hold the addresses, sizes and weight decays. The tables are built on the host
once per distinct set of tensors (`AdamWTables`), so a step costs one small launch.

The arithmetic is torch's AdamW (decoupled decay, bias-corrected moments), in fp32; a pending
clip factor multiplies the gradient on load.

Split masters (`split_master`, `parallel.split_master_weights`): the fp32 master is held as the
bf16 weight (its upper 16 bits, rounded) plus an int16 low half; the kernel joins the two,
updates, and splits again in the same pass (reads 16 bytes per element, writes 12).

bf16 moments (`train.optimizer_moments_dtype = "bf16"`): both moments are loaded as bf16 and
widened to fp32, updated in fp32 like fp32 moments, and stored back rounded to nearest (even),
in the same pass: 4 bytes per element less read and 4 less written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.kernels.fused import _launch, triton, triton_enabled

if triton is not None:
    import triton.language as tl

# 4 elements a thread (one 16-byte access per fp32 tensor): 2.9 TB/s on an H100 over the ~1B
# model's 183 tensors; blocks of 2048 and more ran slower (4096 with 4 warps spilled, 13x slower).
_BLOCK = 1024
_WARPS = 8
_OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

if triton is not None:

    @triton.jit
    def _round_bf16(x):
        """fp32 -> bf16 rounded to nearest even on the bits, as torch's cast (NaN: 0x7fc0). Triton's
        interpreter rounds toward zero in its own cast, so this keeps the CPU test and the GPU equal."""
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _adamw_kernel(block_tensor, block_index, masters, grads, exp_avgs, exp_avg_sqs, outs, lows, numels, decays,
                      scale, lr, beta1, beta2, eps, step_size, bias2_sqrt, HAS_SCALE: tl.constexpr,
                      OUT_KIND: tl.constexpr, SPLIT: tl.constexpr, MOMENTS_BF16: tl.constexpr, ALIGNED: tl.constexpr,
                      BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        start = tl.load(block_index + pid).to(tl.int64) * BLOCK
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < tl.load(numels + t)
        master_addr = tl.load(masters + t)
        master_ptr = master_addr.to(tl.pointer_type(tl.float32))
        grad_ptr = tl.load(grads + t).to(tl.pointer_type(tl.float32))
        if MOMENTS_BF16:
            m_ptr = tl.load(exp_avgs + t).to(tl.pointer_type(tl.bfloat16))
            v_ptr = tl.load(exp_avg_sqs + t).to(tl.pointer_type(tl.bfloat16))
        else:
            m_ptr = tl.load(exp_avgs + t).to(tl.pointer_type(tl.float32))
            v_ptr = tl.load(exp_avg_sqs + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:  # addresses read from memory: say they allow 16-byte vector accesses
            master_ptr = tl.multiple_of(master_ptr, 16)
            grad_ptr = tl.multiple_of(grad_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
        g = tl.load(grad_ptr + offs, mask=mask)
        if HAS_SCALE:
            g = g * tl.load(scale)
        if SPLIT:  # the master is the bf16 weight (its upper 16 bits) plus the low 16 bits apart
            low_ptr = tl.load(lows + t).to(tl.pointer_type(tl.int16))
            high_ptr = master_addr.to(tl.pointer_type(tl.int16))
            if ALIGNED:
                low_ptr = tl.multiple_of(low_ptr, 16)
                high_ptr = tl.multiple_of(high_ptr, 16)
            high = tl.load(high_ptr + offs, mask=mask).to(tl.int32)
            bits = (high << 16) + tl.load(low_ptr + offs, mask=mask).to(tl.int32)
            p = bits.to(tl.float32, bitcast=True)
        else:
            p = tl.load(master_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        p = p - lr * tl.load(decays + t) * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
        if MOMENTS_BF16:
            tl.store(m_ptr + offs, _round_bf16(m), mask=mask)
            tl.store(v_ptr + offs, _round_bf16(v), mask=mask)
        else:
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
        if SPLIT:
            # Upper half rounded (half away from zero on the magnitude), the remainder exact in
            # [-0x8000, 0x7fff]: high * 2**16 + low is the fp32 master, bit for bit.
            bits = p.to(tl.int32, bitcast=True)
            high = (bits + 0x8000) >> 16
            tl.store(high_ptr + offs, high.to(tl.int16), mask=mask)
            tl.store(low_ptr + offs, (bits - (high << 16)).to(tl.int16), mask=mask)
        else:
            tl.store(master_ptr + offs, p, mask=mask)
        out_addr = tl.load(outs + t)
        if out_addr != 0:
            if OUT_KIND == 0:
                out_ptr = out_addr.to(tl.pointer_type(tl.bfloat16))
            elif OUT_KIND == 1:
                out_ptr = out_addr.to(tl.pointer_type(tl.float16))
            else:
                out_ptr = out_addr.to(tl.pointer_type(tl.float32))
            if ALIGNED:
                out_ptr = tl.multiple_of(out_ptr, 16)
            if SPLIT:  # the new weight is the upper half, not a rounding of p of its own
                weight = high.to(tl.int16).to(tl.bfloat16, bitcast=True)
            else:
                weight = p.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs, weight, mask=mask)


def multi_tensor_adamw_supported(tensors: list[Tensor], outs: list[Tensor | None],
                                  moments: list[Tensor] = ()) -> bool:
    """Whether `multi_tensor_adamw` can run on these: Triton on their device, `tensors` fp32 and
    contiguous, `moments` contiguous and all fp32 or all bf16, destinations contiguous and of
    one float dtype."""
    if not tensors or not triton_enabled(tensors[0]):
        return False
    dtypes = {o.dtype for o in outs if o is not None}
    moment_dtypes = {m.dtype for m in moments}
    return (all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and len(moment_dtypes) <= 1 and moment_dtypes <= {torch.float32, torch.bfloat16}
            and all(m.is_contiguous() for m in moments)
            and len(dtypes) <= 1 and dtypes <= set(_OUT_KINDS)
            and all(o.is_contiguous() for o in outs if o is not None))


class AdamWTables:
    """The device tables of one set of tensors; rebuilt when any address, size or decay changes."""

    def __init__(self):
        self._key: tuple | None = None
        self._tables: tuple[Tensor, ...] = ()
        self.out_kind = 0
        self.aligned = False

    def get(self, masters, grads, exp_avgs, exp_avg_sqs, outs, lows, decays) -> tuple[Tensor, ...]:
        key = tuple((m.data_ptr(), g.data_ptr(), a.data_ptr(), s.data_ptr(), o.data_ptr() if o is not None else 0,
                     low.data_ptr() if low is not None else 0, m.numel(), d)
                    for m, g, a, s, o, low, d in zip(masters, grads, exp_avgs, exp_avg_sqs, outs, lows, decays))
        if key != self._key:
            self._key, self._tables = key, self._build(key, masters[0].device)
            self.out_kind = next((_OUT_KINDS[o.dtype] for o in outs if o is not None), 0)
            self.aligned = all(address % 16 == 0 for entry in key for address in entry[:6])
        return self._tables

    @staticmethod
    def _build(key: tuple, device: torch.device) -> tuple[Tensor, ...]:
        columns = [torch.tensor(column) for column in zip(*key)]  # masters..lows, numels, decays
        blocks = (columns[6] + _BLOCK - 1) // _BLOCK
        block_tensor = torch.repeat_interleave(torch.arange(len(key)), blocks)
        first_block = torch.cumsum(blocks, 0) - blocks
        block_index = torch.arange(int(blocks.sum())) - first_block[block_tensor]
        host = [block_tensor.int(), block_index.int(), *columns[:7], columns[7].float()]
        return tuple(h.to(device) for h in host)


def multi_tensor_adamw(tables: AdamWTables, masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                       exp_avg_sqs: list[Tensor], outs: list[Tensor | None], decays: list[float], *, lr: float,
                       betas: tuple[float, float], eps: float, step: int, grad_scale: Tensor | None,
                       lows: list[Tensor] | None = None) -> None:
    """One AdamW step of every master in place (and its moments: all fp32, or all bf16, updated in
    fp32 and rounded to nearest even), the new weight also cast into `outs[i]` where given;
    `grad_scale` (a one-element fp32 tensor) multiplies every gradient.
    With `lows` the masters are split (`split_master`): masters[i] is the bf16 weight and lows[i]
    its int16 low half, both updated. Needs `multi_tensor_adamw_supported`."""
    block_tensor, *rest = tables.get(masters, grads, exp_avgs, exp_avg_sqs, outs, lows or [None] * len(masters),
                                     decays)
    if not block_tensor.numel():
        return
    beta1, beta2 = betas
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    _launch(_adamw_kernel, (block_tensor.numel(),), block_tensor, *rest,
            grad_scale if grad_scale is not None else block_tensor, lr, beta1, beta2, eps, lr / bias1, bias2**0.5,
            HAS_SCALE=grad_scale is not None, OUT_KIND=tables.out_kind, SPLIT=lows is not None,
            MOMENTS_BF16=exp_avgs[0].dtype == torch.bfloat16, ALIGNED=tables.aligned, BLOCK=_BLOCK, num_warps=_WARPS)


def split_master(master: Tensor) -> tuple[Tensor, Tensor]:
    """(bf16 weight, int16 low half) holding fp32 `master` exactly: the weight is its upper 16
    bits rounded half away from zero (round-to-nearest but for exact ties), the low half the
    signed remainder. `join_master` inverts it bit for bit."""
    bits = master.float().contiguous().view(torch.int32)
    high = (bits + 0x8000) >> 16
    low = (bits - (high << 16)).to(torch.int16)
    return high.to(torch.int16).view(torch.bfloat16), low


def join_master(high: Tensor, low: Tensor) -> Tensor:
    """The fp32 master of a (bf16 weight, int16 low half) pair."""
    bits = (high.contiguous().view(torch.int16).to(torch.int32) << 16) + low.to(torch.int32)
    return bits.view(torch.float32)
