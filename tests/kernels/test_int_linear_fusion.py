"""The kernels an integer Linear saves at one decode row: a K split handed to the add + RMSNorm (o_proj, down_proj),
added by the tensor-core GEMV itself where nothing takes it (qkv), and silu(gate) * up written by the gate/up
projection's own kernel. In the Triton interpreter (fp32, the CUDA-core GEMV and the unfused fallbacks), on the
CPU reference path, and on a GPU (bf16, the tensor-core GEMV) against the kernels they replace, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.int_weight import dequantize_repacked
from tandem.layers.linear import Linear
from tandem.layers.norm import RMSNorm

CUDA = torch.cuda.is_available()


def int_linear(in_features: int, out_features: int, bits: int, device: str, dtype: torch.dtype, seed: int) -> Linear:
    torch.manual_seed(seed)
    linear = Linear(in_features, out_features)
    linear.weight.data = (torch.randn(out_features, in_features) * 0.05).to(device=device, dtype=dtype)
    linear.quantize_int_(bits)
    return linear


def dequantized(linear: Linear) -> torch.Tensor:  # fp32 [out, in]
    """The weight the layer's codes hold (from the kernels' layout once a GPU forward has replaced the other)."""
    packed = linear.packed_weight()
    return packed.dequantize() if packed is not None else dequantize_repacked(linear.kernel_int_weight).float()


@pytest.mark.skipif(CUDA, reason="the interpreter case; the GPU ones are below")
def test_split_goes_to_the_norm_and_gate_up_is_gated_in_the_interpreter(monkeypatch):
    """One fp32 row through the CUDA-core GEMV (the interpreter): an 8-bit 2048-column projection to 16 channels
    splits K in two, and with defer_reduce comes back as PartialSums that the add + RMSNorm turns into exactly what it
    makes of the reduced output; the gate/up projection's silu(gate) * up equals silu_and_mul of its output bit
    for bit. On the reference path (no Triton) the gated product is F.silu(gate) * up of the dequantized one."""
    import tandem.kernels.triton_quant as quant
    from tandem.kernels.triton_fused import silu_and_mul_triton

    monkeypatch.setattr(quant, "DEFER_REDUCE", True)
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    down = int_linear(2048, 16, 8, "cpu", torch.float32, seed=0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2048, generator=gen)
    residual = torch.randn(1, 16, generator=gen)
    norm = RMSNorm(16)
    norm.weight.data = torch.rand(16, generator=gen) + 0.5
    parts = down(x, defer_reduce=True)
    assert isinstance(parts, PartialSums) and parts.ws.shape[0] == 2
    whole = down(x)
    assert isinstance(whole, torch.Tensor) and torch.equal(whole, parts.reduce())
    fused, new_residual = norm(parts, residual)
    want, want_residual = norm(whole, residual)
    assert torch.equal(fused, want) and torch.equal(new_residual, want_residual)
    torch.testing.assert_close(whole, x @ dequantized(down).T, rtol=1e-4, atol=1e-4)

    gate_up = int_linear(128, 2 * 16, 4, "cpu", torch.float32, seed=2)
    h = torch.randn(1, 128, generator=gen)
    gated = gate_up.forward_silu_and_mul(h)
    assert gated.shape == (1, 16) and torch.equal(gated, silu_and_mul_triton(gate_up(h)))
    monkeypatch.delenv("TANDEM_FORCE_TRITON")
    gate, up = (h @ dequantized(gate_up).T).chunk(2, dim=-1)
    torch.testing.assert_close(gate_up.forward_silu_and_mul(h), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gated, F.silu(gate) * up, rtol=1e-4, atol=1e-5)


def _bf16_row(k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_gated_gemv_equals_gemv_then_silu_and_mul(bits):
    """The Llama-3-8B gate/up projection at one bf16 row: the gated tensor-core GEMV writes what the GEMV followed
    by silu_and_mul writes (the same tile: a gate block and its up block are two row blocks of it, so the same
    fp32 sums, rounded to bf16 at the same places); a small one whose K the gated config splits adds its splits
    in the kernel. Equal bit for bit but for the sigmoid, which two kernels' code computes: within one bf16 unit
    in the last place, and equal on nearly every channel."""
    from tandem.kernels.triton_fused import silu_and_mul_triton
    from tandem.kernels.triton_int_gemv_mma import int_mma_gemv, mma_gemv_config, use_mma_gemv

    for n, k in [(28672, 4096), (2 * 512, 4096)]:
        layer = int_linear(k, n, bits, "cuda", torch.bfloat16, seed=n)
        x = _bf16_row(k, seed=k)
        weight = layer._kernel_int_weight(x)
        assert use_mma_gemv(x, weight)
        cfg = mma_gemv_config(n, k, bits, torch.cuda.get_device_properties(0).multi_processor_count, gated=True)
        fused = int_mma_gemv(x, weight, gated=True)
        unfused = silu_and_mul_triton(int_mma_gemv(x, weight, config=cfg))
        torch.testing.assert_close(fused, unfused, rtol=2**-7, atol=0)
        assert (fused == unfused).float().mean() > 0.999, (n, k, cfg)
        assert torch.equal(layer.forward_silu_and_mul(x), fused)
        gate, up = (x.float() @ dequantized(layer).T).chunk(2, dim=-1)
        ref = F.silu(gate) * up
        torch.testing.assert_close(fused.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_split_is_deferred_or_folded_and_replays(monkeypatch):
    """At one bf16 row: down_proj's K split comes back as PartialSums and the add + RMSNorm makes of them what it
    makes of the reduced output; qkv's split, which nothing defers, is added by the GEMV's last program, equal to
    the reduce kernel's output (TANDEM_INT_MMA_FOLD_REDUCE=0), also when a CUDA graph replays it (the arrival
    counters are zero again after every launch)."""
    import tandem.kernels.triton_quant as quant

    monkeypatch.setattr(quant, "DEFER_REDUCE", True)
    down = int_linear(14336, 4096, 4, "cuda", torch.bfloat16, seed=3)
    x = _bf16_row(14336, seed=4)
    residual = _bf16_row(4096, seed=5)
    norm = RMSNorm(4096).cuda().to(torch.bfloat16)
    parts = down(x, defer_reduce=True)
    assert isinstance(parts, PartialSums) and parts.ws.shape[0] > 1
    whole = down(x)
    fused, new_residual = norm(parts, residual)
    want, want_residual = norm(whole, residual)
    assert torch.equal(fused, want) and torch.equal(new_residual, want_residual)

    qkv = int_linear(4096, 6144, 4, "cuda", torch.bfloat16, seed=6)
    h = _bf16_row(4096, seed=7)
    folded = qkv(h)
    monkeypatch.setenv("TANDEM_INT_MMA_FOLD_REDUCE", "0")
    assert torch.equal(folded, qkv(h))
    monkeypatch.delenv("TANDEM_INT_MMA_FOLD_REDUCE")
    static = h.clone()
    qkv(static)  # warm-up: compiles, and makes the counters before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qkv(static)
    for seed in (8, 9, 8):
        static.copy_(_bf16_row(4096, seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, qkv(static))
