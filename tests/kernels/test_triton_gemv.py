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


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
def test_gemv_with_rms_norm_matches_norm_then_linear(m, fp8, gated, with_residual):
    """GEMV of RMSNorm(x (+ residual)): the norm folded into the weight stream equals the norm then the
    linear (up to the skipped roundings of the normalized x), and x + residual comes back exactly."""
    gen = torch.Generator().manual_seed(7 * m)
    k, n, eps = 320, 64, 1e-5  # 320: a masked K tile
    x = (torch.randn(m, k, generator=gen) * 3).to(DEVICE, DTYPE)
    residual = torch.randn(m, k, generator=gen).to(DEVICE, DTYPE) if with_residual else None
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE)
    w, scale = quantize_weight_fp8(w) if fp8 else (w.to(DTYPE), None)
    summed = x if residual is None else (x.float() + residual.float()).to(DTYPE)
    normed = F.rms_norm(summed.float(), (k,), eps=eps) * g.float()
    ref = reference(normed, w, scale, None, gated)
    result = gemv_triton(x, w, scale, None, gated=gated, config={"BLOCK_N": 8, "BLOCK_K": 128}, norm=(g, eps),
                         residual=residual)
    out, new_residual = result if residual is not None else (result, None)
    torch.testing.assert_close(out.float(), ref, **TOL)
    if residual is not None:
        assert torch.equal(new_residual, summed)


def test_norm_linear_fused_equals_unfused(monkeypatch):
    """layers.linear.norm_linear at one row: the fused GEMV path (forced Triton on the CPU) and the norm +
    linear path agree, with and without a residual, plain and gated."""
    from tandem.layers.linear import norm_linear
    from tandem.layers.norm import RMSNorm

    torch.manual_seed(1)
    norm = RMSNorm(256, eps=1e-6).to(DEVICE, DTYPE)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    lin = Linear(256, 192).to(DEVICE, DTYPE)
    torch.nn.init.normal_(lin.weight, std=0.05)
    x, residual = torch.randn(1, 256).to(DEVICE, DTYPE), torch.randn(1, 256).to(DEVICE, DTYPE)
    for res in (None, residual):
        for gated in (False, True):
            monkeypatch.setenv("TANDEM_GEMV_MAX_ROWS", "0")  # the unfused path
            want, want_res = norm_linear(norm, lin, x, res, gated=gated)
            monkeypatch.delenv("TANDEM_GEMV_MAX_ROWS")
            if not CUDA:
                monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
            got, got_res = norm_linear(norm, lin, x, res, gated=gated)
            monkeypatch.delenv("TANDEM_FORCE_TRITON", raising=False)
            torch.testing.assert_close(got.float(), want.float(), **TOL)
            assert torch.equal(got_res, want_res)


def test_gemv_rejects_bad_shapes():
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemv_triton(x, torch.randn(32, 48))
    with pytest.raises(ValueError, match="even number"):
        gemv_triton(x, torch.randn(33, 64), gated=True)
    with pytest.raises(ValueError, match="needs norm"):
        gemv_triton(x, torch.randn(32, 64), residual=torch.randn(1, 64))


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
    assert len(calls) == 3  # six rows: F.linear
    monkeypatch.setenv("TANDEM_GEMV_MAX_ROWS", "0")
    assert not use_gemv(x1, 256)
    monkeypatch.setenv("TANDEM_GEMV_MAX_ROWS", "8")
    assert use_gemv(x6, 256)
    monkeypatch.delenv("TANDEM_GEMV_MAX_ROWS")
    monkeypatch.delenv("TANDEM_FORCE_TRITON", raising=False)
    if not CUDA:
        assert not use_gemv(x1, 256)  # CPU without forced Triton: F.linear


_COMPILE_SM90 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_gemv import _gemv_kernel

names = _gemv_kernel.arg_names
out = {}
for wty, gated, norm, bk in (("*bf16", False, False, 2048), ("*bf16", True, True, 1024), ("*fp8e4nv", False, True, 2048),
                             ("*fp8e4nv", True, False, 2048)):
    ptrs = {"x_ptr": "*bf16", "w_ptr": wty, "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "r_ptr": "*bf16",
            "g_ptr": "*bf16", "res_out_ptr": "*bf16", "eps": "fp32"}
    cx = {"HAS_SCALE": wty != "*bf16", "HAS_BIAS": False, "GATED": gated, "NORM": norm, "HAS_RES": norm, "MASK_M": False,
          "MASK_N": False, "EVEN_K": True, "BLOCK_M": 1, "BLOCK_N": 2, "BLOCK_K": bk, "VEC": 8 if wty == "*bf16" else 16}
    aligned = ("x_ptr", "w_ptr", "s_ptr", "b_ptr", "out_ptr", "r_ptr", "g_ptr", "res_out_ptr", "K", "stride_xm",
               "stride_wn", "stride_om", "stride_rm")
    src = ASTSource(fn=_gemv_kernel, signature={a: ptrs.get(a, "constexpr" if a in cx else "i32") for a in names},
                    constexprs=cx, attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    out[f"{wty}-gated={gated}-norm={norm}"] = sorted({l.split()[0] for l in ptx.splitlines()
                                                      if l.strip().startswith(("ld.", "st."))})
json.dump(out, sys.stdout)
"""


def test_gemv_compiles_for_sm90_with_vector_loads():
    """Every variant compiles for Hopper without a GPU and streams the weight with 16-byte loads
    (ld.global.v4), keeping nothing in local memory."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip(f"no ptxas for sm90 in this Triton build: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for variant, ops in json.loads(proc.stdout).items():
        assert any(op.startswith("ld.global.v4") for op in ops), (variant, ops)
        assert not any(op.startswith(("ld.local", "st.local")) for op in ops), (variant, ops)


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


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,gated", [(12288, False), (28672, True)])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_gemv_with_add_rms_norm(n, gated, fp8):
    """The decoder's fused norm + projection at Llama shapes (hidden 4096, 1-4 rows): relative error of the
    bf16 kernel against fp32 math on the same rounded residual sum, which comes back exactly."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    k, eps = 4096, 1e-5
    x = torch.randn(4, k, generator=gen, device="cuda").bfloat16()
    residual = (torch.randn(4, k, generator=gen, device="cuda") * 4).bfloat16()
    g = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).bfloat16()
    w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
    w, scale = quantize_weight_fp8(w) if fp8 else (w.bfloat16(), None)
    for m in (1, 2, 4):
        summed = x[:m] + residual[:m]
        ref = reference(F.rms_norm(summed.float(), (k,), eps=eps) * g.float(), w, scale, None, gated)
        out, new_residual = gemv_triton(x[:m], w, scale, None, gated=gated, norm=(g, eps), residual=residual[:m])
        assert torch.equal(new_residual, summed)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (m, rel)
