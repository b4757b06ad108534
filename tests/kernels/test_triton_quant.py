"""The per-token FP8 quantization kernel compiles for Hopper without a GPU and keeps the reference's rounding."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def test_quant_kernel_compiles_for_sm90_with_ieee_division_and_rne_cast():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from tandem.kernels.triton_quant import _quant_per_token_kernel

    src = ASTSource(
        fn=JITFunction(_quant_per_token_kernel.fn),  # compiled even where TRITON_INTERPRET=1 made it interpreted
        signature={"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "dim": "i32", "stride_x": "i64",
                   "FP8_MAX_C": "constexpr", "MIN_AMAX_C": "constexpr", "BLOCK_D": "constexpr"},
        constexprs={"FP8_MAX_C": 448.0, "MIN_AMAX_C": 1e-12, "BLOCK_D": 4096},
    )
    try:
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    except RuntimeError as exc:  # no ptxas / CUDA backend in this Triton build
        pytest.skip(f"cannot compile for sm90 here: {exc}")
    ops = {line.split()[0] for line in ptx.splitlines() if line.strip() and not line.lstrip().startswith("//")}
    # quantize_activation_per_token_ref divides in IEEE fp32 and casts round-to-nearest-even.
    assert "div.rn.f32" in ops and "div.full.f32" not in ops
    assert "cvt.rn.satfinite.e4m3x2.f32" in ops
