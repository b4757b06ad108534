"""LoRA inside the decode kernels: the shrink kernels (each row's own adapter rows; token blocks), the base GEMV
and the skinny tile GEMM that add each row's delta in their epilogue, plain, gated and split over K, against the
base product plus lora_add_ref (interpreter on CPU in fp32 / fp16, compiled on GPU); and a Linear that holds a
LoRADelta taking those paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.lora import LoRAShrunk, lora_add_ref, lora_shrink_ref
from tandem.kernels.triton_gemv import gemv_triton, lora_shrink_triton
from tandem.kernels.triton_lora import lora_shrink_block_triton
from tandem.kernels.triton_quant import skinny_matmul_triton
from tests.kernels.sm90 import compile_sm90
from tests.sweeps import pairwise

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


# Every pair of values on the CPU (tests/sweeps.py), the cross product on a GPU.
@pytest.mark.parametrize("gated,m,dtype", pairwise([False, True], [1, 3, 4, 32], [torch.float32, torch.float16]),
                         ids=lambda v: ("gated" if v else "plain") if isinstance(v, bool) else str(v))
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


def widen(a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, places: tuple[int, ...], num_slots: int):
    """The same adapters in a pool of num_slots slots, slot i moved to places[i] (the others empty)."""
    wide_a = a.new_zeros(num_slots, *a.shape[1:])
    wide_b = b.new_zeros(num_slots, *b.shape[1:])
    index = torch.tensor(places, device=a.device)
    wide_a[index], wide_b[index] = a, b
    moved = torch.where(slots >= 0, index[slots.clamp(min=0).long()].to(slots.dtype), slots)
    return wide_a, wide_b, moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,pool_slots", [(8, 3), (32, 3), (32, 20)])
def test_skinny_gemm_adds_each_rows_delta(dtype, m, pool_slots):
    """The swap-AB tile GEMM with the delta in its first K split's sums: whole K, split in two (through the reduce
    kernel, and handed on as PartialSums), and gated; the token-block shrink feeds it; in a pool of 20 slots too,
    with slots up to 19 in use."""
    if CUDA and dtype == torch.float32:
        pytest.skip("fp32 tensor-core dots round to TF32 on a GPU: the skinny GEMM runs 16-bit rows only there")
    n, k = 128, 256
    x, w, a, b, slots = operands(m, n, k, dtype, seed=m + 1)
    if pool_slots != NUM_SLOTS:
        a, b, slots = widen(a, b, slots, (5, 19, 12), pool_slots)
    shrink = lora_shrink_block_triton(x, a, slots)
    none = slots[:m] < 0
    # rows without an adapter are left unwritten (the epilogues never read them)
    torch.testing.assert_close(shrink[~none], lora_shrink_ref(x, a, slots)[~none], **tolerance(dtype))
    shrunk = LoRAShrunk(shrink, b, slots)
    expected = lora_add_ref(x.double() @ w.double().t(), x.double(), a.double(), b.double(), slots[:m])
    for split in (1, 2):
        tile = {"SPLIT_K": split, "BLOCK_K": 64}
        got = skinny_matmul_triton(x, w, None, tile=tile, lora=shrunk)
        torch.testing.assert_close(got.double(), expected, **tolerance(dtype))
        plain = skinny_matmul_triton(x, w, None, tile=tile)
        assert torch.equal(got[none], plain[none])  # a row without an adapter keeps the base output bit for bit
        parts = skinny_matmul_triton(x, w, None, tile=tile, defer=True, lora=shrunk)
        assert isinstance(parts, PartialSums) == (split > 1)
        if split > 1:  # the norm after o_proj / down_proj adds the partial sums, the delta among them
            assert torch.equal(parts.reduce(), got)
    gate, up = expected.chunk(2, dim=-1)
    gated = skinny_matmul_triton(x, w, None, tile={"BLOCK_K": 64}, gated=True, lora=shrunk)
    torch.testing.assert_close(gated.double(), F.silu(gate) * up, **tolerance(dtype))


def test_gemv_lora_refuses_bad_shapes():
    x, w = torch.zeros(2, 16), torch.zeros(8, 16)
    slots = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="lora epilogue"):  # B's rows must be the weight's rows
        gemv_triton(x, w, lora=LoRAShrunk(torch.zeros(2, 4), torch.zeros(1, 6, 4), slots))
    with pytest.raises(ValueError, match="lora epilogue"):  # the shrink is fp32
        gemv_triton(x, w, lora=LoRAShrunk(torch.zeros(2, 4, dtype=torch.float16), torch.zeros(1, 8, 4), slots))
    with pytest.raises(ValueError, match="lora shrink"):
        lora_shrink_triton(x, torch.zeros(1, 4, 8), slots)
    with pytest.raises(ValueError, match="skinny lora epilogue"):
        skinny_matmul_triton(x, w, None, lora=LoRAShrunk(torch.zeros(2, 4), torch.zeros(1, 6, 4), slots))


@pytest.mark.parametrize("rows", [1, 3, 8, 40])  # the GEMV's rows, the skinny GEMM's, past them (with the setting)
def test_linear_fuses_the_delta_into_its_gemv(monkeypatch, rows):
    """A LoRA target Linear at decode rows: its GEMV or skinny GEMM with the delta in the epilogue (the gate/up
    projection's gated kernel too) gives the base output plus each token's delta, as the separate kernels do."""
    from tandem.layers.activation import silu_and_mul
    from tandem.layers.linear import Linear
    from tandem.lora.pool import LoRADelta

    if not CUDA:
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    # fp32, but 16-bit rows on a GPU past the GEMV's: its skinny GEMM takes no fp32 there (TF32 dots)
    dtype = torch.float16 if CUDA and rows > 4 else torch.float32
    close = tolerance(dtype)
    x, w, a, b, slots = operands(rows, 32, 48, dtype, seed=rows)
    linear = Linear(48, 32).to(DEVICE, dtype)
    linear.weight.data = w
    linear.lora = LoRADelta(a, b, slots)
    if rows > 4:
        assert linear._fused_lora(x) is None  # the skinny GEMM's epilogue is off by default
        monkeypatch.setenv("TANDEM_LORA_FUSED_SKINNY", "1")
    if rows > 32:
        assert linear._fused_lora(x) is None  # past the skinny GEMM's rows: cuBLAS and the separate kernels
        monkeypatch.setenv("TANDEM_LORA_SKINNY_MAX_ROWS", "64")
    assert linear._fused_lora(x) == ("gemv" if rows <= 4 else "skinny")
    expected = lora_add_ref(x.double() @ w.double().t(), x.double(), a.double(), b.double(), slots[:rows])
    fused, fused_gated = linear(x), linear.forward_silu_and_mul(x)
    torch.testing.assert_close(fused.double(), expected, **close)
    torch.testing.assert_close(fused_gated.double(), silu_and_mul(expected), **close)
    monkeypatch.setenv("TANDEM_LORA_FUSED", "0")  # the base kernel, then the shrink and expand kernels
    assert linear._fused_lora(x) is None
    same = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(linear(x), fused, **same)
    torch.testing.assert_close(linear.forward_silu_and_mul(x), fused_gated, **same)


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
    # An instruction's first word, past a guard predicate such as `@%p3` (masked loads are guarded).
    lines = [l.split(None, 1)[1] if l.strip().startswith("@") else l.strip() for l in ptx.splitlines() if l.strip()]
    out[f"{block_m}-{block_k}"] = [l.split()[0] for l in lines if l.startswith(("ld.", "st."))]
from tandem.kernels.triton_quant import _swap_ab_kernel
skinny = {}

names = _swap_ab_kernel.arg_names
types = {"xq_ptr": "*bf16", "xs_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
         "ws_ptr": "*fp32", "oa_ptr": "*bf16", "ls_ptr": "*fp32", "lb_ptr": "*bf16", "lslot_ptr": "*i32"}
for gated, split, block_m in ((0, 2, 32), (1, 1, 32), (0, 4, 64), (1, 1, 64)):
    cx = {"HAS_BIAS": False, "EVEN_K": True, "SPLIT_K": split, "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128,
          "USE_PDL": 2, "HAS_SCALE": False, "X_SCALED": False, "GATED": gated, "PREFETCH_LINES": 4, "LINE_K": 64,
          "AMAX_OUT": False, "GROUP_K": 0, "LORA": True, "BLOCK_R": 64, "SLOTS_P2": 16}
    src = ASTSource(fn=_swap_ab_kernel, signature={n: types.get(n, "constexpr" if n in cx else "i32") for n in names},
                    constexprs=cx, attrs={(names.index(a),): [["tt.divisibility", 16]]
                                          for a in ("xq_ptr", "w_ptr", "K", "K_SPLIT", "stride_xm", "stride_wn")})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    lines = [l.split(None, 1)[1] if l.strip().startswith("@") else l.strip()
             for l in compiled.asm["ptx"].splitlines() if l.strip()]
    ops = [l.split()[0] for l in lines if l[:1].isalpha()]
    skinny[f"{gated}-{split}-{block_m}"] = {"ops": sorted(set(ops)), "shared": compiled.metadata.shared}
json.dump({"shrink": out, "skinny": skinny}, sys.stdout)
"""


def test_fused_kernels_compile_for_sm90_without_spills():
    """The shrink's tiles as lora_shrink_triton picks them at 1, 2 and 4 rows (a whole Llama K row in one tile)
    compile for Hopper with 16-byte loads of A; the skinny GEMM with the LoRA epilogue (split over K; gated; 32 and
    64 rows) keeps its bf16 tensor-core product; none keeps anything in local memory."""
    compiled = compile_sm90(_COMPILE_SM90)
    for variant, ops in compiled["shrink"].items():
        assert any(op.startswith("ld.global") and ".v4" in op for op in ops), (variant, ops)
        assert not any(op.startswith(("ld.local", "st.local")) for op in ops), (variant, ops)
    for variant, info in compiled["skinny"].items():
        assert any(op.startswith(("wgmma", "mma")) and "bf16" in op for op in info["ops"]), (variant, info)
        assert not any(op.startswith(("ld.local", "st.local")) for op in info["ops"]), (variant, info)
        assert info["shared"] <= 227 * 1024, (variant, info)


# ----------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k,rank_cols,gated", [(6144, 4096, 48, False), (4096, 4096, 16, False),
                                                 (28672, 4096, 32, True), (4096, 14336, 16, False)])
def test_gpu_fused_lora_real_shapes(n, k, rank_cols, gated):
    """Llama-3-8B projections in bf16 over 16 slots: at 1-4 rows the fused GEMV, at 8 and 32 rows (8 adapters and
    the base model) the fused skinny GEMM, each against the fp32 math as closely as the base kernel followed by
    lora_add_triton's shrink and expand; and a CUDA graph replays both fused paths bit for bit."""
    from tandem.kernels.lora import lora_shrink
    from tandem.kernels.triton_lora import lora_add_triton

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(32, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
    a = (torch.randn(16, rank_cols, k, generator=gen, device="cuda") * k**-0.5).bfloat16()
    b = (torch.randn(16, n, rank_cols, generator=gen, device="cuda") * 0.05).bfloat16()
    slots = torch.tensor([3, -1, 15, 3] + [i % 9 - 1 for i in range(28)], dtype=torch.int32, device="cuda")

    def fused(rows: torch.Tensor) -> torch.Tensor:
        shrunk = LoRAShrunk(lora_shrink(rows, a, slots), b, slots)
        if rows.shape[0] <= 4:
            return gemv_triton(rows, w, gated=gated, lora=shrunk)
        return skinny_matmul_triton(rows, w, None, gated=gated, lora=shrunk)

    for m in (1, 2, 3, 4, 8, 32):
        unfused = lora_add_triton(x[:m] @ w.t(), x[:m], a, b, slots).float()
        reference = lora_add_ref(x[:m].float() @ w.float().t(), x[:m].float(), a.float(), b.float(), slots[:m])
        if gated:
            unfused = F.silu(unfused[:, : n // 2]) * unfused[:, n // 2 :]
            gate, up = reference.chunk(2, dim=-1)
            reference = F.silu(gate) * up
        for got in (fused(x[:m]).float(), unfused):
            rel = ((got - reference).norm() / reference.norm()).item()
            assert rel < 1e-2, (m, rel)
    for m in (1, 32):
        static = x[:m].clone()
        eager = fused(static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused(static)
        graph.replay()
        assert torch.equal(captured, eager), m
