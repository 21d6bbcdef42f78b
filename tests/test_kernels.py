"""core.kernels: custom ops, fallbacks, autograd, and the compiled library's C ABI.

Reference: a float64 gather formulation (each row times the weight of its group, found with
searchsorted), independent of the per-group loop the fallback uses. On CPU the ops run the
loop fallback; the CUTLASS path is checked on a GPU by tests/gpu_kernels_check.py (the `gpu`
test below runs it when a Hopper GPU and the built library are present).
"""

from __future__ import annotations

import ctypes
import logging
import re
import subprocess

import pytest
import torch

from core.kernels import grouped_mm, grouped_mm_wgrad, library
from tests.gpu_kernels_check import group_ids, reference_mm, reference_wgrad, uneven_offsets

LIB_PATH = library.DEFAULT_PATH
built = pytest.mark.skipif(not LIB_PATH.is_file(), reason="csrc/build/libtessera_kernels.so not built")


def _operands(rows, k, n, groups, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen, dtype=dtype)
    w = torch.randn(groups, k, n, generator=gen, dtype=dtype)
    return x, w


def test_group_ids_reads_offsets_like_the_loop():
    # A decreasing offset is an empty group; offsets past N are clamped; rows past the end: -1.
    ids = group_ids(torch.tensor([2, 1, 4, 9], dtype=torch.int32), rows=6)
    assert ids.tolist() == [0, 0, 2, 2, 3, 3]
    ids = group_ids(torch.tensor([0, 3], dtype=torch.int32), rows=5)
    assert ids.tolist() == [1, 1, 1, -1, -1]


@pytest.mark.parametrize("groups,rows", [(1, 7), (5, 40), (8, 3)])
def test_fallback_matches_float64_reference(groups, rows):
    x, w = _operands(rows, 16, 24, groups)
    offsets = uneven_offsets(rows, groups, torch.Generator().manual_seed(groups), empty=min(2, groups - 1))
    out = grouped_mm(x, w, offsets)
    ref = reference_mm(x.double(), w.double(), offsets)
    assert out.dtype == torch.float32 and out.shape == (rows, 24)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_rows_past_the_last_offset_are_zero():
    x, w = _operands(10, 8, 8, 3)
    out = grouped_mm(x, w, torch.tensor([2, 2, 6], dtype=torch.int32))
    assert out[6:].abs().sum() == 0 and out[:6].abs().sum() > 0


def test_transposed_weight_view_gives_the_same_product():
    x, w = _operands(12, 16, 8, 3)
    offsets = torch.tensor([4, 4, 12], dtype=torch.int32)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [G, M, K] storage
    torch.testing.assert_close(grouped_mm(x, wt, offsets), grouped_mm(x, w, offsets))


def test_wgrad_matches_reference_and_zeroes_empty_groups():
    x, dy = _operands(30, 16, 8, 1)[0], torch.randn(30, 24, dtype=torch.float32)
    offsets = torch.tensor([0, 10, 10, 25, 30], dtype=torch.int32)
    dw = grouped_mm_wgrad(x, dy, offsets)
    assert dw.shape == (5, 16, 24)
    torch.testing.assert_close(dw.double(), reference_wgrad(x.double(), dy.double(), offsets), rtol=1e-5, atol=1e-5)
    assert dw[0].abs().sum() == 0 and dw[2].abs().sum() == 0


def test_wgrad_into_fp32_overwrites_or_adds_and_keeps_empty_groups_right():
    # The fused-accumulation op: overwrite (the step's first micro-batch) zeroes empty groups,
    # add leaves them as they were; the CUTLASS path is checked the same way on the GPU.
    from core.kernels.grouped_gemm import grouped_mm_wgrad_into_

    x, dy = _operands(30, 16, 8, 1)[0], torch.randn(30, 24, dtype=torch.float32)
    offsets = torch.tensor([0, 10, 10, 25, 30], dtype=torch.int32)
    want = reference_wgrad(x.double(), dy.double(), offsets)
    out = torch.full((5, 16, 24), float("nan"))
    grouped_mm_wgrad_into_(out, x, dy, offsets, False)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert out[0].abs().sum() == 0 and out[2].abs().sum() == 0
    before = torch.randn(5, 16, 24)
    out = before.clone()
    grouped_mm_wgrad_into_(out, x, dy, offsets, True)
    torch.testing.assert_close(out.double(), before.double() + want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], before[0], rtol=0, atol=0)
    torch.library.opcheck(torch.ops.tessera.grouped_mm_wgrad_into_.default, (out, x, dy, offsets, True))
    for bad, match in [(out.double(), "fp32 out"), (out[:, :8], r"fp32 out \[5, 16, 24\]"),
                       (out.transpose(1, 2).contiguous().transpose(1, 2), "contiguous")]:
        with pytest.raises(ValueError, match=match):
            grouped_mm_wgrad_into_(bad, x, dy, offsets, True)


def test_autograd_matches_reference_gradients():
    x, w = _operands(33, 16, 24, 4, dtype=torch.float64, seed=3)
    offsets = torch.tensor([5, 5, 20, 30], dtype=torch.int32)  # an empty group, 3 rows past the end
    dy = torch.randn(33, 24, dtype=torch.float64)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    grouped_mm(xa, wa, offsets).backward(dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    reference_mm(xr, wr, offsets).backward(dy)
    torch.testing.assert_close(xa.grad, xr.grad)
    torch.testing.assert_close(wa.grad, wr.grad)
    assert wa.grad[1].abs().sum() == 0  # the empty group's weight gets an exact zero gradient


def test_eager_calls_run_the_registered_autograd_without_the_op_dispatcher():
    # In eager mode with gradients the op's registered autograd runs as an autograd.Function;
    # the custom op itself (what compiled graphs call) must give the same values and gradients.
    x, w = _operands(33, 16, 24, 4, dtype=torch.float64, seed=4)
    offsets = torch.tensor([5, 5, 20, 30], dtype=torch.int32)
    dy = torch.randn(33, 24, dtype=torch.float64)
    grads = []
    for call in (grouped_mm, grouped_mm.op):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = call(xa, wa, offsets)
        grads.append((out, type(out.grad_fn).__name__))
        out.backward(dy)
        grads[-1] += (xa.grad, wa.grad)
    (eager, eager_node, *eager_grads), (op, op_node, *op_grads) = grads
    assert eager_node.startswith("Eager_grouped_mm") and not op_node.startswith("Eager_")
    torch.testing.assert_close(eager, op, rtol=0, atol=0)
    for got, want in zip(eager_grads, op_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():  # nothing to record: the body runs directly
        assert grouped_mm(x.requires_grad_(), w, offsets).grad_fn is None


def test_gradcheck_in_double():
    x, w = _operands(9, 4, 3, 3, dtype=torch.float64, seed=5)
    offsets = torch.tensor([2, 2, 9], dtype=torch.int32)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offsets), (x, w))


def test_opcheck_fake_and_autograd_registration():
    # opcheck compares the fake (meta) implementation's shapes/strides with the real one and
    # checks the schema and autograd registration, on the CPU fallback.
    x, w = _operands(12, 8, 16, 3)
    offsets = torch.tensor([3, 3, 10], dtype=torch.int32)
    torch.library.opcheck(torch.ops.tessera.grouped_mm.default, (x, w, offsets))
    torch.library.opcheck(torch.ops.tessera.grouped_mm_wgrad.default, (x, torch.randn(12, 16), offsets))


def test_meta_tensors_give_shapes_without_data():
    x = torch.empty(100, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(4, 64, 32, device="meta", dtype=torch.bfloat16)
    offsets = torch.empty(4, device="meta", dtype=torch.int32)
    assert grouped_mm(x, w, offsets).shape == (100, 32)
    assert grouped_mm_wgrad(x, torch.empty(100, 48, device="meta", dtype=torch.bfloat16), offsets).shape == (4, 64, 48)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, o: (x, w, o.long()), "int32"),
    (lambda x, w, o: (x, w, o[:2]), r"int32 \[G=3\]"),
    (lambda x, w, o: (x[:, :4], w, o), r"x \[N, K\] and w \[G, K, M\]"),
    (lambda x, w, o: (x, w.double(), o), "share dtype"),
])
def test_bad_inputs_get_clear_errors(bad, match):
    x, w = _operands(6, 8, 8, 3)
    offsets = torch.tensor([1, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        grouped_mm(*bad(x, w, offsets))


def test_missing_library_is_reported_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(library.ENV_VAR, str(tmp_path / "nope.so"))
    library.reset_for_tests()
    try:
        with caplog.at_level(logging.WARNING, logger="core.kernels.library"):
            assert library.load_library() is None
            assert library.load_library() is None
        messages = [r.getMessage() for r in caplog.records if "nope.so" in r.getMessage()]
        assert len(messages) == 1 and "bash csrc/build.sh" in messages[0]
    finally:
        library.reset_for_tests()


@pytest.mark.slow
@built
def test_built_library_loads_without_gpu_or_torch_dependencies():
    lib = library.KernelLibrary(LIB_PATH)
    assert lib.abi_version() == library.ABI_VERSION
    names = lib.gg_bf16_config_names()
    assert names and all(n is None or ("x" in n and "_c" in n) for n in names)
    needed = subprocess.run(["readelf", "-d", str(LIB_PATH)], capture_output=True, text=True, check=True).stdout
    libs = [line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line]
    # cudart is static: only system libraries remain (no torch, no CUDA toolkit library).
    system = ("libc.", "libm.", "libdl.", "libpthread.", "librt.", "ld-linux", "libstdc++.", "libgcc_s.")
    assert all(name.startswith(system) for name in libs), libs
    versions = subprocess.run(["objdump", "-T", str(LIB_PATH)], capture_output=True, text=True, check=True).stdout
    glibc = {tuple(int(p) for p in v.split(".")) for v in re.findall(r"GLIBC_([0-9.]+)\)", versions)}
    assert max(glibc) <= (2, 34), f"needs glibc {max(glibc)}: the GPU machines may have older"


@built
def test_c_abi_rejects_bad_arguments_with_a_message():
    lib = library.KernelLibrary(LIB_PATH)
    fake = ctypes.c_void_p(256)  # never dereferenced: argument checks come first
    rc = lib.gg_bf16(0, 0, fake, fake, fake, fake, 4, 64, 7, 16, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "multiples of 8" in lib.error_message()
    rc = lib.gg_bf16(9, 0, fake, fake, fake, fake, 4, 64, 8, 16, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "op 9" in lib.error_message()
    rc = lib.gg_bf16(0, 0, fake, fake, fake, fake, 4, 64, 8, 16, fake, 1 << 20, 0, None, 0, 3)
    assert rc == 1 and "swizzle=3" in lib.error_message()
    rc = lib.gg_bf16(3, 0, fake, fake, fake, fake, 4, 64, 8, 16, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "op 3" in lib.error_message()  # wgrad_f32 has its own entry point
    rc = lib.gg_bf16(5, 0, fake, fake, fake, fake, 4, 64, 8, 16, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "op 5" in lib.error_message()
    rc = lib.gg_bf16_wgrad_f32(0, fake, fake, fake, fake, 4, 64, 8, 16, 2, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "accumulate=2" in lib.error_message()
    rc = lib.gg_bf16_wgrad_f32(0, fake, fake, fake, fake, 4, 64, 8, 12, 1, fake, 1 << 20, 0, None, 0, 1)
    assert rc == 1 and "multiples of 8" in lib.error_message()
    if not torch.cuda.is_available():
        assert lib.device_capability(0) == -1 and "no CUDA device" in lib.error_message()
        with pytest.raises(library.KernelError, match="SM count"):
            lib.gg_bf16_workspace_bytes(0, 0, 4, 0)


@built
def test_default_configs_are_the_measured_best_and_the_env_var_forces_one(monkeypatch):
    # No GPU needed: the choice reads only the built configurations' names.
    from core.kernels import fp8
    from core.kernels.grouped_gemm import (CONFIG_ENV, DEFAULT_CONFIG, OP_FWD, OP_FWD_BT, OP_FWD_BT_T, OP_WGRAD,
                                           OP_WGRAD_F32, SMALL_GROUP_CONFIG, N_CLUSTER_CONFIG, choose_config)

    lib = library.KernelLibrary(LIB_PATH)
    names = lib.gg_bf16_config_names()
    built_gg = [i for i, n in enumerate(names) if n is not None]
    expected = names.index(DEFAULT_CONFIG) if DEFAULT_CONFIG in names else built_gg[0]
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    # The three MoE shapes' passes, including the fine-grained ones the old heuristic sent to ping-pong.
    for op, rows, groups, k, n in [(OP_FWD, 32768, 8, 4096, 14336), (OP_FWD, 131072, 64, 2048, 1408)]:
        assert choose_config(lib, op, rows, groups, k, n) == expected
    # Every dgrad takes the 1x2-cluster tile when built; weight gradients take the default unless
    # only their M tile count is odd (1408 inputs: 11 tiles of 128; 2816 outputs: 11 of 256).
    dgrad = names.index(N_CLUSTER_CONFIG) if N_CLUSTER_CONFIG in names else None
    for op, rows, groups, k, n in [(OP_WGRAD, 32768, 8, 4096, 14336), (OP_WGRAD, 131072, 64, 2048, 1408),
                                   (OP_WGRAD, 65536, 128, 7168, 2048), (OP_WGRAD, 65536, 64, 2048, 2816),
                                   (OP_WGRAD, 65536, 64, 1408, 2816)]:
        assert choose_config(lib, op, rows, groups, k, n) == expected
    assert choose_config(lib, OP_WGRAD, 65536, 64, 1408, 2048) == (expected if dgrad is None else dgrad)
    # The fp32 (fused-accumulation) weight gradient follows the same rule.
    assert choose_config(lib, OP_WGRAD_F32, 65536, 64, 1408, 2048) == (expected if dgrad is None else dgrad)
    assert choose_config(lib, OP_WGRAD_F32, 65536, 64, 2048, 1408) == expected
    assert choose_config(lib, OP_FWD_BT, 131072, 64, 1408, 2048) == (expected if dgrad is None else dgrad)
    # The forward of 512-row groups (the E=128 shape) takes the unclustered tile when built; so does
    # their dgrad where the 1x2 tile is not built.
    small = names.index(SMALL_GROUP_CONFIG) if SMALL_GROUP_CONFIG in names else expected
    assert choose_config(lib, OP_FWD, 65536, 128, 7168, 2048) == small
    assert choose_config(lib, OP_FWD_BT, 65536, 128, 2048, 7168) == (small if dgrad is None else dgrad)
    # The dgrad computed as its transpose: no cluster (it would pad n's or the rows' tiles).
    assert choose_config(lib, OP_FWD_BT_T, 131072, 64, 2048, 1408) == small
    monkeypatch.setenv(CONFIG_ENV, str(built_gg[-1]))
    assert choose_config(lib, OP_FWD, 4096, 8, 512, 512) == built_gg[-1]
    monkeypatch.setenv(CONFIG_ENV, str(len(names)))
    with pytest.raises(ValueError, match=f"{CONFIG_ENV}={len(names)} is not built"):
        choose_config(lib, OP_FWD, 4096, 8, 512, 512)

    monkeypatch.delenv(fp8.FP8_CONFIG_ENV, raising=False)
    for family in (fp8.FAMILY_FP8_GEMM, fp8.FAMILY_FP8_GG):
        fp8_names = lib.config_names(family)
        built_fp8 = [i for i, n in enumerate(fp8_names) if n is not None]
        for rows_per_group in (512.0, 2048.0, 16384.0):  # coop measured best at all of these
            assert fp8._choose_fp8_config(lib, family, rows_per_group) == built_fp8[0]
        if built_fp8[0] == 0:
            assert fp8_names[0].startswith("coop_128x128x128")
        with fp8.forced_config(built_fp8[-1]):
            assert fp8._choose_fp8_config(lib, family, 512.0) == built_fp8[-1]


def test_fp8_grouped_prefers_the_2x1_cluster_for_an_odd_count_of_n_tiles():
    # No library needed: the preference is a pure function of the output width.
    from core.kernels import fp8

    for entry in ("fp8_gg", "fp8_gg_wgrad"):
        for n in (2048, 4096, 7168, 14336, 256):  # 16, 32, 56, 112, 2 tiles of 128
            assert fp8._fp8_gg_preferred(entry, n) == fp8.GG_PREFERRED_CONFIG[entry]
        for n in (1408, 128, 1280 + 16):  # 11, 1, 11 (the last one partial) tiles
            assert fp8._fp8_gg_preferred(entry, n) == fp8.GG_ODD_N_TILES_CONFIG


def test_dgrad_is_computed_transposed_only_where_that_pads_less():
    # No library needed: the choice is arithmetic on the shapes.
    from core.kernels.grouped_gemm import transposed_pads_less

    assert transposed_pads_less(131072, 64, 1408)  # 2048-row groups, 1408 = 5.5 x 256 = 11 x 128
    assert not transposed_pads_less(65536, 128, 1408)  # 512-row groups: the rows' 256 tiles pad more
    for n in (2048, 4096, 7168, 14336):  # whole 256-wide tiles: nothing to gain
        assert not transposed_pads_less(131072, 64, n)
    assert not transposed_pads_less(0, 64, 1408)  # no rows: no division by zero, the usual op


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_check():
    from tests import gpu_kernels_check

    assert gpu_kernels_check.main(["--quick"]) == 0
