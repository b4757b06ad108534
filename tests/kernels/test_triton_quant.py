"""The per-token FP8 quantization kernel compiles for Hopper without a GPU and keeps the reference's rounding."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90 import compile_sm90  # noqa: E402

_COMPILE_SM90 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_quant import _fp8_weight_matmul_kernel, _quant_per_token_kernel, _split_k_reduce_kernel

target = GPUTarget("cuda", 90, 32)
quant = ASTSource(
    fn=_quant_per_token_kernel,
    signature={"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "dim": "i32", "stride_x": "i64",
               "FP8_MAX_C": "constexpr", "MIN_AMAX_C": "constexpr", "BLOCK_D": "constexpr"},
    constexprs={"FP8_MAX_C": 448.0, "MIN_AMAX_C": 1e-12, "BLOCK_D": 4096})
names = ["x_ptr", "w_ptr", "s_ptr", "b_ptr", "out_ptr", "ws_ptr", "M", "N", "K", "K_SPLIT", "stride_xm",
         "stride_wn", "stride_om", "HAS_BIAS", "EVEN_K", "SPLIT_K", "BLOCK_M", "BLOCK_N", "BLOCK_K"]
types = ["*bf16", "*fp8e4nv", "*fp32", "*bf16", "*bf16", "*fp32"] + ["i32"] * 7 + ["constexpr"] * 6
matmul = ASTSource(fn=_fp8_weight_matmul_kernel, signature=dict(zip(names, types)),
                   constexprs={"HAS_BIAS": True, "EVEN_K": False, "SPLIT_K": 4, "BLOCK_M": 16, "BLOCK_N": 32,
                               "BLOCK_K": 256})
reduce = ASTSource(
    fn=_split_k_reduce_kernel,
    signature={"ws_ptr": "*fp32", "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
               "stride_om": "i32", "HAS_BIAS": "constexpr", "SPLIT_K": "constexpr", "BLOCK": "constexpr",
               "USE_PDL": "constexpr", "HAS_SCALE": "constexpr"},
    constexprs={"HAS_BIAS": True, "SPLIT_K": 4, "BLOCK": 1024, "USE_PDL": True, "HAS_SCALE": True})
out = {}
for name, src in (("quant", quant), ("matmul", matmul), ("reduce", reduce)):
    ptx = triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    out[name] = sorted({l.split()[0] for l in ptx.splitlines() if l.strip() and not l.lstrip().startswith("//")})
json.dump(out, sys.stdout)
"""


def test_kernels_compile_for_sm90():
    """The kernels compile for Hopper without a GPU (in a fresh process: TRITON_INTERPRET=1 in this one
    turns triton.language's own helpers into interpreted functions); the quantizer keeps the reference's
    rounding: IEEE division and a round-to-nearest-even e4m3 conversion."""
    ops = compile_sm90(_COMPILE_SM90)
    assert "div.rn.f32" in ops["quant"] and "div.full.f32" not in ops["quant"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ops["quant"]
    assert any(op.startswith(("mma.", "wgmma.")) for op in ops["matmul"])  # tensor cores
    assert "griddepcontrol.wait;" in ops["reduce"]  # launched with PDL: waits for the GEMM's partial sums


@pytest.mark.parametrize("w8a8", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("m,n,k,bias,split_k", [
    (1, 96, 512, True, 1), (5, 64, 256, False, 1), (17, 48, 160, True, 1),  # 160: a masked K tile
    (1, 96, 1024, True, 4),  # four whole splits
    (3, 40, 640, False, 2),  # 640 = 2.5 tiles of 256: the last split is short and masked
    (2, 64, 384, True, 8),  # more splits asked than K tiles: fewer splits run
    (40, 64, 384, False, 8),
])
def test_small_m_fp8_matmuls_match_reference(m, n, k, bias, split_k, w8a8):
    """The small-M FP8 GEMMs (fp32 rows on the CPU interpreter, bf16 on a GPU) against fp8_linear_reference
    on the same operands, fp32 accumulation, with split-K too, bitwise reproducible run to run: the
    FP8-weight GEMM widens the weight (x not quantized), the W8A8 swap-AB GEMM quantizes x per token."""
    import torch

    from tandem.kernels.triton_quant import fp8_w8a8_matmul_triton, fp8_weight_matmul_triton
    from tandem.layers.quantization import fp8_linear_reference, quantize_weight_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    q, scale = quantize_weight_fp8((torch.randn(n, k, generator=gen) * 0.05).to(device))
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    fn = fp8_w8a8_matmul_triton if w8a8 else fp8_weight_matmul_triton
    tile = {"BLOCK_N": 64 if w8a8 else 32, "BLOCK_K": 256 if k % 256 == 0 else 128, "SPLIT_K": split_k}
    if split_k > 1:
        tile["BLOCK_K"] = 256 if k >= 512 else 128
    out = fn(x, q, scale, b, tile)
    assert torch.equal(out, fn(x, q, scale, b, tile))  # fixed summation order
    given = torch.full_like(out, float("nan"))
    assert fn(x, q, scale, b, tile, out=given) is given and torch.equal(given, out)  # written in place
    ref = fp8_linear_reference(x, q, scale, b, quantize_activations=w8a8)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("group", [128, 256, 512])
@pytest.mark.parametrize("m,n,k,bias,split_k", [(5, 64, 1024, True, 1), (32, 96, 2048, False, 2), (3, 40, 1536, False, 1)])
def test_w8a8_on_rows_quantized_in_groups(m, n, k, bias, split_k, group):
    """The swap-AB GEMM on rows quantized in groups of columns (the decode attention's output for o_proj:
    QuantizedRows with [m, k / group] scales) against fp8_linear_reference on the dequantized rows, K tiles
    shrunk to fit a group where the default is wider, with split-K; and the same through fp8_linear."""
    import torch

    from tandem.kernels.fp8 import QuantizedRows, quantize_activation_groups_ref
    from tandem.kernels.triton_quant import fp8_w8a8_matmul_quantized
    from tandem.layers.quantization import fp8_linear, fp8_linear_reference, quantize_weight_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(m + group)
    x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 4.0, k // group).repeat_interleave(group)
    rows = QuantizedRows(*quantize_activation_groups_ref(x.to(device, dtype), group), dtype)
    assert rows.group_size == group and rows.scale.shape == (m, k // group)
    w, w_scale = quantize_weight_fp8((torch.randn(n, k, generator=gen) * 0.05).to(device))
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    ref = fp8_linear_reference(rows.dequantize(), w, w_scale, b, quantize_activations=False).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    out = fp8_w8a8_matmul_quantized(rows.q, rows.scale, w, w_scale, b, dtype, {"SPLIT_K": split_k})
    assert out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(fp8_linear(rows, w, w_scale, b).float(), ref.float(), **tol)
    per_token = QuantizedRows(*quantize_activation_groups_ref(x.to(device, dtype), k), dtype)
    assert per_token.scale.shape == (m, 1) and torch.equal(per_token.dequantize(), per_token.q.float() * per_token.scale)


@pytest.mark.parametrize("m,n,k,bias,split_k", [
    (1, 96, 512, True, 1), (7, 64, 256, False, 1), (32, 80, 200, True, 1),  # 200: a masked K tile
    (17, 128, 1024, False, 4), (3, 40, 640, True, 2), (40, 64, 384, False, 8),
])
def test_skinny_matmul_matches_linear(m, n, k, bias, split_k):
    """The swap-AB GEMM with weights in the model dtype (no scales) against F.linear in fp32, with split-K
    and masked tiles, bitwise reproducible run to run; and its default tile from the shape."""
    import torch
    import torch.nn.functional as F

    from tandem.kernels.triton_quant import skinny_matmul_triton, skinny_tile

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    tile = {"BLOCK_N": 64, "BLOCK_K": 128 if k >= 256 else 64, "SPLIT_K": split_k}
    out = skinny_matmul_triton(x, w, b, tile)
    assert torch.equal(out, skinny_matmul_triton(x, w, b, tile))
    ref = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **tol)
    torch.testing.assert_close(skinny_matmul_triton(x, w, b).float(), ref, **tol)  # default tile
    if n % 2 == 0:  # gated: silu(gate) * up of the two halves, K whole whatever the tile asks
        gated = skinny_matmul_triton(x, w, b, tile, gated=True)
        half = ref.to(dtype).float()
        want = (F.silu(half[:, : n // 2]).to(dtype).float() * half[:, n // 2 :]).to(dtype)
        assert gated.shape == (m, n // 2)
        torch.testing.assert_close(gated.float(), want.float(), **tol)
    assert skinny_tile(32, 4096, 4096, 132)["SPLIT_K"] == 4  # 64 N tiles -> ~2 programs per SM
    assert skinny_tile(32, 28672, 4096, 132)["SPLIT_K"] == 1


_COMPILE_W8A8 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_quant import _swap_ab_kernel

names = _swap_ab_kernel.arg_names
types = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16",
         "out_ptr": "*bf16", "ws_ptr": "*fp32", "oa_ptr": "*fp32"}
out = {}
for name, gated, group_k in (("plain", 0, 0), ("gated", 2, 0), ("grouped", 0, 512)):
    cx = {"HAS_BIAS": False, "EVEN_K": True, "SPLIT_K": 1, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 256,
          "USE_PDL": 2, "HAS_SCALE": True, "X_SCALED": True, "GATED": gated, "PREFETCH_LINES": 4, "LINE_K": 128,
          "AMAX_OUT": gated == 2, "GROUP_K": group_k, "LORA": False, "BLOCK_R": 16, "SLOTS_P2": 2}
    src = ASTSource(fn=_swap_ab_kernel, signature={n: types.get(n, "constexpr" if n in cx else "i32") for n in names},
                    constexprs=cx, attrs={(names.index(a),): [["tt.divisibility", 16]]
                                          for a in ("xq_ptr", "w_ptr", "K", "K_SPLIT", "stride_xm", "stride_wn")})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 6}).asm["ptx"]
    order = [w for l in ptx.splitlines() for w in l.replace("{", " ").replace(";", "; ").split()
             if w.startswith(("prefetch", "griddepcontrol", "cp.async"))]
    # An instruction's first word (past a guard predicate such as `@%p3`: guarded atomics count too).
    lines = [l.split(None, 1)[1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines() if l.strip()]
    out[name] = {"ops": sorted({l.split()[0] for l in lines
                                if l.startswith(("wgmma", "mma", "cp.async", "atom", "red"))}),
                 "order": order}
json.dump(out, sys.stdout)
"""


def test_w8a8_uses_fp8_wgmma_on_sm90():
    """Compiled for Hopper (no GPU needed), the W8A8 GEMM feeds e4m3 x e4m3 to wgmma (the 32 token rows as
    the MMA's N) from pipelined async copies: no widening of either operand. Under PDL it lets the next
    kernel launch, then prefetches its first weight lines into L2, and only then waits for the previous
    kernel: every operand load comes after the wait."""
    compiled = compile_sm90(_COMPILE_W8A8)
    # gated: gate/up pairs, silu * up and the row maxima in the epilogue; grouped: x scaled per K tile's group
    for variant in ("plain", "gated", "grouped"):
        ops, order = compiled[variant]["ops"], compiled[variant]["order"]
        assert "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3" in ops, ops
        assert any(op.startswith("cp.async") for op in ops), ops
        assert not any(op.startswith(("atom", "red")) for op in ops), ops  # row maxima: plain stores
        wait = order.index("griddepcontrol.wait;")
        assert order.index("griddepcontrol.launch_dependents;") < wait
        assert "prefetch.global.L2" in order[:wait]
        assert not any(op.startswith("cp.async") for op in order[:wait]), order[:wait + 1]


@pytest.mark.parametrize("rows,dim,residual", [(3, 300, False), (17, 1024, True), (2, 4096, True)])
def test_rms_norm_fp8_out_equals_norm_then_quantize(rows, dim, residual):
    """RMSNorm writing its output quantized per token (for FP8 linears) gives bit for bit what the norm
    followed by the quantization kernel gives: the same e4m3 bytes, scales and new residual."""
    import torch

    from tandem.kernels.fp8 import FP8_DTYPE, QuantizedRows
    from tandem.kernels.triton_fused import fused_add_rms_norm_triton, rms_norm_triton
    from tandem.kernels.triton_quant import quantize_per_token_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(device, dtype)
    x[0, :7] = 0.0
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device, dtype)
    if residual:
        r = torch.randn(rows, dim, generator=gen).to(device, dtype)
        fused, new_res = fused_add_rms_norm_triton(x, r, w, 1e-6, fp8_out=True)
        plain, plain_res = fused_add_rms_norm_triton(x, r, w, 1e-6)
        assert torch.equal(new_res, plain_res)
    else:
        fused, plain = rms_norm_triton(x, w, 1e-6, fp8_out=True), rms_norm_triton(x, w, 1e-6)
    assert isinstance(fused, QuantizedRows) and fused.dtype == dtype and fused.shape == (rows, dim)
    assert fused.q.dtype == FP8_DTYPE and fused.scale.shape == (rows, 1)
    q, scale = quantize_per_token_triton(plain)
    assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fused.scale, scale)


@pytest.mark.parametrize("rows,inter", [(1, 256), (5, 1000), (32, 2048)])
def test_silu_and_mul_quantized_equals_unfused(rows, inter):
    """The quantization kernel's SiLU-and-mul prologue gives bit for bit silu_and_mul then quantization."""
    import torch

    from tandem.kernels.triton_fused import silu_and_mul_triton
    from tandem.kernels.triton_quant import quantize_per_token_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(rows + inter)
    y = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(device, dtype)
    q, scale = quantize_per_token_triton(y, silu_and_mul=True)
    q_ref, scale_ref = quantize_per_token_triton(silu_and_mul_triton(y))
    assert q.shape == (rows, inter)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    with pytest.raises(ValueError, match="even"):
        quantize_per_token_triton(y[:, 1:], silu_and_mul=True)


@pytest.mark.parametrize("rows,inter,k", [(1, 64, 256), (5, 96, 320), (32, 160, 256), (40, 48, 512)])
def test_w8a8_gated_equals_gemm_then_silu_and_mul_quantizer(rows, inter, k):
    """The gate/up W8A8 GEMM with silu(gate) * up in its epilogue (each program: gate rows and their up rows;
    masked K and channel tiles here) gives the plain W8A8 GEMM followed by SiLU-and-mul, and, quantizing from
    the row maxima its programs write, bit for bit the e4m3 bytes and scales of the SiLU-and-mul quantizer."""
    import torch
    import torch.nn.functional as F

    from tandem.kernels.triton_quant import (
        fp8_w8a8_gated,
        fp8_w8a8_matmul_quantized,
        quantize_from_parts,
        quantize_per_token_triton,
    )
    from tandem.layers.quantization import quantize_weight_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(rows + inter)
    xq, xs = quantize_per_token_triton(torch.randn(rows, k, generator=gen).to(device, dtype))
    w, ws = quantize_weight_fp8((torch.randn(2 * inter, k, generator=gen) * 0.1).to(device))
    full = fp8_w8a8_matmul_quantized(xq, xs, w, ws, None, dtype, {"SPLIT_K": 1})
    gated = fp8_w8a8_gated(xq, xs, w, ws, dtype)
    want = (F.silu(full[:, :inter].float()).to(dtype).float() * full[:, inter:].float()).to(dtype)
    assert gated.shape == (rows, inter) and gated.dtype == dtype
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(gated.float(), want.float(), **tol)
    q, scale = fp8_w8a8_gated(xq, xs, w, ws, dtype, quantize=True)
    q_ref, scale_ref = quantize_per_token_triton(full, silu_and_mul=True)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    # The quantizer alone: any split of a row's |max| into partial maxima gives quantize_per_token_triton's.
    x = torch.randn(rows, 3000, generator=gen).to(device, dtype)
    parts = x.float().abs().view(rows, 5, 600).amax(dim=2)
    q, scale = quantize_from_parts(x, parts)
    q_ref, scale_ref = quantize_per_token_triton(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("rows", [2, 17, 70])
def test_linear_takes_quantized_rows(rows, monkeypatch):
    """An FP8 Linear given rows its producer quantized (QuantizedRows) returns what it returns given the
    unquantized rows (it quantizes them the same way), on the swap-AB GEMM and, above W8A8_MAX_M rows,
    on the large-M path; gate/up with fp8_out hands down_proj quantized rows."""
    import torch

    from tandem.kernels.fp8 import QuantizedRows, quantize_activation_per_token_ref
    from tandem.kernels.triton_quant import quantize_per_token_triton
    from tandem.layers import quantization
    from tandem.layers.linear import Linear

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
        monkeypatch.setattr(quantization, "W8A8_MAX_M", 64)
    if device == "cpu" and rows > 64:
        pytest.skip("_scaled_mm has no CPU kernel")
    gen = torch.Generator().manual_seed(rows)
    lin = Linear(256, 128, bias=True)
    lin.weight.data = (torch.randn(128, 256, generator=gen) * 0.05).to(device, dtype)
    lin.bias.data = torch.randn(128, generator=gen).to(device, dtype)
    assert lin.quantize_fp8_()
    x = torch.randn(rows, 256, generator=gen).to(device, dtype)
    # The interpreter's e4m3 cast rounds some values differently from the GPU's (and from PyTorch's): on the
    # CPU the rows are quantized by the reference, as the CPU linear quantizes them, and the sums compared
    # to fp32 rounding; on the GPU both sides run the same kernels, bit for bit.
    xq = QuantizedRows(*(quantize_per_token_triton(x) if device == "cuda" else quantize_activation_per_token_ref(x)),
                       dtype)
    tol = dict(atol=0, rtol=0) if device == "cuda" else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lin(xq), lin(x), **tol)
    plain_linear = Linear(256, 128)
    plain_linear.weight.data = lin.bias.data.new_zeros(128, 256)
    with pytest.raises(ValueError, match="FP8 weights"):
        plain_linear(xq)
    gated = lin.forward_silu_and_mul(x, fp8_out=True)
    assert isinstance(gated, QuantizedRows) and gated.shape == (rows, 64)
    plain = lin.forward_silu_and_mul(x)
    q, scale = quantize_per_token_triton(plain)
    assert torch.equal(gated.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(gated.scale, scale)


@pytest.mark.parametrize("silu_and_mul", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("rows,dim", [(1, 8192), (5, 9000), (3, 14336)])  # 9000: a masked last chunk
def test_wide_quantizer_equals_one_program_a_row(rows, dim, silu_and_mul, monkeypatch):
    """Rows spread over several programs (_quant_wide_kernel: the interpreter runs its two phases as two
    launches, a GPU one launch whose chunks wait for each other) quantize bit for bit as one program a row,
    call after call (the launch counts and the two amax slots carry over from one call to the next)."""
    import torch

    from tandem.kernels import triton_quant
    from tandem.kernels.triton_quant import LAUNCH_STEP, quantize_per_token_triton, use_wide_quant

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    assert use_wide_quant(rows, dim, torch.device(device))
    gen = torch.Generator().manual_seed(rows + dim)
    counts_before = triton_quant._wide_quant_state(torch.device(device), rows)[1][:rows].clone()
    for call in range(3):
        y = (torch.randn(rows, (2 if silu_and_mul else 1) * dim, generator=gen) * (call + 1)).to(device, dtype)
        got = quantize_per_token_triton(y, silu_and_mul=silu_and_mul)
        quantize_per_token_triton(torch.randn(rows, 10240, generator=gen).to(device, dtype))  # 5 chunks between
        monkeypatch.setattr(triton_quant, "WIDE_QUANT", False)
        want = quantize_per_token_triton(y, silu_and_mul=silu_and_mul)
        monkeypatch.setattr(triton_quant, "WIDE_QUANT", True)
        assert torch.equal(got[1], want[1])
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    counts = triton_quant._wide_quant_state(torch.device(device), rows)[1][:rows]
    assert torch.equal(counts - counts_before, torch.full_like(counts, 6 * LAUNCH_STEP))  # whatever the width
    assert not use_wide_quant(rows, 4096, torch.device(device))  # two chunks: one program a row


_COMPILE_WIDE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_quant import LAUNCH_STEP, _quant_wide_kernel

names = _quant_wide_kernel.arg_names
types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "amax_ptr": "*fp32", "count_ptr": "*i64"}
cx = {"FP8_MAX_C": 448.0, "MIN_AMAX_C": 1e-12, "BLOCK": 2048, "USE_PDL": 2, "SILU_AND_MUL": True, "PHASE": 2,
      "LAUNCH_STEP": LAUNCH_STEP}
src = ASTSource(fn=_quant_wide_kernel, signature={n: types.get(n, "constexpr" if n in cx else "i32") for n in names},
                constexprs=cx)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
ptx = compiled.asm["ptx"]
ops = [l.split()[1] if l.split()[0].startswith("@") else l.split()[0] for l in ptx.splitlines()
       if l.strip() and l.split()[-1] != "//" and any(w in l for w in ("atom.", "griddepcontrol", "ld.global.gpu",
                                                                      "bar.sync", "st.global"))]
import os, re, subprocess, tempfile
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(compiled.asm["cubin"])
    f.flush()
    usage = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", f.name],
                           capture_output=True, text=True).stdout
json.dump({"ops": ops, "regs": int(re.search(r"REG:(\d+)", usage).group(1))}, sys.stdout)
"""


def test_wide_quantizer_orders_its_count_on_sm90():
    """Compiled for Hopper, the wide quantizer's chunks wait for the previous kernel before touching the row
    state, raise the amax before a barrier and a release add, and read the count and the amax with acquire
    semantics at GPU scope before any value is stored. Its registers leave room for the 4 programs per SM
    that use_wide_quant allows (they must all be resident at once: they wait for each other)."""
    from tests.kernels.sm90 import compile_sm90

    out = compile_sm90(_COMPILE_WIDE)
    ops = out["ops"]
    assert 4 * 128 * out["regs"] <= 65536, out["regs"]
    wait = ops.index("griddepcontrol.wait;")
    first_atom = next(i for i, op in enumerate(ops) if op.startswith("atom."))
    assert wait < first_atom
    release = next(i for i, op in enumerate(ops) if op.startswith("atom.global.gpu.release.add"))
    assert any(op.startswith("atom.global.gpu.relaxed.max") for op in ops[:release])
    assert "bar.sync" in ops[first_atom:release]
    acquire = [i for i, op in enumerate(ops) if ".acquire." in op]
    first_store = next(i for i, op in enumerate(ops) if op.startswith("st.global"))
    assert acquire and release < acquire[0] < first_store
