"""LoRA inside the decode GEMV: the shrink kernel (each row's own adapter rows) and the base GEMV that adds each
row's delta in its epilogue, plain and gated, against the base product plus lora_add_ref (interpreter on CPU in
fp32 / fp16, compiled on GPU); and a Linear that holds a LoRADelta taking that path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.lora import LoRAShrunk, lora_add_ref, lora_shrink_ref
from tandem.kernels.triton_gemv import gemv_triton, lora_shrink_triton
from tests.kernels.sm90 import compile_sm90

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NUM_SLOTS, MAX_RANK = 3, 16
# Slot per row: tokens without an adapter (-1), several adapters mixed, one adapter on adjacent rows.
SLOT_CYCLE = (1, -1, 2, 0, 2, -1, 1, 1)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def pool(n_out: int, k: int, ranks: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator):
    """A [slots, MAX_RANK, k] and B [slots, n_out, MAX_RANK] as the pool holds them: slot i's adapter of rank
    ranks[i] in the first columns, zeros in the rest (ranks below the maximum)."""
    a = torch.zeros(NUM_SLOTS, MAX_RANK, k)
    b = torch.zeros(NUM_SLOTS, n_out, MAX_RANK)
    for slot, r in enumerate(ranks):
        a[slot, :r] = torch.randn(r, k, generator=gen) * k**-0.5
        b[slot, :, :r] = torch.randn(n_out, r, generator=gen) * 0.2
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    a, b = pool(n, k, (16, 4, 9), dtype, gen)
    slots = torch.tensor([SLOT_CYCLE[i % len(SLOT_CYCLE)] for i in range(m)] + [-1] * 3, dtype=torch.int32,
                         device=DEVICE)  # longer than m: the static index's padding
    return x, w, a, b, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 96), (2, 300), (4, 128), (32, 72)])  # 300: K not a multiple of the tile
def test_shrink_matches_reference(dtype, m, k):
    x, _, a, _, slots = operands(m, 8, k, dtype, seed=m + k)
    got = lora_shrink_triton(x, a, slots)
    assert got.shape == (m, MAX_RANK) and got.dtype == torch.float32
    torch.testing.assert_close(got, lora_shrink_ref(x, a, slots), **tolerance(dtype))
    tiled = lora_shrink_triton(x, a, slots, block_k=32)  # several K tiles a program
    torch.testing.assert_close(tiled, got, **tolerance(dtype))
    assert not got[slots[:m] < 0].any()  # no adapter: zero rank columns, no weight read


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 4, 32])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_gemv_adds_each_rows_delta(dtype, m, gated):
    n, k = 48, 160
    x, w, a, b, slots = operands(m, n, k, dtype, seed=10 * m + gated)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype) if m == 3 else None
    base = gemv_triton(x, w, bias=bias)  # [m, n]: the base output as the unfused path rounds it
    expected = lora_add_ref(base.double(), x.double(), a.double(), b.double(), slots[:m])
    if gated:
        gate, up = expected.chunk(2, dim=-1)
        expected = F.silu(gate) * up
    shrunk = LoRAShrunk(lora_shrink_triton(x, a, slots), b, slots)
    for config in (None, {"BLOCK_N": 8, "BLOCK_K": 64}):  # gemv_config's tile, and several channels a program
        got = gemv_triton(x, w, bias=bias, gated=gated, config=config, lora=shrunk)
        assert got.shape == (m, n // 2 if gated else n) and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, **tolerance(dtype))
        plain = gemv_triton(x, w, bias=bias, gated=gated, config=config)
        none = slots[:m] < 0
        assert torch.equal(got[none], plain[none])  # a row without an adapter keeps the base output bit for bit


def test_gemv_lora_refuses_bad_shapes():
    x, w = torch.zeros(2, 16), torch.zeros(8, 16)
    slots = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="lora epilogue"):  # B's rows must be the weight's rows
        gemv_triton(x, w, lora=LoRAShrunk(torch.zeros(2, 4), torch.zeros(1, 6, 4), slots))
    with pytest.raises(ValueError, match="lora epilogue"):  # the shrink is fp32
        gemv_triton(x, w, lora=LoRAShrunk(torch.zeros(2, 4, dtype=torch.float16), torch.zeros(1, 8, 4), slots))
    with pytest.raises(ValueError, match="lora shrink"):
        lora_shrink_triton(x, torch.zeros(1, 4, 8), slots)


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_fuses_the_delta_into_its_gemv(monkeypatch, rows):
    """A LoRA target Linear at decode rows: its GEMV with the delta in the epilogue (the gate/up projection's
    gated GEMV too) gives the base output plus each token's delta, as the separate kernels do."""
    from tandem.layers.activation import silu_and_mul
    from tandem.layers.linear import Linear
    from tandem.lora.pool import LoRADelta

    if not CUDA:
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    x, w, a, b, slots = operands(rows, 64, 48, torch.float32, seed=rows)
    linear = Linear(48, 64).to(DEVICE)
    linear.weight.data = w
    linear.lora = LoRADelta(a, b, slots)
    expected = lora_add_ref(x.double() @ w.double().t(), x.double(), a.double(), b.double(), slots[:rows])
    fused, fused_gated = linear(x), linear.forward_silu_and_mul(x)
    torch.testing.assert_close(fused.double(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_gated.double(), silu_and_mul(expected), atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("TANDEM_LORA_FUSED", "0")  # the base kernel, then the shrink and expand kernels
    torch.testing.assert_close(linear(x), fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear.forward_silu_and_mul(x), fused_gated, atol=1e-5, rtol=1e-5)


_COMPILE_SM90 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_gemv import _lora_shrink_kernel

names = ["x_ptr", "a_ptr", "slots_ptr", "out_ptr", "M", "K", "R", "stride_xm", "stride_as", "stride_ar", "stride_om",
         "MASK_M", "EVEN_K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "VEC", "USE_PDL"]
out = {}
for block_m, block_k in ((1, 16384), (2, 8192), (4, 4096)):
    types = ["*bf16", "*bf16", "*i32", "*fp32"] + ["i32"] * 7 + ["constexpr"] * 7
    src = ASTSource(fn=_lora_shrink_kernel, signature=dict(zip(names, types)),
                    constexprs={"MASK_M": False, "EVEN_K": False, "BLOCK_M": block_m, "BLOCK_N": 1,
                                "BLOCK_K": block_k, "VEC": 8, "USE_PDL": 2},
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 3, 5, 7, 8, 9)})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    out[f"{block_m}-{block_k}"] = [l.split()[0] for l in ptx.splitlines() if l.strip().startswith(("ld.", "st."))]
json.dump(out, sys.stdout)
"""


def test_shrink_compiles_for_sm90_without_spills():
    """The shrink's tiles as lora_shrink_triton picks them at 1, 2 and 4 rows (a whole Llama K row in one tile)
    compile for Hopper with 16-byte loads of A and nothing in local memory."""
    for variant, ops in compile_sm90(_COMPILE_SM90).items():
        assert any(op.startswith("ld.global") and ".v4" in op for op in ops), (variant, ops)
        assert not any(op.startswith(("ld.local", "st.local")) for op in ops), (variant, ops)


# ----------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k,rank_cols,gated", [(6144, 4096, 48, False), (4096, 4096, 16, False),
                                                 (28672, 4096, 32, True), (4096, 14336, 16, False)])
def test_gpu_fused_lora_real_shapes(n, k, rank_cols, gated):
    """Llama-3-8B projections in bf16 at 1-4 rows over 16 slots: the fused GEMV equals the base GEMV followed by
    lora_add_triton's shrink and expand (both against the fp32 math), and a CUDA graph replays it."""
    from tandem.kernels.triton_lora import lora_add_triton

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(4, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
    a = (torch.randn(16, rank_cols, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
    b = (torch.randn(16, n, rank_cols, generator=gen, device="cuda") * 0.05).bfloat16()
    slots = torch.tensor([3, -1, 15, 3], dtype=torch.int32, device="cuda")
    for m in (1, 2, 3, 4):
        unfused = lora_add_triton(gemv_triton(x[:m], w), x[:m], a, b, slots)
        reference = lora_add_ref(x[:m].float() @ w.float().t(), x[:m].float(), a.float(), b.float(), slots[:m])
        if gated:
            unfused = F.silu(unfused[:, : n // 2].float()) * unfused[:, n // 2 :].float()
            gate, up = reference.chunk(2, dim=-1)
            reference = F.silu(gate) * up
        fused = gemv_triton(x[:m], w, gated=gated, lora=LoRAShrunk(lora_shrink_triton(x[:m], a, slots), b, slots))
        for got in (fused.float(), unfused.float()):
            rel = ((got - reference).norm() / reference.norm()).item()
            assert rel < 1e-2, (m, rel)
    static = x[:1].clone()
    graph = torch.cuda.CUDAGraph()
    eager = gemv_triton(static, w, gated=gated, lora=LoRAShrunk(lora_shrink_triton(static, a, slots), b, slots))
    with torch.cuda.graph(graph):
        captured = gemv_triton(static, w, gated=gated,
                               lora=LoRAShrunk(lora_shrink_triton(static, a, slots), b, slots))
    graph.replay()
    assert torch.equal(captured, eager)
