"""The fused MoE over 4- / 8-bit experts (triton_moe_int) against the per-expert loop (fused_moe_ref) over the same
experts dequantized: in the Triton interpreter on CPU (fp32 / fp16), both paths (sorted blocks and one pair a block),
ragged token counts, experts with no token, expert parallel; on a GPU in bf16, eager and from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import ops
from tandem.kernels.fp8 import PartialSums
from tandem.kernels.int_weight import IntWeight, dequantize_repacked
from tandem.kernels.moe_align import fused_moe_ref
from tandem.kernels.triton_moe import MoETile
from tandem.kernels.triton_moe_int import fused_moe_int_triton, int_moe_tile
from tandem.layers.int_quant import quantize_rtn_experts
from tests.kernels.test_triton_moe import make_moe, routing

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# Interpreter-sized tiles: 16 rows, 16 channels, K steps of 64 codes (two 32-code group parts at group 32).
TILE = MoETile(16, 16, 64, 4, 2)


def int_experts(num_experts: int, hidden: int, inter: int, bits: int, dtype: torch.dtype, group: int | None = None,
                seed: int = 0) -> tuple[IntWeight, IntWeight]:
    w13, w2 = make_moe(num_experts, hidden, inter, dtype, seed)
    return (quantize_rtn_experts(w13.to(DEVICE), bits, group, "w13"),
            quantize_rtn_experts(w2.to(DEVICE), bits, group, "w2"))


def unsorted(w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """A stack's dense experts in input-column order: stored column j of expert e reads input column perm[e, j]."""
    out = torch.empty_like(w)
    for e in range(w.shape[0]):
        out[e][:, perm[e]] = w[e]
    return out


def act_orders(local: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's own random input-column order for w13 (over hidden) and w2 (over inter), int64."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.stack([torch.randperm(hidden, generator=gen) for _ in range(local)]),
            torch.stack([torch.randperm(inter, generator=gen) for _ in range(local)]))


def check(num_tokens: int, bits: int, mode: str = "random", dtype: torch.dtype = torch.float32,
          pair_path: bool = False, num_experts: int = 6, top_k: int = 2, hidden: int = 128, inter: int = 96,
          group: int | None = 32, expert_map: torch.Tensor | None = None, into_norm: bool = False,
          act_order: bool = False) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    ids = routing(num_tokens, num_experts, top_k, mode, seed=bits)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    local = num_experts if expert_map is None else int((expert_map >= 0).sum())
    w13, w2 = int_experts(local, hidden, inter, bits, dtype, group)
    emap = None if expert_map is None else expert_map.to(DEVICE)
    dense13, dense2 = dequantize_repacked(w13).float().cpu(), dequantize_repacked(w2).float().cpu()
    perms = None
    if act_order:  # the stored stacks' columns read x (and the activations) through each expert's order
        perms = act_orders(local, hidden, inter, seed=num_tokens + bits)
        dense13, dense2 = unsorted(dense13, perms[0]), unsorted(dense2, perms[1])
        perms = (perms[0].to(DEVICE), perms[1].to(DEVICE))
    expected = fused_moe_ref(x.float(), dense13, dense2, weights, ids, expert_map)
    got = fused_moe_int_triton(x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE), emap,
                               tile=None if pair_path else TILE, pair_path=pair_path, into_norm=into_norm,
                               perms=perms)
    if into_norm and pair_path:
        assert isinstance(got, PartialSums) and got.ws.shape == (top_k, num_tokens, hidden)
        got = got.reduce()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("num_tokens,mode", [(1, "random"), (9, "even_only"), (23, "random"), (17, "all_one")])
def test_sorted_blocks_match_the_dequantized_loop(bits, num_tokens, mode):
    """even_only leaves the odd experts without a token, all_one every expert but two; 9 and 23 tokens fill
    ragged row blocks."""
    check(num_tokens, bits, mode)


@pytest.mark.parametrize("kernel", ["gemv", "mma"])
@pytest.mark.parametrize("bits", [4, 8])
def test_pair_path_matches_the_dequantized_loop(kernel, bits, monkeypatch):
    """Both kernels of the pair path: the CUDA-core GEMV (K steps of 64 here) and the tensor-core one."""
    monkeypatch.setenv("TANDEM_MOE_INT_PAIR", kernel)
    monkeypatch.setenv("TANDEM_MOE_INT_TILE", "16,16,64,4,2")
    check(1, bits, pair_path=True, hidden=192, inter=64)  # every tile whole (EVEN)
    check(2, bits, pair_path=True, into_norm=True)  # K tail (96 = 64 + 32); the norm's [top_k, tokens, hidden] rows


def test_expert_parallel_rank_and_fp16(monkeypatch):
    glob = torch.arange(6)
    expert_map = torch.where(glob % 2 == 1, glob // 2, -1).to(torch.int32)  # rank 1 of 2 holds 1, 3, 5
    check(7, 4, expert_map=expert_map)
    monkeypatch.setenv("TANDEM_MOE_INT_TILE", "16,16,64,4,2")
    check(2, 4, pair_path=True, expert_map=expert_map)
    monkeypatch.setenv("TANDEM_MOE_INT_GEMV", "64,64")  # N tails (96 gate rows) and a K tail (96) in the GEMV
    check(2, 8, pair_path=True, expert_map=expert_map)
    check(13, 4, dtype=torch.float16, num_experts=5, top_k=3, group=None)  # groups of 128 (w13), 32 (w2)


EVEN_EXPERTS = torch.where(torch.arange(6) % 2 == 0, torch.arange(6) // 2, -1).to(torch.int32)  # rank 0 of 2


@pytest.mark.parametrize("kernel", ["gemv", "mma", "mma_gemv", "sorted"])
def test_act_order_experts_read_their_rows_through_each_experts_order(kernel, monkeypatch):
    """Act-order experts (each expert's own input-column order for w13 and for w2): every pair-path kernel and the
    sorted blocks, on one rank and on an expert-parallel one (experts 0, 2, 4 of 6), against the loop over the
    dense experts in input order. (mma_gemv takes 16-bit rows on a GPU: in the interpreter it runs the CUDA-core
    GEMV.)"""
    monkeypatch.setenv("TANDEM_MOE_INT_TILE", "16,16,64,4,2")
    if kernel == "sorted":
        check(9, 4, act_order=True)
        check(7, 4, act_order=True, expert_map=EVEN_EXPERTS)
        return
    monkeypatch.setenv("TANDEM_MOE_INT_PAIR", kernel)
    check(2, 4, pair_path=True, act_order=True, into_norm=True)
    check(2, 8, pair_path=True, act_order=True, expert_map=EVEN_EXPERTS)


@pytest.mark.skipif(CUDA, reason="the interpreter case (its tensors stay on the CPU)")
@pytest.mark.parametrize("pair_path", [False, True])
def test_act_order_experts_over_two_ranks_that_split_the_intermediate_size(pair_path, monkeypatch):
    """Tensor parallelism over act-order experts, both ranks in this process: a rank holds its rows of gate / up
    and its half of down's group-sorted columns, whose orders name columns of the whole intermediate size; its
    down reads the ranks' activations gathered (gather_inter: here the two ranks' activations, captured by a
    first pass). The two ranks' outputs sum to the unsharded experts' in input order."""
    from tandem.layers.int_quant import quantize_rtn_experts

    monkeypatch.setenv("TANDEM_MOE_INT_PAIR", "gemv")
    monkeypatch.setenv("TANDEM_MOE_INT_TILE", "16,16,64,4,2")
    num_tokens, num_experts, top_k, hidden, inter, half = (2 if pair_path else 9), 4, 2, 128, 128, 64
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = routing(num_tokens, num_experts, top_k, "random", seed=5)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    w13, w2 = make_moe(num_experts, hidden, inter, torch.float32, seed=5)  # stored (sorted) column order
    p13, p2 = act_orders(num_experts, hidden, inter, seed=6)
    ranks = []
    for r in range(2):
        rows = torch.cat([w13[:, r * half:(r + 1) * half], w13[:, inter + r * half:inter + (r + 1) * half]], dim=1)
        down = w2[:, :, r * half:(r + 1) * half]  # its half of down's sorted columns: two whole groups of 32
        ranks.append((quantize_rtn_experts(rows, 4, 32), quantize_rtn_experts(down, 4, 32),
                      p2[:, r * half:(r + 1) * half]))
    d13 = [dequantize_repacked(ranks[r][0]) for r in range(2)]  # each rank's gate half, then its up half
    gate, up = (torch.cat([d[:, i * half:(i + 1) * half] for d in d13], dim=1) for i in range(2))
    dense13 = unsorted(torch.cat([gate, up], dim=1), p13)
    dense2 = unsorted(torch.cat([dequantize_repacked(ranks[r][1]) for r in range(2)], dim=2), p2)
    expected = fused_moe_ref(x, dense13, dense2, weights, ids)
    acts: list[torch.Tensor | None] = [None, None]

    def run(r: int, gather) -> torch.Tensor:  # noqa: ANN001
        w13_r, w2_r, p2_r = ranks[r]
        return fused_moe_int_triton(x, w13_r, w2_r, weights, ids, tile=None if pair_path else TILE,
                                    pair_path=pair_path, perms=(p13, p2_r), gather_inter=gather)

    for r in range(2):  # first pass: each rank's [pairs, half] activations (its output unused)
        run(r, lambda act, r=r: acts.__setitem__(r, act.clone()) or torch.cat([act, act], dim=1))
    got = sum(run(r, lambda act, r=r: (torch.testing.assert_close(act, acts[r]), torch.cat(acts, dim=1))[1])
              for r in range(2))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_pair_gather_reads_each_pairs_row_through_its_expert():
    """gather_pair_columns_triton: pair p's row is x's row p // top_k through its (local) expert's order; a pair of
    another rank's expert reads expert 0's; the order may cover part of x's columns."""
    from tandem.kernels.triton_moe_int import gather_pair_columns_triton

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 40, generator=gen).to(DEVICE)
    perm = torch.stack([torch.randperm(40, generator=gen)[:24] for _ in range(3)]).to(DEVICE)
    ids = torch.tensor([4, 1, 0, 2, 5, 3, 1, 1, 2, 0], dtype=torch.int32, device=DEVICE)  # 5 tokens, top 2
    expert_map = torch.tensor([0, -1, 1, -1, 2, -1], dtype=torch.int32, device=DEVICE)
    got = gather_pair_columns_triton(x, perm, ids, 2, expert_map)
    for p in range(10):
        e = max(int(expert_map[ids[p]]), 0)
        assert torch.equal(got[p], x[p // 2, perm[e]]), p
    one = gather_pair_columns_triton(x[:1].expand(3, 40).contiguous(), perm, ids[:3].remainder(3), 1)
    assert torch.equal(one, torch.stack([x[0, perm[int(e)]] for e in ids[:3].remainder(3)]))
    with pytest.raises(ValueError, match="pair gather"):
        gather_pair_columns_triton(x, torch.zeros(3, 41, dtype=torch.int64, device=DEVICE), ids, 2)


@pytest.mark.skipif(CUDA, reason="the CPU's dispatch")
def test_cpu_dispatch_dequantizes_into_the_reference():
    """ops.fused_moe with IntWeight stacks on the CPU: every expert dequantized, then the per-expert loop."""
    w13, w2 = int_experts(4, 64, 32, 4, torch.float32)
    x = torch.randn(5, 64)
    ids = routing(5, 4, 2, "random")
    weights = torch.rand(5, 2)
    got = ops.fused_moe(x, w13, w2, weights, ids)
    w13_dense, w2_dense = dequantize_repacked(w13), dequantize_repacked(w2)
    assert w13_dense.shape == (4, 64, 64) and w2_dense.shape == (4, 64, 32)
    torch.testing.assert_close(got, fused_moe_ref(x, w13_dense, w2_dense, weights, ids))
    with pytest.raises(ValueError, match="both be integer"):
        ops.fused_moe(x, w13, w2_dense, weights, ids)
    perms = act_orders(4, 64, 32, seed=1)  # act order: the columns put back in input order first
    got = ops.fused_moe(x, w13, w2, weights, ids, perms=perms)
    expected = fused_moe_ref(x, unsorted(w13_dense, perms[0]), unsorted(w2_dense, perms[1]), weights, ids)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, fused_moe_ref(x, w13_dense, w2_dense, weights, ids), atol=1e-3)
    with pytest.raises(ValueError, match="act-order permutations come with integer experts only"):
        ops.fused_moe(x, w13_dense, w2_dense, weights, ids, perms=perms)


def test_rtn_experts_quantize_each_row_like_a_linear():
    """A stack is each expert's quantize_rtn, repacked: the same dequantized rows as the dense layers'."""
    from tandem.layers.int_quant import quantize_rtn

    w = torch.randn(3, 16, 256)
    stack = quantize_rtn_experts(w, 4)
    assert stack.group_size == 128 and stack.words.shape == (3, 16, 32) and stack.scales.shape == (3, 16, 2)
    dense = dequantize_repacked(stack)
    for e in range(3):
        torch.testing.assert_close(dense[e], quantize_rtn(w[e], 4, 128).dequantize(), atol=1e-6, rtol=1e-6)
    assert (dense - w).abs().max() <= (w.amax() - w.amin()) / 15  # within a step of the codes


def test_tile_choice():
    from tandem.kernels.triton_moe_int import pair_gemv_tile

    assert int_moe_tile(1, 8, 128, 4, True).block_m == 16 and int_moe_tile(1, 8, 128, 8, True).block_k == 64
    assert int_moe_tile(64, 8, 128, 4, False).block_k == 128 and int_moe_tile(4096, 8, 128, 4, False).block_m == 64
    # Qwen3-30B-A3B: gate_up K 2048 in one step of 8 channels, down K 768 in steps of 256 (16 channels); 8 bits.
    assert pair_gemv_tile(1536, 2048, 4, 128) == (8, 2048) and pair_gemv_tile(2048, 768, 4, 128) == (16, 256)
    assert pair_gemv_tile(2048, 768, 8, 128) == (8, 256) and pair_gemv_tile(1536, 2048, 8, 128) == (8, 1024)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("num_tokens,pair", [(1, "gemv"), (1, "mma"), (1, "mma_gemv"), (4, "gemv"), (4, "mma"),
                                             (4, "mma_gemv"), (64, None), (600, None)])
def test_bf16_on_gpu_matches_the_dequantized_loop(bits, num_tokens, pair, monkeypatch):
    """Qwen3-30B-A3B's expert shapes (128 experts, top 8, 2048 x 768) in bf16, each path by its token count,
    against the per-expert loop in fp32 over the same dequantized weights. The kernel rounds each weight to bf16
    (2**-9 relative; with the packed 4-bit assembly q * s + min in one bf16 FMA) and the gate_up activation to bf16
    before the down projection: errors of random sign over K = 2048 and 768 of a few 1e-3 of the output's scale,
    the same bound as the bf16 MoE test (3e-2 absolute and relative). 1 and 4 tokens run the pair path (each of
    its kernels), 64 the sorted small-batch tile, 600 the prefill tile; each also replays from a CUDA graph."""
    if pair is not None:
        monkeypatch.setenv("TANDEM_MOE_INT_PAIR", pair)
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    ids = routing(num_tokens, num_experts, top_k, "random", seed=2).cuda()
    weights = torch.rand(num_tokens, top_k, generator=gen).cuda()
    w13, w2 = int_experts(num_experts, hidden, inter, bits, torch.bfloat16, None)
    expected = fused_moe_ref(x.float(), dequantize_repacked(w13).float(), dequantize_repacked(w2).float(), weights, ids)
    got = ops.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)
    static_x = x.clone()
    out = ops.fused_moe(static_x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fused_moe(static_x, w13, w2, weights, ids)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ops.fused_moe(static_x, w13, w2, weights, ids).float())


_COMPILE_SM90 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_moe_int import _moe_int_gemm_kernel, _moe_int_pair_gemv_kernel

names = ["a_ptr", "w_ptr", "s_ptr", "mn_ptr", "out_ptr", "topk_w_ptr", "sorted_ids_ptr", "expert_ids_ptr",
         "num_padded_ptr", "map_ptr", "N", "K", "num_pairs", "top_k", "up_offset", "num_tokens", "ONE_BITS",
         "stride_am", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_om"]
# (name, bits, output type, constexprs, warps): Qwen3-30B-A3B's decode pair path (gate_up, then down into the
# norm's fp32 rows), its sorted small-batch tile, the prefill tile, and 8 bits.
cases = [
    ("pair-gate-up", 4, "bf16", dict(GATED=True, PAIR_BLOCKS=True, HAS_MAP=False, SPLIT_MAJOR=False,
                                     MUL_WEIGHT=False, BLOCK_M=16, BLOCK_N=32, TG=1, GW=16), 4),
    ("pair-down", 4, "fp32", dict(GATED=False, PAIR_BLOCKS=True, HAS_MAP=True, SPLIT_MAJOR=True, MUL_WEIGHT=True,
                                  BLOCK_M=16, BLOCK_N=32, TG=1, GW=16), 4),
    ("sorted-small", 4, "bf16", dict(GATED=True, PAIR_BLOCKS=False, HAS_MAP=False, SPLIT_MAJOR=False,
                                     MUL_WEIGHT=False, BLOCK_M=16, BLOCK_N=64, TG=1, GW=16), 4),
    ("sorted-large", 4, "bf16", dict(GATED=True, PAIR_BLOCKS=False, HAS_MAP=False, SPLIT_MAJOR=False,
                                     MUL_WEIGHT=False, BLOCK_M=64, BLOCK_N=128, TG=1, GW=8), 8),
    ("pair-w8", 8, "bf16", dict(GATED=True, PAIR_BLOCKS=True, HAS_MAP=False, SPLIT_MAJOR=False, MUL_WEIGHT=False,
                                BLOCK_M=16, BLOCK_N=32, TG=1, GW=16, EVEN=False), 4),
]
out = {}
for name, bits, oty, flags, warps in cases:
    constexprs = {**dict(GROUP=128, BITS=bits, PACKED=bits == 4, EVEN=True, PRECISION="tf32", USE_PDL=2), **flags}
    mty = "bf16" if bits == 4 else "fp32"
    types = ["*bf16", "*i32", "*bf16", f"*{mty}", f"*{oty}", "*fp32", "*i32", "*i32", "*i32", "*i32"]
    types += ["i32"] * 13
    signature = dict(zip(names, types))
    signature.update({key: "constexpr" for key in constexprs})
    src = ASTSource(fn=_moe_int_gemm_kernel, signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 10, 11, 17, 18, 19, 20, 22)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    out[name] = {"mma": "mma.sync" in ptx or "wgmma.mma_async" in ptx,
                 "packed_fma": "fma.rn.bf16x2" in ptx, "local": "ld.local" in ptx or "st.local" in ptx,
                 "shared": kernel.metadata.shared}
# The pair GEMV at Qwen3-30B-A3B's decode tiles: gate_up (K 2048 in one step), down (K 768 in steps of 256).
gemv_names = ["a_ptr", "w_ptr", "s_ptr", "mn_ptr", "out_ptr", "topk_w_ptr", "ids_ptr", "map_ptr", "N", "K", "top_k",
              "up_offset", "num_tokens", "ONE_BITS", "stride_am", "stride_we", "stride_wn", "stride_se", "stride_sn",
              "stride_om"]
for name, oty, flags in [("gemv-gate-up", "bf16", dict(GATED=True, MUL_WEIGHT=False, HAS_MAP=False, SPLIT_MAJOR=False,
                                                     TG=16, GW=16)),
                         ("gemv-down", "fp32", dict(GATED=False, MUL_WEIGHT=True, HAS_MAP=True, SPLIT_MAJOR=True,
                                                   BLOCK_N=16, TG=2, GW=16))]:
    constexprs = {**dict(GROUP=128, BITS=4, EVEN=True, BLOCK_N=8, USE_PDL=2), **flags}
    types = ["*bf16", "*i32", "*bf16", "*bf16", f"*{oty}", "*fp32", "*i32", "*i32"] + ["i32"] * 12
    signature = dict(zip(gemv_names, types))
    signature.update({key: "constexpr" for key in constexprs})
    src = ASTSource(fn=_moe_int_pair_gemv_kernel, signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 8, 9, 14, 15, 16, 17, 19)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
    ptx = kernel.asm["ptx"]
    out[name] = {"mma": None, "packed_fma": None, "local": "ld.local" in ptx or "st.local" in ptx,
                 "shared": kernel.metadata.shared, "v4_loads": "ld.global.v4" in ptx}
json.dump(out, sys.stdout)
"""


def test_kernel_compiles_for_sm90():
    """The kernels at their decode (pair path), small-batch and prefill tiles compile for Hopper without a GPU: no
    local memory (spills), shared memory within the 227 KiB a block may have; the tile kernel on tensor-core MMAs
    with the packed 4-bit dequantization (bf16 inline assembly accepted by ptxas), the pair GEMV with 16-byte
    loads."""
    from tests.kernels.sm90 import compile_sm90

    result = compile_sm90(_COMPILE_SM90)
    for name, info in result.items():
        assert not info["local"] and info["shared"] <= 227 * 1024, (name, info)
        if name.startswith("gemv"):  # the pair GEMV streams 16-byte loads of codes
            assert info["v4_loads"], (name, info)
        else:
            assert info["mma"] and info["packed_fma"] == (name != "pair-w8"), (name, info)
