"""The sorted decode LoRA kernels: the step's grouping of tokens by slot, and the shrink and expand that take one
slot's rows a program, against the PyTorch reference (interpreter on CPU in fp32 / fp16, compiled on GPU); the
dispatch through the pool's index; and, on a GPU, bf16 against the one-block kernels, eager and captured."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.lora import (SORTED_CHUNK, SORTED_MAX_ROWS, index_token_slots, lora_add_ref, lora_counters,
                                 lora_shrink_ref, slot_groups, sorted_max_chunks)
from tandem.kernels.triton_lora import ONE_BLOCK_MAX
from tandem.kernels.triton_lora_sorted import lora_expand_sorted_triton, lora_shrink_sorted_triton
from tests.kernels.sm90 import compile_sm90
from tests.sweeps import pairwise

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NUM_SLOTS = 6
STALE = 4  # index entries past the step's tokens, holding an earlier step's slots


def step_slots(n: int, mix: str) -> torch.Tensor:
    """A step's per-token slots: "mixed" (none, several slots interleaved, a run of one), "one" (every token on
    slot 3), "distinct" (each token its own slot, n <= NUM_SLOTS; none past them)."""
    if mix == "one":
        values = [3] * n
    elif mix == "distinct":
        values = [(NUM_SLOTS - 1 - i) if i < NUM_SLOTS else -1 for i in range(n)]
    else:
        values = [(2, -1, 5, 0, 2, 2, -1, 1, 4, 0, 2)[i % 11] for i in range(n)]
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def grouped(slots: torch.Tensor):
    """The static index (stale entries past the step) and its grouping, as the pool makes them each step."""
    index = torch.full((slots.shape[0] + STALE,), 1, dtype=torch.int32, device=DEVICE)
    groups = slot_groups(NUM_SLOTS, index.shape[0], torch.device(DEVICE))
    groups.chunks.fill_(7)  # the grouping must overwrite every row
    index_token_slots(slots, index, groups)
    return index, groups


def expected_groups(slots: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """Token indices by (slot, index), none last; each slot's span cut into SORTED_CHUNK-row chunks, then the
    span of the tokens without an adapter (slot -1)."""
    key = [s if 0 <= s < NUM_SLOTS else NUM_SLOTS for s in slots.tolist()]
    rows = sorted(range(len(key)), key=lambda t: (key[t], t))
    chunks, start = [], 0
    for slot in range(NUM_SLOTS + 1):
        end = start + key.count(slot)
        name = -1 if slot == NUM_SLOTS else slot
        chunks += [[name, c, min(c + SORTED_CHUNK, end)] for c in range(start, end, SORTED_CHUNK)]
        start = end
    return rows, chunks + [[0, 0, 0]] * (sorted_max_chunks(NUM_SLOTS) - len(chunks))


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    monkeypatch.delenv("TANDEM_LORA_SORTED", raising=False)


@pytest.mark.parametrize("n,mix", [(1, "mixed"), (5, "distinct"), (17, "mixed"), (64, "mixed"), (64, "one"),
                                   (128, "mixed")])
def test_grouping_orders_tokens_by_slot(n, mix):
    """One kernel copies the step's slots into the index (leaving the entries past them), orders the tokens by slot
    (in token order within a slot, tokens without an adapter last) and lists the chunks of up to SORTED_CHUNK rows
    each slot in use makes, then those of the tokens without one."""
    slots = step_slots(n, mix)
    index, groups = grouped(slots)
    assert torch.equal(index[:n], slots) and index[n:].eq(1).all()
    rows, chunks = expected_groups(slots)
    assert groups.num_tokens == n
    assert groups.rows[:n].tolist() == rows
    assert groups.chunks.tolist() == chunks


def test_grouping_only_where_the_sorted_kernels_run(monkeypatch):
    """Past SORTED_MAX_ROWS tokens, with one slot, or with TANDEM_LORA_SORTED=0 the index is copied alone and the
    one-block kernels run; a later decode step groups again."""
    assert SORTED_MAX_ROWS == ONE_BLOCK_MAX
    index = torch.full((SORTED_MAX_ROWS + 8,), -1, dtype=torch.int32, device=DEVICE)
    groups = slot_groups(NUM_SLOTS, index.shape[0], torch.device(DEVICE))
    prefill = step_slots(SORTED_MAX_ROWS + 1, "mixed")
    index_token_slots(prefill, index, groups)
    assert groups.num_tokens == 0 and torch.equal(index[: prefill.shape[0]], prefill)
    index_token_slots(step_slots(8, "mixed"), index, groups)
    assert groups.num_tokens == 8
    monkeypatch.setenv("TANDEM_LORA_SORTED", "0")
    index_token_slots(step_slots(8, "one"), index, groups)
    assert groups.num_tokens == 0 and index[:8].eq(3).all()
    monkeypatch.delenv("TANDEM_LORA_SORTED")
    single = slot_groups(1, index.shape[0], torch.device(DEVICE))
    index_token_slots(torch.zeros(8, dtype=torch.int32, device=DEVICE), index, single)
    assert single.num_tokens == 0 and index[:8].eq(0).all()


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32 and not CUDA:
        return dict(atol=1e-4, rtol=1e-4)
    return dict(atol=2e-2, rtol=2e-2)  # fp16; a GPU's fp32 tile products round their inputs to TF32


def operands(n: int, k: int, out: int, cols: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(NUM_SLOTS, cols, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    b = (torch.randn(NUM_SLOTS, out, cols, generator=gen) * 0.2).to(DEVICE, dtype)
    y = torch.randn(n, out, generator=gen).to(DEVICE, dtype)
    return x, a, b, y


# (rows, slot mix), (rank, parts: rank columns parts x rank), dtype: every pair on the CPU.
@pytest.mark.parametrize("n,mix,rank,parts,dtype", pairwise(
    [(1, "mixed"), (5, "distinct"), (17, "mixed"), (64, "mixed"), (40, "one")], [(8, 3), (16, 1), (32, 2)],
    [torch.float32, torch.float16]))
def test_sorted_kernels_match_reference(n, mix, rank, parts, dtype):
    """Shrink (whole K, and K split in three, added in split order: the same bits twice) then expand over the
    grouped rows give the reference; rows without an adapter keep y's bits and their rank columns are not read."""
    k, out, cols = 80, 72, rank * parts
    x, a, b, y = operands(n, k, out, cols, dtype, seed=n * 10 + rank)
    slots = step_slots(n, mix)
    index, groups = grouped(slots)
    close = tolerance(dtype)
    counters = lora_counters(NUM_SLOTS, x.device)
    adapted = slots >= 0
    whole = lora_shrink_sorted_triton(x, a, groups, counters, block_k=32, splits=1)
    split = lora_shrink_sorted_triton(x, a, groups, counters, block_k=32, splits=3)
    assert not counters.any()  # each (slot, rank tile)'s last split reset its counter
    assert torch.equal(lora_shrink_sorted_triton(x, a, groups, counters, block_k=32, splits=3)[adapted],
                       split[adapted])
    ref = lora_shrink_ref(x, a, index)
    torch.testing.assert_close(whole[adapted], ref[adapted], **close)
    torch.testing.assert_close(split[adapted], ref[adapted], **close)
    split[~adapted] = float("nan")  # unwritten there: the expand must not read them
    got = lora_expand_sorted_triton(y.clone(), split, b, groups, block_n=32)
    expected = lora_add_ref(y.double(), x.double(), a.double(), b.double(), index[:n])
    torch.testing.assert_close(got.double(), expected, **close)
    assert torch.equal(got[~adapted], y[~adapted])


@pytest.mark.parametrize("n,mix,parts,dtype", [(17, "mixed", 2, torch.float32), (5, "distinct", 1, torch.float16),
                                               (40, "one", 2, torch.float16), (64, "mixed", 1, torch.float32)])
def test_gated_expand_is_expand_then_silu_and_mul(n, mix, parts, dtype):
    """The gate/up projection's one kernel (delta, then silu(gate) * up) gives what the expand and silu_and_mul
    give, on every row, those without an adapter included: B in the pool's two-part layout (each half of the
    rows on its own rank columns) or one part."""
    from tandem.kernels.ops import silu_and_mul
    from tandem.kernels.triton_lora_sorted import lora_expand_gated_sorted_triton

    k, inter, rank = 48, 40, 8
    cols = rank * parts
    x, a, b, y = operands(n, k, 2 * inter, cols, dtype, seed=n + parts)
    if parts == 2:  # gate rows on columns [0, rank), up rows on [rank, 2 rank), as pack_adapter lays them out
        b[:, :inter, rank:] = 0
        b[:, inter:, :rank] = 0
    slots = step_slots(n, mix)
    index, groups = grouped(slots)
    shrink = lora_shrink_sorted_triton(x, a, groups, splits=2)
    shrink[slots < 0] = float("nan")  # unwritten there: the gated expand must not read them
    expected = silu_and_mul(lora_expand_sorted_triton(y.clone(), shrink, b, groups))
    got = lora_expand_gated_sorted_triton(y, shrink, b, groups, parts, block_n=16)
    assert got.shape == (n, inter)
    if CUDA:
        assert torch.equal(got, expected)
    else:  # the interpreter's products may add the zero columns in another order
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    none = slots < 0
    assert torch.equal(got[none], silu_and_mul(y[none]))


@pytest.mark.parametrize("sorted_kernels", [True, False])
def test_delta_goes_into_deferred_partial_sums(sorted_kernels):
    """A split-K GEMM's PartialSums (handed on to the add + RMSNorm): the delta goes into the first split, so the
    splits' sum is the base output plus the delta (the sorted kernels, or the one-block ones of a step not
    grouped); a scaled (FP8) GEMM's partial sums are refused."""
    from tandem.kernels.fp8 import PartialSums
    from tandem.kernels.lora import lora_add

    n, k, out, cols = 12, 40, 24, 8
    x, a, b, _ = operands(n, k, out, cols, torch.float32, seed=6)
    slots = step_slots(n, "mixed")
    index, groups = grouped(slots)
    if not sorted_kernels:
        groups = None
    ws = torch.randn(3, n, out, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    base = PartialSums(ws.clone(), None, None, torch.float32).reduce()
    got = lora_add(PartialSums(ws.clone(), None, None, torch.float32), x, a, b, index, groups=groups)
    assert isinstance(got, PartialSums)
    expected = lora_add_ref(base.double(), x.double(), a.double(), b.double(), index[:n])
    torch.testing.assert_close(got.reduce().double(), expected, **tolerance(torch.float32))
    scaled = PartialSums(ws.clone(), torch.ones(out, 1, device=DEVICE), None, torch.float32)
    with pytest.raises(ValueError, match="FP8"):
        lora_add(scaled, x, a, b, index, groups=groups)


def test_sorted_kernels_leave_out_rows_past_the_projection():
    """A grouping made over more tokens than a projection's rows: the rows past them are neither read nor written
    (the one-block kernels read the index's first rows the same way)."""
    n, k, out, cols = 9, 48, 40, 16
    x, a, b, y = operands(n, k, out, cols, torch.float32, seed=2)
    slots = step_slots(n + 3, "mixed")
    index, groups = grouped(slots)
    shrink = lora_shrink_sorted_triton(x, a, groups, splits=2)
    got = lora_expand_sorted_triton(y.clone(), shrink, b, groups)
    expected = lora_add_ref(y.double(), x.double(), a.double(), b.double(), index[:n])
    torch.testing.assert_close(got.double(), expected, **tolerance(torch.float32))


def test_pool_linear_runs_the_sorted_kernels(monkeypatch):
    """A target Linear of a LoRAPool after select: base output plus each token's delta through the sorted kernels,
    the gated path too, and the same within rounding with TANDEM_LORA_SORTED=0 (the one-block kernels)."""
    from tandem.layers.activation import silu_and_mul
    from tandem.layers.linear import Linear
    from tandem.lora.pool import LoRAPool

    monkeypatch.setenv("TANDEM_LORA_FUSED", "0")  # the separate shrink and expand at every row count
    n, k, out, cols = 12, 64, 48, 16
    x, a, b, _ = operands(n, k, out, cols, torch.float32, seed=4)
    linear = Linear(k, out).to(DEVICE)
    linear.weight.data = torch.randn(out, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    pool = LoRAPool({"proj": linear}, NUM_SLOTS, cols, 32, torch.float32, torch.device(DEVICE))
    pool.slots["proj"][0].copy_(a)
    pool.slots["proj"][1].copy_(b)
    slots = step_slots(n, "mixed")
    pool.select(slots)
    assert pool.groups.num_tokens == n
    expected = lora_add_ref(x.double() @ linear.weight.double().t(), x.double(), a.double(), b.double(), slots)
    close = dict(atol=1e-4, rtol=1e-4) if not CUDA else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(linear(x).double(), expected, **close)
    torch.testing.assert_close(linear.forward_silu_and_mul(x).double(), silu_and_mul(expected), **close)
    monkeypatch.setenv("TANDEM_LORA_SORTED", "0")
    pool.select(slots)
    assert pool.groups.num_tokens == 0
    torch.testing.assert_close(linear(x).double(), expected, **close)


def test_pool_linear_defers_its_reduce_with_the_delta(monkeypatch):
    """A target Linear whose output goes only into the add + RMSNorm (defer_reduce) at decode sizes: the skinny
    GEMM's partial sums come back with the delta in them, no reduce kernel run, and sum to base + delta."""
    from tandem.kernels.fp8 import PartialSums
    from tandem.layers.linear import Linear
    from tandem.lora.pool import LoRAPool

    monkeypatch.setenv("TANDEM_LORA_FUSED", "0")
    n, k, out, cols = 12, 1024, 32, 16
    x, a, b, _ = operands(n, k, out, cols, torch.float16, seed=8)
    linear = Linear(k, out).to(DEVICE, torch.float16)
    linear.weight.data = (torch.randn(out, k, generator=torch.Generator().manual_seed(9)) * k**-0.5).to(
        DEVICE, torch.float16)
    pool = LoRAPool({"proj": linear}, NUM_SLOTS, cols, 32, torch.float16, torch.device(DEVICE))
    pool.slots["proj"][0].copy_(a)
    pool.slots["proj"][1].copy_(b)
    slots = step_slots(n, "mixed")
    pool.select(slots)
    got = linear(x, defer_reduce=True)
    assert isinstance(got, PartialSums) and got.ws.shape[0] > 1
    expected = lora_add_ref(x.double() @ linear.weight.double().t(), x.double(), a.double(), b.double(), slots)
    torch.testing.assert_close(got.reduce().double(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.reduce(), linear(x), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("n", [1, 12])
def test_fp8_linear_with_adapters_takes_rows_in_the_model_dtype(monkeypatch, n):
    """An FP8 target Linear with a LoRAPool: producers no longer hand it quantized rows (takes_fp8_rows), and its
    output is the FP8 product plus each token's delta, plain and gated: one row through the FP8 GEMV's epilogue,
    more through the FP8 product and the sorted kernels."""
    from tandem.layers.activation import silu_and_mul
    from tandem.layers.linear import Linear
    from tandem.lora.pool import LoRAPool

    k, out, cols = 64, 48, 16
    x, a, b, _ = operands(n, k, out, cols, torch.float16, seed=11)
    linear = Linear(k, out).to(DEVICE, torch.float16)
    linear.weight.data = (torch.randn(out, k, generator=torch.Generator().manual_seed(12)) * k**-0.5).to(
        DEVICE, torch.float16)
    assert linear.quantize_fp8_() and linear.takes_fp8_rows
    base, gated_base = linear(x), linear.forward_silu_and_mul(x)
    pool = LoRAPool({"proj": linear}, NUM_SLOTS, cols, 32, torch.float16, torch.device(DEVICE))
    assert not linear.takes_fp8_rows
    pool.slots["proj"][0].copy_(a)
    pool.slots["proj"][1].copy_(b)
    slots = step_slots(n, "mixed")
    pool.select(slots)
    expected = lora_add_ref(base.double(), x.double(), a.double(), b.double(), slots)
    close = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(linear(x).double(), expected, **close)
    torch.testing.assert_close(linear.forward_silu_and_mul(x).double(), silu_and_mul(expected.half()).double(),
                               **close)
    assert not torch.allclose(gated_base.double(), silu_and_mul(expected.half()).double(), **close)


_COMPILE_SM90 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_lora_sorted import (_group_kernel, _sorted_shrink_kernel, _sorted_expand_kernel,
                                               _sorted_expand_gated_kernel)

def build(fn, types, constexprs, warps):
    sig = dict(zip(fn.arg_names, types + ["constexpr"] * len(constexprs)))
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    return {"local": "ld.local" in k.asm["ptx"], "shared": k.metadata.shared}

out = {"group": build(_group_kernel, ["*i32"] * 4 + ["i32"] * 3, dict(BLOCK_T=128, SLOTS_P2=64, CHUNKS_P2=128,
                                                                        CHUNK=16), 4)}
for splits, bk, warps in ((16, 128, 4), (1, 256, 4), (8, 256, 8)):
    out[f"shrink-{splits}-{bk}-{warps}"] = build(_sorted_shrink_kernel, ["*bf16", "*bf16", "*i32", "*i32", "*fp32",
        "*fp32", "*i32"] + ["i32"] * 9, dict(SPLITS=splits, BLOCK_M=16, BLOCK_R=64, BLOCK_K=bk, USE_PDL=2), warps)
for bn, warps in ((64, 4), (256, 4), (512, 8)):
    out[f"expand-{bn}-{warps}"] = build(_sorted_expand_kernel, ["*fp32", "*bf16", "*i32", "*i32", "*bf16"]
        + ["i32"] * 7, dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_R=64, USE_PDL=2), warps)
for bn, warps in ((64, 4), (256, 4)):
    out[f"gated-{bn}-{warps}"] = build(_sorted_expand_gated_kernel, ["*fp32", "*bf16", "*i32", "*i32", "*bf16",
        "*bf16"] + ["i32"] * 9, dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_R=16, USE_PDL=2), warps)
json.dump(out, sys.stdout)
"""


def test_sorted_kernels_compile_for_sm90():
    """The grouping, the shrink (split K or not), the expand (the tiles the benchmark sweeps) and the gated expand
    compile for Hopper
    without a GPU: no local memory (spills), shared memory within the 227 KiB a block may have."""
    for name, info in compile_sm90(_COMPILE_SM90).items():
        assert not info["local"] and info["shared"] <= 227 * 1024, (name, info)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,used", [(32, 8), (64, 16), (64, 1), (7, 16)])
def test_gpu_sorted_kernels_match_one_block_kernels_eager_and_captured(n, used):
    """bf16 on the Llama-3-8B gate_up shape, 16 slots: the sorted kernels give the reference within bf16 rounding
    and the one-block kernels' result within one rounding; a CUDA graph of the grouping, shrink and expand,
    replayed under new slot mixes, gives the eager bits."""
    from tandem.kernels.triton_lora import lora_add_triton

    k, out, cols, num_slots = 4096, 28672, 32, 16
    gen = torch.Generator().manual_seed(n + used)
    x = torch.randn(n, k, generator=gen).to(DEVICE, torch.bfloat16)
    a = (torch.randn(num_slots, cols, k, generator=gen) * k**-0.5).to(DEVICE, torch.bfloat16)
    b = (torch.randn(num_slots, out, cols, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
    y0 = (torch.randn(n, out, generator=gen) * 0.1).to(DEVICE, torch.bfloat16)
    step = torch.tensor([(i % (used + 1)) - 1 if used > 1 else 5 for i in range(n)], dtype=torch.int32,
                        device=DEVICE)
    index = torch.full((128,), -1, dtype=torch.int32, device=DEVICE)
    groups = slot_groups(num_slots, 128, torch.device(DEVICE))
    counters = lora_counters(num_slots, x.device)

    def sorted_step() -> torch.Tensor:
        index_token_slots(step, index, groups)
        y = y0.clone()
        return lora_expand_sorted_triton(y, lora_shrink_sorted_triton(x, a, groups, counters), b, groups)

    eager = sorted_step()
    expected = lora_add_ref(y0.double(), x.double(), a.double(), b.double(), step)
    torch.testing.assert_close(eager.double(), expected, atol=2e-2, rtol=2e-2)
    one_block = lora_add_triton(y0.clone(), x, a, b, index, lora_counters(num_slots, x.device))
    torch.testing.assert_close(eager, one_block, atol=1e-2, rtol=1e-2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = sorted_step()
    torch.cuda.synchronize()
    for seed in range(3):
        step.copy_(step.roll(seed + 1))
        if seed == 2:
            step[::3] = -1
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, sorted_step()), seed
    assert not counters.any()
