"""Fused norm / rotary / SiLU-and-mul Triton kernels against the PyTorch layers (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.config import ModelConfig
from tandem.kernels.triton_fused import (
    fused_add_rms_norm_triton,
    rms_norm_triton,
    rotary_triton,
    silu_and_mul_triton,
)
from tandem.layers.activation import silu_and_mul
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, apply_rotary
from tandem.models.llama import LlamaForCausalLM
from tests.models.paged_kv import PagedKV, Seq

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def _eager_reference_path(monkeypatch):
    # The PyTorch reference must not itself dispatch to Triton.
    monkeypatch.delenv("TANDEM_FORCE_TRITON", raising=False)


def randn(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def make_norm(dim, dtype, seed=1):
    norm = RMSNorm(dim, eps=1e-6)
    norm.weight.data = (1 + randn(dim, dtype=torch.float32, seed=seed, scale=0.1)).to(dtype)
    return norm


def close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOL[dtype])


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 4096, 100])
def test_rms_norm_matches_layer(dim, dtype):
    x = randn(3, dim, dtype=dtype, scale=3.0)
    norm = make_norm(dim, dtype)
    close(rms_norm_triton(x, norm.weight, norm.eps), norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 4096])
def test_fused_add_rms_norm_matches_layer(dim, dtype):
    # x and residual are row-strided views (slices of wider buffers), as outputs of fused projections can be.
    x = randn(3, dim + 64, dtype=dtype, seed=2)[:, :dim]
    residual = randn(3, 2 * dim, dtype=dtype, seed=3, scale=4.0)[:, dim:]
    x_before, residual_before = x.clone(), residual.clone()
    norm = make_norm(dim, dtype)
    out, new_residual = fused_add_rms_norm_triton(x, residual, norm.weight, norm.eps)
    ref_out, ref_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)  # same single rounding of x + r
    close(out, ref_out, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits,scaled,bias", [(2, True, False), (4, False, True), (3, True, True)])
def test_fused_add_rms_norm_takes_partial_sums(splits, scaled, bias, dtype):
    """A split-K GEMM's partial sums (PartialSums) go straight into add + RMSNorm: the same outputs, bit
    for bit, as the reduce then the norm (plain and quantized for FP8), and the RMSNorm layer takes them too."""
    from tandem.kernels.fp8 import PartialSums

    if CUDA and dtype == torch.float32:
        pytest.skip("fp32 on a GPU: the compiler may contract the channel scale and the residual add into one "
                    "FMA; the engine hands PartialSums over only from 16-bit GEMMs, where a rounding sits between")
    rows, dim = 5, 576
    ws = randn(splits, rows, dim, dtype=torch.float32, seed=3).to(DEVICE)
    scale = (randn(dim, 1, dtype=torch.float32, seed=4).abs() + 0.5).to(DEVICE) if scaled else None
    b = randn(dim, dtype=dtype, seed=5).to(DEVICE) if bias else None
    parts = PartialSums(ws, scale, b, dtype)
    assert parts.shape == (rows, dim)
    residual = randn(rows, dim, dtype=dtype, seed=6).to(DEVICE)
    norm = make_norm(dim, dtype)
    norm.weight.data = norm.weight.data.to(DEVICE)
    reduced = split_k_reduce(parts)  # what the GEMM's reduce kernel writes
    want = fused_add_rms_norm_triton(reduced, residual, norm.weight, 1e-6)
    got = fused_add_rms_norm_triton(parts, residual, norm.weight, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if dtype == torch.float16 or CUDA:
        got_q = fused_add_rms_norm_triton(parts, residual, norm.weight, 1e-6, fp8_out=True)[0]
        want_q = fused_add_rms_norm_triton(reduced, residual, norm.weight, 1e-6, fp8_out=True)[0]
        assert torch.equal(got_q.q.view(torch.uint8), want_q.q.view(torch.uint8))
        assert torch.equal(got_q.scale, want_q.scale)
    close(parts.reduce(), reduced, dtype)  # PyTorch's sum (no fused multiply-add on the GPU)
    layer_out, layer_res = norm(parts, residual)  # on the CPU the layer's PyTorch path reduces first
    close(layer_out, norm(reduced, residual)[0], dtype)
    close(layer_res, reduced + residual, dtype)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm_triton(parts, residual[:2], norm.weight, 1e-6)


def split_k_reduce(parts):
    """PartialSums through _split_k_reduce_kernel, as the GEMM would have reduced them."""
    from tandem.kernels.triton_quant import reduce_partial_sums_triton

    return reduce_partial_sums_triton(parts)


@pytest.mark.skipif(CUDA, reason="16-bit operands in fp32 run TF32 dots on a GPU; the gpu test covers bf16")
def test_split_k_linears_defer_their_reduce(monkeypatch):
    """A Linear asked to defer its reduce hands back the split-K partial sums (16-bit skinny GEMM and FP8
    W8A8 GEMM) whose reduce equals its usual output bit for bit; TANDEM_DEFER_REDUCE=0 and unsplit GEMMs
    return tensors."""
    from tandem.kernels import triton_quant
    from tandem.kernels.fp8 import PartialSums, quantize_activation_per_token_ref
    from tandem.kernels.triton_quant import fp8_w8a8_matmul_quantized, skinny_matmul_triton
    from tandem.layers.linear import Linear
    from tandem.layers.quantization import quantize_weight_fp8

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1024, generator=gen).to(DEVICE)
    w = (torch.randn(128, 1024, generator=gen) * 0.05).to(DEVICE)
    b = torch.randn(128, generator=gen).to(DEVICE)
    tile = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4}
    parts = skinny_matmul_triton(x, w, b, tile, defer=True)
    assert isinstance(parts, PartialSums) and parts.ws.shape == (4, 6, 128)
    assert torch.equal(split_k_reduce(parts), skinny_matmul_triton(x, w, b, tile))
    q, scale = quantize_weight_fp8(w)
    xq, xs = quantize_activation_per_token_ref(x)
    parts = fp8_w8a8_matmul_quantized(xq, xs, q, scale, b, x.dtype, {**tile, "BLOCK_K": 256, "SPLIT_K": 2}, True)
    assert isinstance(parts, PartialSums) and parts.scale is scale
    assert torch.equal(split_k_reduce(parts), fp8_w8a8_matmul_quantized(xq, xs, q, scale, b, x.dtype,
                                                                 {**tile, "BLOCK_K": 256, "SPLIT_K": 2}))
    assert isinstance(skinny_matmul_triton(x, w, b, {**tile, "SPLIT_K": 1}, defer=True), torch.Tensor)
    monkeypatch.setattr(triton_quant, "DEFER_REDUCE", False)
    assert isinstance(skinny_matmul_triton(x, w, b, tile, defer=True), torch.Tensor)
    lin = Linear(1024, 128)
    lin.weight.data = w
    assert isinstance(lin(x, defer_reduce=True), torch.Tensor)  # no Triton on this path: F.linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_per_head_qk_norm_on_fused_qkv_views(head_dim, dtype):
    # Qwen3: q and k norms over head_dim, read straight from the fused qkv output.
    num_tokens, num_heads, num_kv_heads = 3, 6, 2
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    for x, seed in ((q, 1), (k, 2)):
        norm = make_norm(head_dim, dtype, seed=seed)
        close(rms_norm_triton(x, norm.weight, norm.eps), norm(x), dtype)


def test_rms_norm_rejects_mismatched_residual():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError):
        fused_add_rms_norm_triton(x, torch.randn(2, 32), torch.ones(64), 1e-6)


# ----------------------------------------------------------------------------- rotary


def fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=4)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (6, 1), (4, 4)])
def test_rotary_in_place_on_fused_qkv_views(num_heads, num_kv_heads, head_dim, dtype):
    num_tokens = 5
    torch.set_default_dtype(dtype)  # the cos/sin cache takes the model dtype, as in the loader
    try:
        rope = RotaryEmbedding(head_dim, 64, 10000.0)
    finally:
        torch.set_default_dtype(torch.float32)
    cos, sin = rope(torch.tensor([0, 1, 7, 33, 63]))
    qkv, q, k = fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    ref_q, ref_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    rotary_triton(q, k, cos, sin)
    close(q, ref_q, dtype)
    close(k, ref_k, dtype)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)  # v is not touched


def test_partial_rotary_leaves_tail_dims():
    head_dim, half = 64, 16  # rotary_dim 32 of 64
    angles = torch.rand(3, half) * 6.0
    cos, sin = angles.cos(), angles.sin()  # the [num_tokens, half] layout is accepted too
    qkv, q, k = fused_qkv_views(3, 4, 2, head_dim, torch.float32)
    ref_q, ref_k = q.clone(), k.clone()
    for ref in (ref_q, ref_k):
        ref[..., : 2 * half] = apply_rotary(ref[..., : 2 * half], cos[:, None], sin[:, None])
    rotary_triton(q, k, cos, sin)
    close(q, ref_q, torch.float32)
    close(k, ref_k, torch.float32)


# ----------------------------------------------------------------------------- SiLU and mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 96), (2, 2 * 1376), (2, 3, 2 * 64)])
def test_silu_and_mul_matches_layer(shape, dtype):
    x = randn(*shape, dtype=dtype, scale=3.0)
    close(silu_and_mul_triton(x), silu_and_mul(x), dtype)


# ----------------------------------------------------------------------------- end to end


def tiny_model(qk_norm: bool) -> tuple[LlamaForCausalLM, ModelConfig]:
    config = ModelConfig(architecture="qwen3" if qk_norm else "llama", vocab_size=97, hidden_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=96,
                         max_position_embeddings=64, qk_norm=qk_norm)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        param.data = base + 0.1 * torch.randn(param.shape, generator=gen)
    return model, config


def run_steps(model, config) -> list[torch.Tensor]:
    """A prefill of two prompts, then one decode step with a padding row; logits of every step."""
    seqs = [Seq(list(range(3, 10))), Seq(list(range(20, 25)))]
    kv = PagedKV(config)
    logits = []
    with torch.inference_mode():
        for num_padding_rows in (0, 1):
            step = kv.step(seqs, num_padding_rows=num_padding_rows)
            out = model.compute_logits(model(step.input_ids, step.positions, kv.kv_cache, step.meta))
            logits.append(out[step.last_token_idx])
            for seq, row in zip(seqs, logits[-1]):
                seq.token_ids.append(int(row.argmax()))
    return logits


@pytest.mark.skipif(CUDA, reason="compares the CPU PyTorch path with the interpreted Triton path")
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_model_forward_same_logits_with_forced_triton(qk_norm, monkeypatch):
    """Prefill through rotary_write_kv + the prefill kernel, the decode step through the decode kernel with fused
    rotary (and Qwen3's q/k norm), against the PyTorch layers."""
    from tandem.kernels import ops

    model, config = tiny_model(qk_norm)
    eager = run_steps(model, config)
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    calls = []
    real = ops.decode_attention_rotary
    monkeypatch.setattr(ops, "decode_attention_rotary", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fused = run_steps(model, config)
    assert len(calls) == config.num_layers  # the decode step, once per layer
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- GPU, bf16


def rel_err(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dim", [4096, 5120, 8192])
def test_gpu_bf16_add_rms_norm(dim):
    x, residual = randn(257, dim, dtype=torch.float32).cuda(), randn(257, dim, dtype=torch.float32, seed=1).cuda()
    weight = 1 + 0.1 * randn(dim, dtype=torch.float32, seed=2).cuda()
    summed = x + residual
    ref = torch.nn.functional.rms_norm(summed, (dim,), eps=1e-5) * weight
    out, new_residual = fused_add_rms_norm_triton(x.bfloat16(), residual.bfloat16(), weight.bfloat16(), 1e-5)
    assert out.dtype == new_residual.dtype == torch.bfloat16
    assert rel_err(new_residual, summed) < 1e-2 and rel_err(out, ref) < 1e-2
    # The eager layer's formula in bf16 (RMSNorm.forward on CUDA now runs this kernel, so spell it out).
    eager_residual = x.bfloat16() + residual.bfloat16()
    normed = torch.nn.functional.rms_norm(eager_residual.float(), (dim,), eps=1e-5).bfloat16()
    assert torch.equal(new_residual, eager_residual) and rel_err(out, weight.bfloat16() * normed) < 1e-3


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (32, 32, 128), (28, 4, 128), (16, 8, 64)])
def test_gpu_bf16_rotary(num_heads, num_kv_heads, head_dim):
    num_tokens = 300
    rope = RotaryEmbedding(head_dim, 4096, 500000.0).cuda()
    cos, sin = rope(torch.randint(0, 4096, (num_tokens,), device="cuda"))
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda")
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    ref_q = apply_rotary(qkv[:, :q_size].view(num_tokens, num_heads, head_dim), cos, sin)
    ref_k = apply_rotary(qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim), cos, sin)
    qkv = qkv.bfloat16()
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    rotary_triton(q, k, cos.bfloat16(), sin.bfloat16())
    assert rel_err(q, ref_q) < 1e-2 and rel_err(k, ref_k) < 1e-2


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("inter", [11008, 14336])
def test_gpu_bf16_silu_and_mul(inter):
    x = torch.randn(129, 2 * inter, device="cuda") * 3
    ref = torch.nn.functional.silu(x[:, :inter]) * x[:, inter:]
    assert rel_err(silu_and_mul_triton(x.bfloat16()), ref) < 1e-2


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336)])
def test_gpu_deferred_reduce_into_add_rms_norm(n, k, fp8):
    """Llama-3-8B's o_proj and down_proj at 32 rows on the GPU: the split-K GEMM's partial sums handed to
    add + RMSNorm give bit for bit what the reduce kernel then the norm give (bf16 skinny GEMM; FP8 W8A8
    GEMM with the norm quantizing its output for the next FP8 linear)."""
    from tandem.kernels.fp8 import PartialSums
    from tandem.kernels.triton_quant import fp8_w8a8_matmul_quantized, quantize_per_token_triton, skinny_matmul_triton
    from tandem.layers.quantization import quantize_weight_fp8

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(32, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    residual = torch.randn(32, n, generator=gen, device="cuda").to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(n, generator=gen, device="cuda")).to(torch.bfloat16)
    if fp8:
        q, scale = quantize_weight_fp8(w)
        xq, xs = quantize_per_token_triton(x)
        parts = fp8_w8a8_matmul_quantized(xq, xs, q, scale, None, x.dtype, defer=True)
        plain = fp8_w8a8_matmul_quantized(xq, xs, q, scale, None, x.dtype)
    else:
        parts = skinny_matmul_triton(x, w, None, defer=True)
        plain = skinny_matmul_triton(x, w, None)
    assert isinstance(parts, PartialSums) and parts.ws.shape[0] > 1
    got = fused_add_rms_norm_triton(parts, residual, norm_w, 1e-5, fp8_out=fp8)
    want = fused_add_rms_norm_triton(plain, residual, norm_w, 1e-5, fp8_out=fp8)
    assert torch.equal(got[1], want[1])
    if fp8:
        assert torch.equal(got[0].q.view(torch.uint8), want[0].q.view(torch.uint8))
        assert torch.equal(got[0].scale, want[0].scale)
    else:
        assert torch.equal(got[0], want[0])
