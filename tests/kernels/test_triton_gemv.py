"""The decode GEMV kernel (bf16/fp16 and FP8 weights, fused silu(gate) * up) against F.linear, and the Linear
layer's dispatch to it (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.ops import use_gemv
from tandem.kernels.triton_gemv import gemv_config, gemv_triton
from tandem.layers.activation import silu_and_mul
from tandem.layers.linear import Linear
from tandem.layers.quantization import dequantize_fp8, quantize_weight_fp8
from tests.kernels.sm90 import compile_sm90

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32  # the interpreter's bf16 arithmetic is not faithful
TOL = dict(atol=2e-2, rtol=2e-2) if CUDA else dict(atol=1e-4, rtol=1e-4)


def reference(x, w, scale, bias, gated):
    weight = dequantize_fp8(w, scale) if scale is not None else w.float()
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(64, 512), (48, 320)])  # 320: K not a multiple of the tile (masked)
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_gemv_matches_linear(m, n, k, fp8, gated):
    gen = torch.Generator().manual_seed(m * 100 + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE, DTYPE) if n == 48 else None  # a bias on one shape
    w, scale = quantize_weight_fp8(w) if fp8 else (w.to(DTYPE), None)
    ref = reference(x, w, scale, bias, gated)
    out = gemv_triton(x, w, scale, bias, gated=gated, config={"BLOCK_N": 16, "BLOCK_K": 128})
    assert out.shape == (m, n // 2 if gated else n) and out.dtype == DTYPE
    torch.testing.assert_close(out.float(), ref, **TOL)
    default = gemv_triton(x, w, scale, bias, gated=gated)  # gemv_config's tile (BLOCK_N 1 here: a narrow N)
    torch.testing.assert_close(default.float(), ref, **TOL)


def test_gemv_rejects_bad_shapes():
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemv_triton(x, torch.randn(32, 48))
    with pytest.raises(ValueError, match="even number"):
        gemv_triton(x, torch.randn(33, 64), gated=True)


def test_gemv_config_fills_the_gpu_and_bounds_registers():
    for m, n, k, wbytes, gated in [(1, 4096, 4096, 2, False), (1, 12288, 4096, 2, False), (1, 11008, 4096, 2, True),
                                   (1, 4096, 11008, 2, False), (4, 4096, 14336, 2, False), (1, 14336, 4096, 1, True),
                                   (3, 1024, 1024, 2, True), (1, 64, 96, 2, False)]:
        cfg = gemv_config(m, n, k, wbytes, gated, 132)
        assert cfg["BLOCK_K"] < 2 * k or cfg["BLOCK_K"] == 128  # no tile mostly past the end of K
        assert -(-n // cfg["BLOCK_N"]) >= 2 * 132 or cfg["BLOCK_N"] == 1
        per_thread = (2 if gated else 1) * cfg["BLOCK_N"] * cfg["BLOCK_K"] // (32 * cfg["num_warps"])
        assert per_thread <= (128 if wbytes == 2 else 64) // (2 if m > 1 else 1)  # the swept, spill-free bound


def test_linear_dispatch(monkeypatch):
    """Up to TANDEM_GEMV_MAX_ROWS rows (and only where Triton runs) Linear takes the GEMV; the result
    equals F.linear, and forward_silu_and_mul equals the projection followed by silu_and_mul."""
    torch.manual_seed(0)
    lin = Linear(256, 128, bias=True).to(DEVICE, DTYPE)
    torch.nn.init.normal_(lin.weight, std=0.05)
    torch.nn.init.normal_(lin.bias)
    calls = []
    import tandem.kernels.triton_gemv as gemv_module

    real = gemv_module.gemv_triton
    monkeypatch.setattr(gemv_module, "gemv_triton", lambda *a, **kw: calls.append(kw["gated"]) or real(*a, **kw))
    if not CUDA:
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    x1, x6 = torch.randn(1, 256).to(DEVICE, DTYPE), torch.randn(6, 256).to(DEVICE, DTYPE)
    assert use_gemv(x1, 256) and not use_gemv(x6, 256)
    assert use_gemv(x1, 256, fp8=True) and not use_gemv(torch.randn(2, 256).to(DEVICE, DTYPE), 256, fp8=True)
    torch.testing.assert_close(lin(x1).float(), F.linear(x1.float(), lin.weight.float(), lin.bias.float()), **TOL)
    torch.testing.assert_close(lin.forward_silu_and_mul(x1).float(), silu_and_mul(lin(x1).float()), **TOL)
    assert calls == [False, True, False]
    lin(x6)
    assert len(calls) == 3  # six rows: not the GEMV (the small-M tile GEMM, test_linear_skinny_dispatch)
    monkeypatch.setenv("TANDEM_GEMV_MAX_ROWS", "0")
    assert not use_gemv(x1, 256)
    monkeypatch.setenv("TANDEM_GEMV_MAX_ROWS", "8")
    assert use_gemv(x6, 256)
    monkeypatch.delenv("TANDEM_GEMV_MAX_ROWS")
    monkeypatch.delenv("TANDEM_FORCE_TRITON", raising=False)
    if not CUDA:
        assert not use_gemv(x1, 256)  # CPU without forced Triton: F.linear


def test_linear_skinny_dispatch(monkeypatch):
    """Above the GEMV's rows and up to TANDEM_SKINNY_MAX_ROWS (32 by default) a 16-bit Linear takes the small-M
    tile GEMM, equal to F.linear; more rows (or the override 0) take F.linear."""
    from tandem.kernels import ops
    import tandem.kernels.triton_quant as quant

    torch.manual_seed(1)
    lin = Linear(256, 96, bias=True).to(DEVICE, DTYPE)
    torch.nn.init.normal_(lin.weight, std=0.05)
    torch.nn.init.normal_(lin.bias)
    calls = []
    real = quant.skinny_matmul_triton
    monkeypatch.setattr(quant, "skinny_matmul_triton", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    if not CUDA:
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    for rows in (5, 17, 32, 33):
        x = torch.randn(rows, 256).to(DEVICE, DTYPE)
        torch.testing.assert_close(lin(x).float(), F.linear(x.float(), lin.weight.float(), lin.bias.float()), **TOL)
    assert calls == [5, 17, 32]
    x = torch.randn(9, 256).to(DEVICE, DTYPE)  # gate/up: silu(gate) * up from the same kernel
    torch.testing.assert_close(lin.forward_silu_and_mul(x).float(), silu_and_mul(lin(x).float()), **TOL)
    assert calls == [5, 17, 32, 9, 9]
    assert ops.use_skinny(torch.randn(2, 3, 256).to(DEVICE, DTYPE), 256)  # rows count across leading dims
    monkeypatch.setenv("TANDEM_SKINNY_MAX_ROWS", "0")
    assert not ops.use_skinny(torch.randn(8, 256).to(DEVICE, DTYPE), 256)
    monkeypatch.delenv("TANDEM_SKINNY_MAX_ROWS")
    monkeypatch.delenv("TANDEM_FORCE_TRITON", raising=False)
    if not CUDA:
        assert not ops.use_skinny(torch.randn(8, 256), 256)  # CPU without forced Triton: F.linear
    else:
        assert not ops.use_skinny(torch.randn(8, 256, device="cuda"), 256)  # fp32 on a GPU: cuBLAS, no TF32


_COMPILE_SM90 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_gemv import _gemv_kernel

names = ["x_ptr", "w_ptr", "s_ptr", "b_ptr", "out_ptr", "M", "N", "K", "stride_xm", "stride_wn", "stride_om",
         "up_offset", "ls_ptr", "lb_ptr", "lslot_ptr", "R", "stride_lsm", "stride_lbs", "stride_lbn",
         "HAS_SCALE", "HAS_BIAS", "GATED", "MASK_M", "MASK_N", "EVEN_K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "VEC",
         "USE_PDL", "LORA", "BLOCK_R"]
out = {}
for wty, gated, bk in (("*bf16", False, 512), ("*bf16", True, 512), ("*fp8e4nv", False, 1024), ("*fp8e4nv", True, 1024)):
    for pdl in (False, True):
        for lora in (False, True):
            types = (["*bf16", wty, "*fp32", "*bf16", "*bf16"] + ["i32"] * 7 + ["*fp32", "*bf16", "*i32"]
                     + ["i32"] * 4 + ["constexpr"] * 13)
            src = ASTSource(fn=_gemv_kernel, signature=dict(zip(names, types)),
                            constexprs={"HAS_SCALE": wty != "*bf16", "HAS_BIAS": False, "GATED": gated,
                                        "MASK_M": False, "MASK_N": False, "EVEN_K": True, "BLOCK_M": 1,
                                        "BLOCK_N": 4, "BLOCK_K": bk, "VEC": 8 if wty == "*bf16" else 16,
                                        "USE_PDL": pdl, "LORA": lora, "BLOCK_R": 64},
                            attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 8, 9, 10)})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
            # Instructions in program order (first word of each line), loads, stores and grid-dependency control.
            out[f"{wty}-{gated}-{lora}-{pdl}"] = [l.split()[0] for l in ptx.splitlines()
                                                  if l.strip().startswith(("ld.", "st.", "griddepcontrol"))]
json.dump(out, sys.stdout)
"""


def test_gemv_compiles_for_sm90_with_vector_loads():
    """Every variant compiles for Hopper without a GPU and streams the weight with 16-byte loads
    (ld.global.v4), keeping nothing in local memory. Under programmatic dependent launch the first weight
    tile is loaded before the wait for the previous kernel, then the next kernel is let launch; without it
    the kernel has no grid-dependency instructions. The LoRA epilogue (each row's slot, shrink and B) changes none
    of that: it reads only after the wait."""
    for variant, ops in compile_sm90(_COMPILE_SM90).items():
        assert any(op.startswith("ld.global.v4") for op in ops), (variant, ops)
        assert not any(op.startswith(("ld.local", "st.local")) for op in ops), (variant, ops)
        control = [op for op in ops if op.startswith("griddepcontrol")]
        if variant.endswith("-True"):
            assert control == ["griddepcontrol.wait;", "griddepcontrol.launch_dependents;"], (variant, control)
            wait = ops.index("griddepcontrol.wait;")
            assert any(op.startswith("ld.global.v4") for op in ops[:wait]), (variant, ops)
            assert not any(op.startswith("st.") for op in ops[:wait]), (variant, ops)
        else:
            assert control == [], (variant, control)


# ----------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k,gated", [(12288, 4096, False), (22016, 4096, True), (4096, 11008, False),
                                       (4096, 14336, False), (28672, 4096, True)])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_gemv_real_shapes(n, k, gated, fp8):
    """Llama projection shapes at 1-4 rows with gemv_config's tiles: relative error of a bf16 kernel against
    fp32 math, and the same result replayed from a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(4, k, generator=gen, device="cuda").bfloat16()
    w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    w, scale = quantize_weight_fp8(w) if fp8 else (w.bfloat16(), None)
    for m in (1, 2, 3, 4):
        ref = reference(x[:m], w, scale, None, gated)
        out = gemv_triton(x[:m], w, scale, None, gated=gated)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (m, rel)
    static = x[:1].clone()
    graph = torch.cuda.CUDAGraph()
    eager = gemv_triton(static, w, scale, None, gated=gated)
    with torch.cuda.graph(graph):
        captured = gemv_triton(static, w, scale, None, gated=gated)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
