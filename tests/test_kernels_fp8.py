"""core.kernels.fp8 on CPU: quantisation semantics, scale layouts, GEMM fallbacks, C ABI checks.

References: per-block amax computed here in float64 (a scale must equal fp32(amax) / 448 and
the block's largest element must map to +-448); dequantised round trips within e4m3's half
ulp (2^-4 relative, plus half the subnormal step 2^-10 times the scale); GEMMs against float64
products of the dequantised operands. The CUDA kernels are checked bit-exact against these
fallbacks on a GPU by tests/gpu_kernels_check_fp8.py.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from core.kernels import fp8, library
from core.kernels import fp8_wgrad as kwgrad
from tests.gpu_kernels_check import reference_mm

built = pytest.mark.skipif(not library.DEFAULT_PATH.is_file(), reason="csrc/build/libtessera_kernels.so not built")


def _x(rows, cols, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 2, cols)[torch.randperm(cols, generator=gen)]
    return x.to(dtype)


def _assert_roundtrip(x: torch.Tensor, deq: torch.Tensor, scale_per_elem: torch.Tensor) -> None:
    bound = 2.0**-4 * x.double().abs() + 2.0**-10 * scale_per_elem.double()
    assert bool(((deq.double() - x.double()).abs() <= bound * (1 + 1e-6)).all())


def test_1x128_scales_round_trip_and_block_max():
    x = _x(37, 300)
    x[3] = 0  # an all-zero row: scale 1, q 0
    q, scale = fp8.quantize_1x128(x)
    assert q.dtype == fp8.FP8 and scale.shape == (3, 37)
    padded = torch.nn.functional.pad(x.float(), (0, 84)).view(37, 3, 128)
    amax = padded.abs().amax(-1)
    expected = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    assert torch.equal(scale.t(), expected)
    assert torch.equal(scale[:, 3], torch.ones(3)) and q[3].float().abs().sum() == 0
    peak = padded.abs().argmax(-1)  # the largest element of each block becomes +-448
    qp = torch.nn.functional.pad(q.float(), (0, 84)).view(37, 3, 128).gather(-1, peak[..., None]).squeeze(-1)
    assert torch.equal(qp.abs()[amax > 0], torch.full_like(qp[amax > 0], 448.0))
    _assert_roundtrip(x, fp8.dequantize_1x128(q, scale), scale.t().repeat_interleave(128, 1)[:, :300])


@pytest.mark.parametrize("rows, cols", [(300, 256), (256, 384), (48, 136)])
def test_1x128_of_the_transpose_equals_quantising_the_transposed_copy(rows, cols):
    x = _x(rows, cols, seed=5)
    x[:, 7] = 0  # an all-zero output row
    q, scale = fp8.quantize_1x128_t(x)
    want_q, want_scale = fp8.quantize_1x128(x.t().contiguous())
    assert q.shape == (cols, rows) and scale.shape == ((rows + 127) // 128, cols)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_custom_ops_take_the_same_path_eager_and_through_the_dispatcher():
    # The eager shortcut (library.plain_eager) must give what the registered op gives.
    x = _x(64, 256, seed=6)
    for fn, args in [(fp8.quantize_1x128, (x,)), (fp8.quantize_1x128_t, (x,)), (fp8.quantize_128x128, (x, True))]:
        direct, dispatched = fn(*args), fn.op(*args)
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8 else a,
                               b.view(torch.uint8) if b.dtype == fp8.FP8 else b) for a, b in zip(direct, dispatched))
    assert library.plain_eager((x,)) and not library.plain_eager((torch.nn.Parameter(x).as_subclass(_Marker),))


class _Marker(torch.Tensor):
    pass


def test_grouped_1x128_layout_holds_the_same_scales_per_group():
    x = _x(50, 256, seed=1)
    offsets = torch.tensor([0, 12, 12, 40], dtype=torch.int32)  # empty groups, 10 rows past the end
    q, dense = fp8.quantize_1x128(x)
    qg, grouped = fp8.quantize_1x128(x, offsets)
    assert torch.equal(qg.view(torch.uint8), q.view(torch.uint8)) and grouped.shape == (100,)
    # Group [12, 40) is a [2, 28] M-major block right after the 12 rows of group 1.
    assert torch.equal(grouped[24:80].view(2, 28), dense[:, 12:40])
    assert torch.equal(grouped[80:].view(2, 10), dense[:, 40:])  # the rows past the end, last
    assert torch.equal(fp8.dequantize_1x128(qg, grouped, offsets), fp8.dequantize_1x128(q, dense))
    _, one = fp8.quantize_1x128(x, torch.tensor([50], dtype=torch.int32))
    assert torch.equal(one, dense.reshape(-1))  # one group: the dense layout


def test_128x128_transpose_is_the_quantised_transpose():
    w = _x(4 * 200, 264, seed=2).view(4, 200, 264)
    q, scale = fp8.quantize_128x128(w)
    assert q.shape == (4, 200, 264) and scale.shape == (4, 3, 2)  # K = 264 -> 3 blocks, N = 200 -> 2
    qt, scale_t = fp8.quantize_128x128(w, transpose=True)
    q2, scale2 = fp8.quantize_128x128(w.transpose(1, 2).contiguous())
    assert torch.equal(qt.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale_t, scale2)
    per_elem = scale.transpose(1, 2).repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200, :264]
    _assert_roundtrip(w, fp8.dequantize_128x128(q, scale), per_elem)
    q2d, s2d = fp8.quantize_128x128(w[1])
    assert torch.equal(q2d.view(torch.uint8), q[1].view(torch.uint8)) and torch.equal(s2d, scale[1])


def test_tensorwise_and_rowwise_scales():
    x = _x(20, 64, seed=3)
    q, scale = fp8.quantize_tensorwise(x)
    amax = x.float().abs().amax().reshape(1)
    assert scale.shape == (1,) and torch.equal(scale, amax / torch.full_like(amax, 448.0))
    _assert_roundtrip(x, q.float() * scale, scale.expand(20, 64))
    qr, sr = fp8.quantize_rowwise(x)
    assert sr.shape == (20, 1)
    _assert_roundtrip(x, qr.float() * sr, sr.expand(20, 64))


def test_gemm_fallbacks_match_float64_products_of_dequantised_operands():
    a, b = _x(70, 384, seed=4), _x(160, 384, seed=5)
    qa, sa = fp8.quantize_1x128(a)
    qb, sb = fp8.quantize_128x128(b)
    out = fp8.gemm_blockwise(qa, sa, qb, sb)
    ref = fp8.dequantize_1x128(qa, sa).double() @ fp8.dequantize_128x128(qb, sb).double().t()
    assert out.dtype == torch.bfloat16 and out.shape == (70, 160)
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())

    w = _x(3 * 384, 160, seed=6).view(3, 384, 160)  # experts [E, d, h]
    offsets = torch.tensor([20, 20, 64], dtype=torch.int32)  # an empty group, 6 rows past the end
    qa, sa = fp8.quantize_1x128(a, offsets)
    qw, sw = fp8.quantize_128x128(w, transpose=True)  # forward operand [E, h, d]
    out = fp8.grouped_mm_blockwise(qa, sa, qw, sw, offsets)
    ref = reference_mm(fp8.dequantize_1x128(qa, sa, offsets).double(),
                       fp8.dequantize_128x128(qw, sw).double().transpose(1, 2), offsets)
    assert out.shape == (70, 160) and out[64:].abs().sum() == 0
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())


def test_opcheck_fp8_ops():
    # Fake-tensor checks only: opcheck's schema test compares fp8 values, which CPU torch cannot.
    x = _x(16, 256, seed=7)
    offsets = torch.tensor([5, 16], dtype=torch.int32)
    for op, args in [
        (torch.ops.tessera.fp8_quantize_tensorwise.default, (x,)),
        (torch.ops.tessera.fp8_quantize_rowwise.default, (x,)),
        (torch.ops.tessera.fp8_quantize_1x128.default, (x, None)),
        (torch.ops.tessera.fp8_quantize_1x128.default, (x, offsets)),
        (torch.ops.tessera.fp8_quantize_128x128.default, (x, True)),
        (torch.ops.tessera.fp8_quantize_1x128_t.default, (x,)),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))
    qa, sa = fp8.quantize_1x128(x)
    qb, sb = fp8.quantize_128x128(_x(32, 256, seed=8))
    torch.library.opcheck(torch.ops.tessera.fp8_gemm_blockwise.default, (qa, sa, qb, sb),
                          test_utils=("test_faketensor",))


def test_bad_fp8_inputs_get_clear_errors():
    qa, sa = fp8.quantize_1x128(_x(16, 256))
    qb, sb = fp8.quantize_128x128(_x(32, 256))
    with pytest.raises(ValueError, match="do not match"):
        fp8.gemm_blockwise(qa, sa[:1], qb, sb)
    with pytest.raises(ValueError, match="e4m3"):
        fp8.gemm_blockwise(qa.float(), sa, qb, sb)
    with pytest.raises(ValueError, match="offsets must be int32"):
        fp8.quantize_1x128(_x(4, 128), torch.tensor([4]))


@built
def test_fp8_c_abi_rejects_bad_arguments():
    lib = library.KernelLibrary(library.DEFAULT_PATH)
    fake = ctypes.c_void_p(256)
    assert lib.config_names(fp8.FAMILY_FP8_GEMM) and lib.config_names(fp8.FAMILY_FP8_GG)
    rc = lib.fp8_gemm(0, fake, fake, fake, fake, fake, 64, 64, 24, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "multiples of 16" in lib.error_message()
    rc = lib.fp8_quantize_1x128(fake, fake, fake, 4, 12, None, 0, 0, None)
    assert rc == 1 and "cols=12" in lib.error_message()
    rc = lib.fp8_quantize_128x128(fake, fake, fake, 1, 24, 32, 1, 0, None)
    assert rc == 1 and "multiple of 16" in lib.error_message()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_blocks_of_tiny_values_quantise_to_zero_not_nan(device):
    # 448 / amax overflows for amax < ~1.3e-36 (bf16 reaches 9e-41): such blocks must come out as
    # zeros with scale 1, like all-zero blocks, never NaN (0 * inf). On CUDA: the kernels.
    x = _x(4, 256).to(device)
    x[1] = 1e-38  # a whole row (rowwise) and two whole 1x128 blocks
    x[1, 5] = 0.0  # 0 * (448 / 1e-38 = inf) would be NaN
    x[2, :128] = -3e-39
    for q, scale in (fp8.quantize_rowwise(x), fp8.quantize_1x128(x), fp8.quantize_128x128(x[:, :128].repeat(32, 1))):
        deq = q.float()
        assert not deq.isnan().any() and not scale.isnan().any() and not scale.isinf().any()
    q, scale = fp8.quantize_1x128(x)
    assert q[1].float().abs().max() == 0 and q[2, :128].float().abs().max() == 0
    assert scale[:, 1].tolist() == [1.0, 1.0] and scale[0, 2] == 1.0  # scales are [K/128, rows]
    assert q[0].float().abs().max() == 448  # ordinary rows are untouched


# ---------------------------------------------------------------------------------------
# The experts' K-grouped weight gradient (core/kernels/fp8_wgrad.py).
# ---------------------------------------------------------------------------------------

WGRAD_OFFSETS = [0, 130, 130, 300, 290, 420]  # empty first/middle groups, a decrease, 30 rows past the end


def test_group_blocks_put_each_group_on_fresh_128_token_blocks():
    rs, bs = kwgrad.group_blocks(torch.tensor(WGRAD_OFFSETS, dtype=torch.int32), 450)
    assert rs.tolist() == [0, 0, 130, 130, 300, 300, 420] and rs.dtype == torch.int32
    assert bs.tolist() == [0, 0, 2, 2, 4, 4, 5]  # 130 rows -> 2 blocks, 170 -> 2, 120 -> 1
    assert bs[-1] <= kwgrad.padded_blocks(450, 6)


@pytest.mark.parametrize("per_column", [True, False])
def test_grouped_transpose_quantises_each_group_on_its_own(per_column):
    x = _x(450, 256, seed=11)
    rs, bs = kwgrad.group_blocks(torch.tensor(WGRAD_OFFSETS, dtype=torch.int32), 450)
    blocks = kwgrad.padded_blocks(450, 6)
    q, scale = kwgrad.quantize_grouped_t(x, rs, bs, blocks, per_column)
    assert q.shape == (256, 128 * blocks) and scale.shape == (blocks, 256 if per_column else 2)
    for r0, r1, b0, b1 in [(0, 130, 0, 2), (130, 300, 2, 4), (300, 420, 4, 5)]:
        part = torch.nn.functional.pad(x[r0:r1], (0, 0, 0, 128 * (b1 - b0) - (r1 - r0)))  # zeros at the end
        if per_column:
            want_q, want_s = fp8.quantize_1x128_t(part)
        else:
            want_q, want_s = fp8.quantize_128x128(part, transpose=True)
        assert torch.equal(q[:, 128 * b0:128 * b1].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scale[b0:b1], want_s)


def test_grouped_wgrad_fallback_matches_float64_products_per_group():
    rows, d, h = 450, 256, 384
    x, dy = _x(rows, d, seed=12), _x(rows, h, seed=13)
    offsets = torch.tensor(WGRAD_OFFSETS, dtype=torch.int32)
    rs, bs = kwgrad.group_blocks(offsets, rows)
    blocks = kwgrad.padded_blocks(rows, 6)
    qd, sd = kwgrad.quantize_grouped_t(dy, rs, bs, blocks, True)
    qx, sx = kwgrad.quantize_grouped_t(x, rs, bs, blocks, False)
    out = kwgrad.grouped_wgrad_blockwise(qd, sd, qx, sx, bs)
    assert out.shape == (6, h, d) and out.dtype == torch.bfloat16
    for g in (0, 2, 4):
        assert out[g].abs().sum() == 0  # empty groups
    for g, (b0, b1) in [(1, (0, 2)), (3, (2, 4)), (5, (4, 5))]:
        cols = slice(128 * b0, 128 * b1)
        ref = fp8.dequantize_1x128(qd[:, cols], sd[b0:b1]).double() @ \
            fp8.dequantize_128x128(qx[:, cols], sx[b0:b1]).double().t()
        torch.testing.assert_close(out[g].double(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def test_grouped_wgrad_ops_fake_and_errors():
    x = _x(40, 128, seed=14)
    rs, bs = kwgrad.group_blocks(torch.tensor([10, 40], dtype=torch.int32), 40)
    torch.library.opcheck(torch.ops.tessera.fp8_quantize_grouped_t.default, (x, rs, bs, 3, True),
                          test_utils=("test_faketensor",))
    qa, sa = kwgrad.quantize_grouped_t(x, rs, bs, 3, True)
    qb, sb = kwgrad.quantize_grouped_t(x, rs, bs, 3, False)
    torch.library.opcheck(torch.ops.tessera.fp8_grouped_wgrad_blockwise.default, (qa, sa, qb, sb, bs),
                          test_utils=("test_faketensor",))
    with pytest.raises(ValueError, match="block_starts must be int32"):
        kwgrad.grouped_wgrad_blockwise(qa, sa, qb, sb, bs.long())
    with pytest.raises(ValueError, match="scales"):
        kwgrad.grouped_wgrad_blockwise(qa, sa[:1], qb, sb, bs)
    with pytest.raises(ValueError, match=r"row_starts \[3\] and block_starts \[2\] differ"):
        kwgrad.quantize_grouped_t(x, rs, bs[:2], 3, True)


@built
def test_grouped_wgrad_c_abi_rejects_bad_arguments():
    lib = library.KernelLibrary(library.DEFAULT_PATH)
    fake = ctypes.c_void_p(256)
    rc = lib.fp8_gg_wgrad(0, fake, fake, fake, fake, fake, fake, 2, 128, 128, 200, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "kp=200" in lib.error_message()
    rc = lib.fp8_gg_wgrad_f32(0, fake, fake, fake, fake, fake, fake, 2, 128, 128, 200, 1, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "kp=200" in lib.error_message()
    rc = lib.fp8_gg_wgrad_f32(0, fake, fake, fake, fake, fake, fake, 2, 128, 128, 256, 5, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "accumulate=5" in lib.error_message()
    rc = lib.fp8_quantize_grouped_t(fake, fake, fake, 64, 128, fake, fake, 2, 0, 1, 0, None)
    assert rc == 1 and "out_blocks=0" in lib.error_message()
