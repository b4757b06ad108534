"""The batched LoRA kernels (shrink / expand over a slot pool, per-token slots, -1 = none) against the PyTorch
reference and against a per-token loop (interpreter on CPU in fp32 / fp16, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.lora import lora_add_ref, lora_counters
from tandem.kernels.triton_lora import lora_add_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def per_token(y, x, a, b, slots):
    out = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += (x[t].double() @ a[s].double().t()) @ b[s].double().t()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,out,rank", [(5, 96, 80, 16), (3, 300, 130, 48), (1, 64, 64, 8), (40, 72, 40, 80)])
def test_lora_kernels_match_reference(dtype, n, k, out, rank):
    gen = torch.Generator().manual_seed(n * 1000 + k + rank)
    num_slots = 3
    x = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(num_slots, rank, k, generator=gen) * 0.1).to(DEVICE, dtype)
    b = (torch.randn(num_slots, out, rank, generator=gen) * 0.1).to(DEVICE, dtype)
    y = torch.randn(n, out, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([(-1, 0, 2, 1, 0)[i % 5] for i in range(n)] + [5] * 4, dtype=torch.int32, device=DEVICE)
    expected = per_token(y, x, a, b, slots[:n])
    ref = lora_add_ref(y.clone(), x, a, b, slots[:n])
    got = lora_add_triton(y.clone(), x, a, b, slots, block_k=64, block_n=32)  # slots longer than n: padding
    counters = lora_counters(num_slots, x.device)
    split = lora_add_triton(y.clone(), x, a, b, slots, counters, block_k=32, block_n=32, splits=3)  # K split in 3
    assert not counters.any()  # the last split of each slot reset its counter: the buffer serves the next call
    again = lora_add_triton(y.clone(), x, a, b, slots, counters, block_k=32, block_n=32, splits=3)
    assert torch.equal(again, split)  # the splits are added in split order, whichever program finishes last
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ref.double(), expected, **tol)
    if CUDA and dtype == torch.float32:  # the kernels' tile products round fp32 inputs to TF32 on a GPU
        tol = dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.double(), expected, **tol)
    torch.testing.assert_close(split.double(), expected, **tol)
    untouched = slots[:n] < 0
    assert torch.equal(got[untouched], y[untouched])  # a token without an adapter keeps its base output bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_token_block_kernels_match_reference(dtype):
    """Blocks of 16 tokens: whole blocks under one adapter (tile products), blocks that mix adapters or hold tokens
    without one (row by row), a block with none, and a ragged last block."""
    gen = torch.Generator().manual_seed(7)
    n, k, out, rank = 75, 96, 80, 24
    x = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(3, rank, k, generator=gen) * 0.1).to(DEVICE, dtype)
    b = (torch.randn(3, out, rank, generator=gen) * 0.1).to(DEVICE, dtype)
    y = torch.randn(n, out, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([2] * 16 + [-1] * 16 + [0] * 5 + [1] * 3 + [-1] * 8 + [1] * 16 + [0] * 11,
                         dtype=torch.int32, device=DEVICE)
    expected = per_token(y, x, a, b, slots)
    got = lora_add_triton(y.clone(), x, a, b, slots, block_m=16, block_k=32, block_n=32)  # 5 blocks
    exact = dtype == torch.float32 and not CUDA  # a GPU's fp32 tile products round their inputs to TF32
    tol = dict(atol=1e-4, rtol=1e-4) if exact else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), expected, **tol)
    assert torch.equal(got[16:32], y[16:32])


def test_lora_kernels_refuse_bad_shapes():
    x, a, b = torch.zeros(2, 8), torch.zeros(1, 4, 16), torch.zeros(1, 8, 4)
    with pytest.raises(ValueError, match="lora shapes"):
        lora_add_triton(torch.zeros(2, 8), x, a, b, torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("force_triton", [False, True], ids=["reference", "triton"])
def test_linear_adds_each_tokens_adapter(monkeypatch, force_triton):
    """A Linear holding a LoRADelta: base output plus, per token, its slot's (x A^T) B^T; the gated path too."""
    from tandem.layers.activation import silu_and_mul
    from tandem.layers.linear import Linear
    from tandem.lora.pool import LoRADelta

    if force_triton and not CUDA:
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    gen = torch.Generator().manual_seed(3)
    linear = Linear(48, 64).to(DEVICE)
    linear.weight.data = torch.randn(64, 48, generator=gen).to(DEVICE)
    a = (torch.randn(2, 8, 48, generator=gen) * 0.2).to(DEVICE)
    b = (torch.randn(2, 64, 8, generator=gen) * 0.2).to(DEVICE)
    slots = torch.tensor([1, -1, 0, 1, -1, -1], dtype=torch.int32, device=DEVICE)
    linear.lora = LoRADelta(a, b, slots)
    x = torch.randn(4, 48, generator=gen).to(DEVICE)
    expected = per_token(x @ linear.weight.t(), x, a, b, slots[:4]).float()
    torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear.forward_silu_and_mul(x), silu_and_mul(expected), atol=1e-4, rtol=1e-4)


def test_integer_weights_take_adapters_too():
    """A Linear with int8 codes (quantize_int_): its dequantized product plus each token's delta."""
    from tandem.layers.linear import Linear
    from tandem.lora.pool import LoRADelta

    gen = torch.Generator().manual_seed(5)
    linear = Linear(128, 64)
    linear.weight.data = torch.randn(64, 128, generator=gen)
    linear.quantize_int_(8)
    x = torch.randn(3, 128, generator=gen)
    base = linear(x)
    a, b = torch.randn(1, 4, 128, generator=gen) * 0.2, torch.randn(1, 64, 4, generator=gen) * 0.2
    slots = torch.tensor([0, -1, 0], dtype=torch.int32)
    linear.lora = LoRADelta(a, b, slots)
    torch.testing.assert_close(linear(x).double(), per_token(base, x, a, b, slots), atol=1e-4, rtol=1e-4)


_COMPILE_SM90 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_lora import _shrink_kernel, _expand_kernel
out = {}
sh = ["x_ptr","a_ptr","slots_ptr","part_ptr","out_ptr","count_ptr","M","K","R","K_PER_SPLIT","stride_xm","stride_as","stride_ar","stride_ps","stride_om"]
sht = ["*bf16","*bf16","*i32","*fp32","*fp32","*i32"] + ["i32"]*9
for splits, bm in ((16, 16), (1, 64)):
    ce = dict(SPLITS=splits, BLOCK_M=bm, BLOCK_R=64, BLOCK_K=128 if bm == 16 else 128, SLOTS_P2=16, USE_PDL=2)
    sig = dict(zip(sh, sht)); sig.update({k: "constexpr" for k in ce})
    k = triton.compile(ASTSource(fn=_shrink_kernel, signature=sig, constexprs=ce), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out[f"shrink-{splits}-{bm}"] = {"local": "ld.local" in k.asm["ptx"], "shared": k.metadata.shared}
ex = ["s_ptr","b_ptr","slots_ptr","y_ptr","M","N","R","stride_sm","stride_bs","stride_bn","stride_ym"]
ext = ["*fp32","*bf16","*i32","*bf16"] + ["i32"]*7
for bm, bn in ((16, 64), (64, 64), (16, 256), (64, 256)):
    ce = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=64, SLOTS_P2=16, USE_PDL=2)
    sig = dict(zip(ex, ext)); sig.update({k: "constexpr" for k in ce})
    k = triton.compile(ASTSource(fn=_expand_kernel, signature=sig, constexprs=ce), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8 if bm >= 64 else 4})
    out[f"expand-{bm}-{bn}"] = {"local": "ld.local" in k.asm["ptx"], "shared": k.metadata.shared}
json.dump(out, sys.stdout)
"""


def test_kernels_compile_for_sm90():
    """The shrink (decode: split K; prefill: token blocks) and the expand compile for Hopper without a GPU: no
    local memory (spills), shared memory within the 227 KiB a block may have."""
    from tests.kernels.sm90 import compile_sm90

    for name, info in compile_sm90(_COMPILE_SM90).items():
        assert not info["local"] and info["shared"] <= 227 * 1024, (name, info)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_shrink_beside_the_base_projection_gives_the_serial_bits():
    """lora_add_beside (the shrink on a side stream while the base product runs, the expand after the join) gives
    the bits of the base product then lora_add on one stream, eagerly and replayed from a CUDA graph whose inputs
    change between replays."""
    from tandem.kernels.lora import lora_add, lora_add_beside

    gen = torch.Generator().manual_seed(3)
    n, k, out, rank, num_slots = 32, 4096, 6144, 48, 16
    x = torch.randn(n, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(out, k, generator=gen) * k**-0.5).to(DEVICE, torch.bfloat16)
    a = (torch.randn(num_slots, rank, k, generator=gen) * k**-0.5).to(DEVICE, torch.bfloat16)
    b = (torch.randn(num_slots, out, rank, generator=gen) * 0.1).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([(i % 9) - 1 for i in range(n)], dtype=torch.int32, device=DEVICE)
    side, side_counters = torch.cuda.Stream(), lora_counters(num_slots, x.device)

    def serial() -> torch.Tensor:
        return lora_add(x @ w.t(), x, a, b, slots, lora_counters(num_slots, x.device))

    def beside() -> torch.Tensor:
        return lora_add_beside(x, lambda: x @ w.t(), a, b, slots, side_counters, side)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        eager = beside()
        torch.cuda.current_stream().synchronize()
        assert torch.equal(eager, serial())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = beside()
    for seed in range(3):
        x.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16))
        slots.copy_(slots.roll(seed + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, serial()), seed
    assert not side_counters.any()
