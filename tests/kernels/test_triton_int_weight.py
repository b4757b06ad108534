"""The W4A16 / W8A16 kernels (GEMV and tile GEMM over IntWeight, repacked from the tandem int-N layout) against the
reference dequantization and a matmul: in the Triton interpreter on CPU (fp32 / fp16), compiled for sm_90 without
a GPU, on a GPU (bf16, CUDA graphs); and ops.int_weight_linear's dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import ops
from tandem.kernels.int_weight import NIBBLE_ORDER, dequantize_repacked, repack_int_weight
from tandem.kernels.reference import dequantize_int_weight
from tandem.kernels.triton_int_weight import (
    int_gemm_config,
    int_gemv_config,
    dequantize_int_weight_triton,
    int_weight_matmul_triton,
    part_elements,
    swap_ab_config,
)
from tests.kernels.sm90 import compile_sm90

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def make_weight(n: int, k: int, bits: int, group_size: int, dtype: torch.dtype, seed: int, integer_zeros: bool = True):
    """Random codes, positive scales and zeros in the tandem layout (4 bits: two codes a byte, even k low)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
    groups = k // group_size
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 2**bits, (n, groups), generator=gen).float()
    if not integer_zeros:
        zeros = zeros + torch.rand(n, groups, generator=gen)
    return qweight.to(DEVICE), scales.to(DEVICE), zeros.to(dtype).to(DEVICE), codes


def reference(x, qweight, scales, zeros, bits, group_size, bias=None):
    w = dequantize_int_weight(qweight, scales, zeros, bits, group_size).float()
    return F.linear(x.float(), w, None if bias is None else bias.float())


def assert_close_to(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 (the interpreter): the kernels' sums in another order than the reference's. 16-bit: each weight
    (the GEMMs round it to x's dtype, 2**-9 of it in bf16; a 4-bit min rounded adds <= 2**-9 |zero * scale|)
    and the output are rounded, errors of random sign that grow like sqrt(K) as the outputs do: a few 1e-3
    of the largest output; bounded at 1e-2 of it."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)


def test_dequantize_reads_the_layout():
    """Element k of a row: byte k // 2, low nibble for even k; (q - zero) * scale of its group."""
    qweight, scales, zeros, codes = make_weight(3, 64, 4, 32, torch.float32, 0)
    w = dequantize_int_weight(qweight.cpu(), scales.cpu(), zeros.cpu(), 4, 32)
    for n, k in [(0, 0), (0, 1), (1, 33), (2, 62), (2, 63)]:
        g = k // 32
        expected = (codes[n, k].float() - zeros[n, g].cpu()) * scales[n, g].cpu()
        assert w[n, k] == expected
    assert int(qweight[1, 16]) & 0xF == int(codes[1, 32]) and int(qweight[1, 16]) >> 4 == int(codes[1, 33])


def test_bad_weights_are_refused():
    qweight, scales, zeros, _ = make_weight(8, 64, 4, 32, torch.float32, 1)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        dequantize_int_weight(qweight, scales, zeros, 3, 32)
    with pytest.raises(ValueError, match="does not divide"):
        dequantize_int_weight(qweight, scales, zeros, 4, 48)
    with pytest.raises(ValueError, match="scales and zeros must be"):
        dequantize_int_weight(qweight, scales[:, :1], zeros, 4, 32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_int_weight(qweight.to(torch.int32), scales, zeros, 4, 32)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        int_weight_matmul_triton(torch.randn(2, 32, device=DEVICE), repack_int_weight(qweight, scales, zeros, 4, 32))
    odd = torch.zeros(8, 6, dtype=torch.uint8, device=DEVICE)  # K = 12: not whole int32 words
    s = torch.ones(8, 1, device=DEVICE)
    with pytest.raises(ValueError, match="multiples of 8"):
        repack_int_weight(odd, s, s, 4, 12)


@pytest.mark.parametrize("bits", [4, 8])
def test_repack_keeps_the_weight(bits):
    """The kernels' layout holds the same weight (q * scale + min, min = -zero * scale); at 4 bits nibble i of a
    word holds element NIBBLE_ORDER[i] of its 8."""
    qweight, scales, zeros, codes = make_weight(6, 128, bits, 32, torch.float32, 2)
    packed = repack_int_weight(qweight, scales, zeros, bits, 32)
    assert packed.shape == (6, 128) and packed.words.dtype == torch.int32
    torch.testing.assert_close(dequantize_repacked(packed), dequantize_int_weight(qweight, scales, zeros, bits, 32))
    if bits == 4:
        word = int(packed.words[3, 5]) & 0xFFFFFFFF
        assert [(word >> (4 * i)) & 0xF for i in range(8)] == [int(codes[3, 40 + e]) for e in NIBBLE_ORDER]


# Interpreter cases stay small: N 48 (masked channel tiles), K 256, every group size the formats use.
GROUPS = [16, 32, 64, 128, None]  # None: one group per row (per-channel); 16: GGUF Q6_K


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"g{g or 'K'}")
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_matches_reference(bits, group, m):
    dtype = torch.bfloat16 if CUDA else torch.float32
    n, k = 48, 256
    group_size = group or k
    qweight, scales, zeros, _ = make_weight(n, k, bits, group_size, dtype, seed=bits * 1000 + group_size + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    bias = torch.randn(n).to(DEVICE, dtype) if m == 3 else None
    ref = reference(x, qweight, scales, zeros, bits, group_size, bias)
    packed = repack_int_weight(qweight, scales, zeros, bits, group_size)
    # The GEMV at every decode row count (several channels a program: interpreter time); the GEMM on tiles
    # that N fills (EVEN: unmasked loads), and per-channel on its default tile (128 channels: masked); up to
    # 16 rows also the swap-AB tile.
    paths = [(True, {"BLOCK_N": 16, "BLOCK_K": 128})] if m <= 4 else []
    paths.append((False, {"BLOCK_N": 16} if group else None))
    if m <= 16:
        paths.append((False, {**swap_ab_config(n, k, bits, 132), "BLOCK_N": 16}))
    for gemv, config in paths:
        out = int_weight_matmul_triton(x, packed, bias, gemv=gemv, config=config)
        assert out.shape == (m, n) and out.dtype == dtype
        assert_close_to(out, ref)


@pytest.mark.parametrize("gemv", [True, False], ids=["gemv", "gemm"])
@pytest.mark.parametrize("bits", [4, 8])
def test_split_k_and_masked_tails(gemv, bits):
    """K split over programs (partial sums added by the reduce kernel, bias there), a K step that runs past the
    end of K (K 320 = 5 groups of 64 under 128-wide steps) and fp16 activations with non-integer zeros."""
    n, k, group_size = 24, 320, 64
    qweight, scales, zeros, _ = make_weight(n, k, bits, group_size, torch.float16, seed=7, integer_zeros=False)
    x = torch.randn(2 if gemv else 5, k, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    bias = torch.randn(n).to(DEVICE, torch.float16)
    ref = reference(x, qweight, scales, zeros, bits, group_size, bias)
    cfg = {"BLOCK_N": 8, "BLOCK_K": 128, "SPLIT_K": 2} if gemv else {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128,
                                                                     "SPLIT_K": 2}
    packed = repack_int_weight(qweight, scales, zeros, bits, group_size)
    out = int_weight_matmul_triton(x, packed, bias, gemv=gemv, config=cfg)
    assert_close_to(out, ref)


def test_part_elements_never_straddle_a_group():
    assert part_elements(2048, 128, 4) == 128
    assert part_elements(2048, 4096, 4) == 2048
    assert part_elements(2048, 14336, 4) == 2048  # per-channel down_proj: 14336 = 7 * 2048
    assert part_elements(128, 320, 4) == 64
    assert part_elements(1024, 32, 8) == 32
    assert part_elements(64, 12, 8) == 4  # one word: 12 = 3 words of 8-bit codes


def test_configs_fill_the_gpu_from_the_shape():
    """Shape-only tiles (graph-safe): every Llama-3-8B projection at one row gives at least two programs per SM
    without splitting K; a narrow N splits K instead; more rows take the tensor-core GEMM's tiles."""
    sms = 132
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        cfg = int_gemv_config(1, n, k, 4, 128, sms)
        assert cfg["SPLIT_K"] == 1 and -(-n // cfg["BLOCK_N"]) >= 2 * sms
        assert int_gemm_config(4096, n, k, 4, 128, sms)["BLOCK_M"] == 256
        assert int_gemm_config(16, n, k, 4, 128, sms)["BLOCK_M"] == 64
    narrow = int_gemv_config(1, 64, 8192, 4, 128, sms)  # 4 K steps of 2048
    assert narrow["BLOCK_N"] == 1 and narrow["SPLIT_K"] > 1


@pytest.mark.skipif(CUDA, reason="fp32 on a GPU takes the reference (no TF32 dots): the GPU cases are below")
def test_ops_dispatch(monkeypatch):
    """int_weight_linear: the reference on CPU; the Triton kernels where Triton runs (the interpreter under
    TANDEM_FORCE_TRITON=1), the GEMV up to INT_GEMV_MAX_ROWS rows and the GEMM above; leading dims kept."""
    import tandem.kernels.triton_int_weight as module

    qweight, scales, zeros, _ = make_weight(16, 64, 4, 32, torch.float32, 5)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = reference(x.view(-1, 64), qweight, scales, zeros, 4, 32).view(2, 3, 16)
    calls = []
    real = module.int_weight_matmul_triton
    monkeypatch.setattr(module, "int_weight_matmul_triton",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    if not CUDA:
        monkeypatch.delenv("TANDEM_FORCE_TRITON", raising=False)
        torch.testing.assert_close(ops.int_weight_linear(x, qweight, scales, zeros, 4, 32), ref)
        assert calls == []
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    out = ops.int_weight_linear(x, qweight, scales, zeros, 4, 32)
    assert calls == [6] and out.shape == (2, 3, 16)
    assert_close_to(out, ref)
    assert module.use_int_gemv(1) and module.use_int_gemv(module.INT_GEMV_MAX_ROWS)
    assert not module.use_int_gemv(module.INT_GEMV_MAX_ROWS + 1)
    monkeypatch.setenv("TANDEM_INT_GEMV_MAX_ROWS", "4")
    assert module.use_int_gemv(4) and not module.use_int_gemv(5)


@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, 64), (8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_kernel_writes_the_weight(bits, group, dtype):
    """The large-M path's dense weight: the kernel's [N, K] (ragged N and K tails masked) equals the reference
    dequantization of the repacked weight; in fp16 each weight rounded once, as the tile GEMM rounds it."""
    n, k = 40, 3 * 256 + 128 if group != 16 else 272
    qweight, scales, zeros, _ = make_weight(n, k, bits, group, dtype, seed=bits * 100 + group)
    packed = repack_int_weight(qweight, scales, zeros, bits, group)
    got = dequantize_int_weight_triton(packed, dtype)
    want = dequantize_repacked(packed).float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want, atol=2e-3 * want.abs().max().item(), rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 300, 600])
def test_gpu_llama_shapes_in_bf16(bits, m):
    """bf16 on the GPU, an 8B-sized projection (K 4096, group 128), every path by its row count: close to the fp32
    product of the reference dequantization (assert_close_to says how close)."""
    n, k, group_size = 1536, 4096, 128
    qweight, scales, zeros, _ = make_weight(n, k, bits, group_size, torch.bfloat16, seed=m)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    ref = reference(x, qweight, scales, zeros, bits, group_size)
    out = ops.int_weight_linear(x, qweight, scales, zeros, bits, group_size)
    assert_close_to(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_gpu_graph_replay_equals_eager(m):
    """Captured in a CUDA graph (split-K workspace and all), replay gives eager's bits, and again after x
    changes in place."""
    n, k, group_size = 1024, 4096, 128
    qweight, scales, zeros, _ = make_weight(n, k, 4, group_size, torch.bfloat16, seed=11)
    packed = repack_int_weight(qweight, scales, zeros, 4, group_size)  # at load, never inside a capture
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    run = lambda: ops.int_weight_linear(x, qweight, scales, zeros, 4, group_size, packed=packed)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())
        x.copy_(torch.randn_like(x))


_COMPILE_SM90 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_int_weight import _int_gemm_kernel, _int_gemv_kernel

names = ["x_ptr", "w_ptr", "s_ptr", "mn_ptr", "b_ptr", "out_ptr", "ws_ptr", "M", "N", "K", "K_SPLIT", "GROUP",
         "ONE_BITS", "stride_xm", "stride_wn", "stride_sn", "stride_om"]
out = {}
# (kernel, activation type, constexprs, warps): the decode GEMV and GEMM at their Llama-3-8B tiles
# (4 bits, group 128, bf16), and the prefill tile in fp16.
cases = [
    ("gemv", _int_gemv_kernel, "bf16", dict(MASK_M=False, BLOCK_M=1, BLOCK_N=8, TG=16, GW=16, PREFETCH_LINES=16,
                                            USE_PDL=2), 4),
    ("gemm-decode", _int_gemm_kernel, "bf16", dict(SWAP_AB=False, BLOCK_M=64, BLOCK_N=128, TG=1, GW=16,
                                                    GROUP_M=8, PACKED=True, PREFETCH_LINES=1, USE_PDL=2), 4),
    ("gemm-fp16", _int_gemm_kernel, "fp16", dict(SWAP_AB=False, BLOCK_M=256, BLOCK_N=128, TG=1, GW=8,
                                                  GROUP_M=8, PACKED=True, PREFETCH_LINES=0, USE_PDL=0), 8),
    # GGUF's groups: Q4_0 / Q4_1 / Q4_K (4 bits, group 32) and Q6_K (8 bits, group 16) at their decode tiles.
    ("gemv-g32", _int_gemv_kernel, "bf16", dict(GROUP=32, MASK_M=False, BLOCK_M=1, BLOCK_N=8, TG=64, GW=4,
                                                PREFETCH_LINES=16, USE_PDL=2), 4),
    ("gemv-w8-g16", _int_gemv_kernel, "bf16", dict(GROUP=16, BITS=8, MASK_M=False, BLOCK_M=1, BLOCK_N=8, TG=64,
                                                   GW=4, PREFETCH_LINES=16, USE_PDL=2), 4),
    ("gemm-w8-g16", _int_gemm_kernel, "bf16", dict(GROUP=16, BITS=8, SWAP_AB=False, BLOCK_M=64, BLOCK_N=128, TG=2,
                                                   GW=8, GROUP_M=8, PACKED=False, PREFETCH_LINES=1, USE_PDL=2,
                                                   WORD_GROUPS=True), 4),
    ("gemm-g16", _int_gemm_kernel, "bf16", dict(GROUP=16, SWAP_AB=False, BLOCK_M=64, BLOCK_N=128, TG=4, GW=4,
                                                GROUP_M=8, PACKED=True, PREFETCH_LINES=1, USE_PDL=2,
                                                WORD_GROUPS=True), 4),
]
for name, fn, xty, flags, warps in cases:
    constexprs = {**dict(GROUP=128, BITS=4, HAS_BIAS=False, SPLIT_K=1, EVEN=True), **flags}
    types = [f"*{xty}", "*i32", f"*{xty}", f"*{xty}", f"*{xty}", f"*{xty}", "*fp32"] + ["i32"] * 4
    types += ["constexpr"] + ["i32"] * 5
    signature = dict(zip(names, types))
    signature.update({key: "constexpr" for key in constexprs if key not in signature})
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 9, 10, 13, 14, 15, 16)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    out[name] = {"prefetch_before_wait": 0 <= ptx.find("prefetch.global.L2") < wait,
                 "stores_before_wait": any(op in ptx[:max(wait, 0)] for op in ("st.global", "red.global")),
                 "wgmma": "wgmma.mma_async" in ptx, "packed_fma": "fma.rn.bf16x2" in ptx or "fma.rn.f16x2" in ptx,
                 "local": "ld.local" in ptx or "st.local" in ptx, "v4_loads": "ld.global.v4" in ptx,
                 "shared": kernel.metadata.shared}
json.dump(out, sys.stdout)
"""


def test_kernels_compile_for_sm90():
    """The decode GEMV, the decode GEMM and the prefill GEMM compile for Hopper without a GPU at their default
    tiles: no local memory (spills), the GEMMs on wgmma with the packed dequantization (bf16 and fp16 inline
    assembly accepted by ptxas), shared memory within the 227 KiB a block may have, the GEMV streaming 16-byte
    loads; under PDL the decode kernels prefetch weight lines before the wait and write nothing before it."""
    result = compile_sm90(_COMPILE_SM90)
    for name, info in result.items():
        assert not info["local"] and info["shared"] <= 227 * 1024, (name, info)
    assert result["gemv"]["v4_loads"] and result["gemv-g32"]["v4_loads"]
    for name in ("gemm-decode", "gemm-fp16", "gemm-g16"):
        assert result[name]["wgmma"] and result[name]["packed_fma"], (name, result[name])
    assert result["gemm-w8-g16"]["wgmma"]
    for name in ("gemv", "gemm-decode"):  # under PDL: weight lines to L2 before the wait, nothing written before it
        assert result[name]["prefetch_before_wait"] and not result[name]["stores_before_wait"], (name, result[name])


@pytest.mark.skipif(CUDA, reason="fp32 tensor-core dots round to TF32 on a GPU: the interpreter holds the bits")
def test_deferred_reduce_hands_on_the_partial_sums(monkeypatch):
    """defer_reduce on 2-D x: a K split returns PartialSums whose reduce is the linear's output (bias in it);
    a GEMM that does not split, or 3-D x, returns the tensor."""
    import tandem.kernels.triton_int_weight as module
    import tandem.kernels.triton_quant as quant

    monkeypatch.setattr(quant, "DEFER_REDUCE", True)  # finish_split's switch
    if not CUDA:
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    qweight, scales, zeros, _ = make_weight(32, 512, 4, 64, torch.float32, 9)
    packed = repack_int_weight(qweight, scales, zeros, 4, 64)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    bias = torch.randn(32).to(DEVICE)
    ref = reference(x, qweight, scales, zeros, 4, 64, bias)
    parts = module.int_weight_matmul_triton(x, packed, bias, config={"BLOCK_N": 16, "SPLIT_K": 2}, defer=True)
    assert isinstance(parts, ops.PartialSums) and parts.ws.shape == (2, 2, 32)
    assert_close_to(parts.reduce(), ref)
    whole = module.int_weight_matmul_triton(x, packed, bias, config={"BLOCK_N": 16, "SPLIT_K": 1}, defer=True)
    assert isinstance(whole, torch.Tensor)
    assert isinstance(ops.int_weight_linear(x[None], qweight, scales, zeros, 4, 64, bias, packed, True), torch.Tensor)


@pytest.mark.parametrize("m,k,block_rows", [(1, 4096, False), (3, 300, False), (2, 64, True)])
def test_gather_columns_reads_x_through_perm(m, k, block_rows):
    """Act order's input gather (ops.gather_columns): the kernel's x[:, perm] equals index_select's bits, a ragged K
    masked, rows of a wider tensor (a row stride above K) read, leading dimensions kept, and a permutation's slice
    (a row-parallel rank's columns of the gathered input) read as such; off Triton it is index_select itself."""
    from tandem.kernels.triton_int_weight import gather_columns_triton

    gen = torch.Generator().manual_seed(k)
    wide = torch.randn(m, k + (8 if block_rows else 0), generator=gen).to(DEVICE)
    x = wide[:, :k]
    perm = torch.randperm(k, generator=gen).to(DEVICE)
    assert torch.equal(gather_columns_triton(x, perm), x.index_select(-1, perm))
    assert torch.equal(gather_columns_triton(x, perm.int()), x.index_select(-1, perm))
    x3 = torch.randn(2, m, k, generator=gen).to(DEVICE)
    assert torch.equal(ops.gather_columns(x3, perm), x3.index_select(-1, perm))
    part = perm[k // 3 : k // 3 + k // 2]  # a rank's slice: columns from anywhere in x
    assert torch.equal(gather_columns_triton(x, part), x.index_select(-1, part))
    assert torch.equal(ops.gather_columns(x3, part), x3.index_select(-1, part))
    with pytest.raises(ValueError, match="perm"):
        gather_columns_triton(x, torch.cat([perm, perm[:1]]))
