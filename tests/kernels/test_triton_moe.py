"""The MoE token sort/align against a Python reference, and the fused Triton MoE against the per-expert loop
(interpreter on CPU, compiled on GPU): token counts from 1 up, experts with no token, one expert taking all."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.moe_align import (
    align_by_expert,
    align_by_expert_ref,
    fused_moe_ref,
    max_aligned_blocks,
)
from tandem.kernels.triton_moe import MoETile, count_routed_experts_triton, fused_moe_triton, moe_tile, pair_config

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SMALL, LARGE = MoETile(16, 32, 32, 4, 2), MoETile(32, 32, 32, 4, 2)  # interpreter-sized tiles of both paths


def routing(num_tokens: int, num_experts: int, top_k: int, mode: str, seed: int = 0) -> torch.Tensor:
    """[num_tokens, top_k] int32 distinct experts per token: random, all on experts 0..top_k-1 (one expert takes
    every token; the rest get none), or only even experts (odd ones empty)."""
    gen = torch.Generator().manual_seed(seed)
    if mode == "all_one":
        return torch.arange(top_k, dtype=torch.int32).repeat(num_tokens, 1)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if mode == "even_only":
        scores[:, 1::2] = -1.0
    return scores.topk(top_k, dim=-1).indices.to(torch.int32)


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 100])
@pytest.mark.parametrize("mode", ["random", "all_one", "even_only"])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_matches_python_reference(num_tokens, mode, block_m):
    num_experts, top_k = 8, 2
    ids = routing(num_tokens, num_experts, top_k, mode)
    aligned = align_by_expert(ids, num_experts, block_m)
    pairs, experts = align_by_expert_ref(ids, num_experts, block_m)
    used = int(aligned.num_padded)
    assert used == len(pairs) and used % block_m == 0
    assert aligned.sorted_pair_ids[:used].tolist() == pairs
    assert aligned.expert_ids[: used // block_m].tolist() == experts
    assert (aligned.expert_ids[used // block_m:] == -1).all()  # blocks past the used ones: nothing to do
    assert aligned.expert_ids.shape[0] == max_aligned_blocks(num_tokens * top_k, num_experts + 1, block_m)


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
@pytest.mark.parametrize("mode", ["random", "all_one", "even_only"])
def test_align_kernel_matches_python_reference(num_tokens, mode):
    from tandem.kernels.triton_moe import align_by_expert_triton

    num_experts, top_k, block_m = 8, 2, 4
    ids = routing(num_tokens, num_experts, top_k, mode)
    aligned = align_by_expert_triton(ids.to(DEVICE), num_experts, block_m)
    pairs, experts = align_by_expert_ref(ids, num_experts, block_m)
    used = int(aligned.num_padded)
    assert used == len(pairs)
    assert aligned.sorted_pair_ids[:used].tolist() == pairs
    assert aligned.expert_ids[: used // block_m].tolist() == experts
    assert (aligned.expert_ids[used // block_m:] == -1).all()


def test_align_kernel_with_expert_map():
    from tandem.kernels.triton_moe import align_by_expert_triton

    glob = torch.arange(8)
    expert_map = torch.where(glob % 2 == 1, glob // 2, -1).to(torch.int32)
    ids = routing(70, 8, 3, "random", seed=5)  # 210 pairs: several chunks
    aligned = align_by_expert_triton(ids.to(DEVICE), 4, 16, expert_map.to(DEVICE))
    pairs, experts = align_by_expert_ref(ids, 4, 16, expert_map)
    used = int(aligned.num_padded)
    assert aligned.sorted_pair_ids[:used].tolist() == pairs
    assert aligned.expert_ids[: used // 16].tolist() == experts


def test_align_with_expert_map_keeps_only_local_experts():
    num_experts, top_k, ranks = 8, 3, 2
    ids = routing(40, num_experts, top_k, "random", seed=3)
    for rank in range(ranks):
        glob = torch.arange(num_experts)
        expert_map = torch.where(glob % ranks == rank, glob // ranks, -1).to(torch.int32)
        aligned = align_by_expert(ids, num_experts // ranks, 8, expert_map)
        pairs, experts = align_by_expert_ref(ids, num_experts // ranks, 8, expert_map)
        used = int(aligned.num_padded)
        assert aligned.sorted_pair_ids[:used].tolist() == pairs
        assert aligned.expert_ids[: used // 8].tolist() == experts


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (5, 1)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_kernel_matches_softmax_topk(num_experts, top_k, renormalize):
    from tandem.kernels.moe_align import route_topk
    from tandem.kernels.triton_moe import route_topk_triton

    logits = torch.randn(6, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 2
    weights, ids = route_topk_triton(logits.to(DEVICE), top_k, renormalize)
    ref_weights, ref_ids = route_topk(logits, top_k, renormalize)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_kernel_gives_valid_distinct_experts_for_nan_and_inf_rows(renormalize):
    # A CUDA graph's padding rows may hold NaN hidden states; their expert ids must still index the weights.
    from tandem.kernels.triton_moe import route_topk_triton

    logits = torch.randn(4, 60)
    logits[1] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    weights, ids = route_topk_triton(logits.to(DEVICE), 4, renormalize)
    ids = ids.cpu()
    assert ids.min() >= 0 and ids.max() < 60
    assert all(len(set(row.tolist())) == 4 for row in ids)


def make_moe(num_experts, hidden, inter, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return w13, w2


def run_case(num_tokens, mode, dtype, tile, expert_map=None, num_experts=8, top_k=2, hidden=64, inter=48,
             pair_path=False):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    ids = routing(num_tokens, num_experts, top_k, mode, seed=1)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    local = num_experts if expert_map is None else int((expert_map >= 0).sum())
    w13, w2 = make_moe(local, hidden, inter, dtype)
    expected = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, expert_map)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    got = fused_moe_triton(*args, expert_map.to(DEVICE) if expert_map is not None else None, tile=tile,
                           pair_path=pair_path)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_tokens", [1, 9, 40])
@pytest.mark.parametrize("mode", ["random", "all_one", "even_only"])
def test_fused_moe_matches_per_expert_loop(num_tokens, mode):
    run_case(num_tokens, mode, torch.float32, SMALL)


@pytest.mark.parametrize("num_tokens,mode", [(9, "random"), (40, "all_one")])
def test_fused_moe_large_tile_matches_per_expert_loop(num_tokens, mode):
    run_case(num_tokens, mode, torch.float32, LARGE)


@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize("mode", ["random", "all_one"])
def test_pair_path_matches_per_expert_loop(num_tokens, mode):
    run_case(num_tokens, mode, torch.float32, None, pair_path=True, hidden=200, inter=40)  # K tails, N tails


def test_pair_path_expert_parallel_and_fp16():
    glob = torch.arange(8)
    expert_map = torch.where(glob % 2 == 0, glob // 2, -1).to(torch.int32)
    run_case(5, "random", torch.float32, None, expert_map=expert_map, pair_path=True)
    run_case(4, "random", torch.float16, None, pair_path=True, num_experts=6, top_k=3)


@pytest.mark.parametrize("spec", ["16", "8,pairs", "64,sum"])
def test_pair_path_tiles_and_per_pair_down(monkeypatch, spec):
    """TANDEM_MOE_PAIR's N tiles and the per-pair down projection (summed over top_k after it), expert parallel too."""
    monkeypatch.setenv("TANDEM_MOE_PAIR", spec)
    run_case(3, "random", torch.float32, None, pair_path=True, hidden=200, inter=40)
    glob = torch.arange(8)
    expert_map = torch.where(glob % 2 == 0, glob // 2, -1).to(torch.int32)
    run_case(2, "random", torch.float32, None, expert_map=expert_map, pair_path=True)


def test_pair_config_refuses_bad_specs(monkeypatch):
    for spec in ("12", "32,both", "x"):
        monkeypatch.setenv("TANDEM_MOE_PAIR", spec)
        with pytest.raises(ValueError, match="TANDEM_MOE_PAIR"):
            pair_config()
    monkeypatch.setenv("TANDEM_MOE_PAIR", "16,sum")
    assert pair_config() == (16, "sum")
    monkeypatch.setenv("TANDEM_MOE_PAIR", "64")
    assert pair_config() == (64, "norm")


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_pair_rows_handed_to_the_norm_equal_the_summed_block(monkeypatch, num_tokens):
    """TANDEM_MOE_PAIR's "norm": the pair path's rows, [top_k, tokens, hidden] fp32, go unsummed into the add +
    RMSNorm after the block, which gives what the summed output would."""
    from tandem.kernels.fp8 import PartialSums
    from tandem.kernels.triton_fused import fused_add_rms_norm_triton

    monkeypatch.setenv("TANDEM_MOE_PAIR", "16,norm")
    gen = torch.Generator().manual_seed(3)
    hidden, top_k = 200, 3
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = routing(num_tokens, 8, top_k, "random", seed=2)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    w13, w2 = make_moe(8, hidden, 40, torch.float32)
    residual, norm_w = torch.randn(num_tokens, hidden, generator=gen), torch.randn(hidden, generator=gen)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    summed = fused_moe_triton(*args, pair_path=True)
    parts = fused_moe_triton(*args, pair_path=True, into_norm=True)
    assert isinstance(summed, torch.Tensor) and isinstance(parts, PartialSums)
    assert parts.ws.shape == (top_k, num_tokens, hidden)
    torch.testing.assert_close(parts.reduce(), summed, atol=1e-5, rtol=1e-5)
    res, w = residual.to(DEVICE), norm_w.to(DEVICE)
    fused, unfused = (fused_add_rms_norm_triton(rows, res, w, 1e-6) for rows in (parts, summed))
    for got, want in zip(fused, unfused):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,mode", [(1, 128, 8, "random"), (40, 8, 2, "even_only"),
                                                                 (70, 60, 4, "random"), (33, 8, 2, "all_one")])
def test_routed_expert_count_matches_distinct_ids(num_tokens, num_experts, top_k, mode):
    """The one-program count of a step's distinct experts (benchmark statistics), over several CHUNKs of pairs."""
    ids = routing(num_tokens, num_experts, top_k, mode)
    counter = torch.full((), 5, dtype=torch.int64, device=DEVICE)
    count_routed_experts_triton(ids.to(DEVICE), num_experts, counter)
    assert int(counter) == 5 + torch.unique(ids).numel()


@pytest.mark.parametrize("dtype", [torch.float16])
def test_fused_moe_half_and_uneven_shapes(dtype):
    run_case(13, "random", dtype, SMALL, num_experts=5, top_k=3, hidden=48, inter=40)


def test_fused_moe_expert_parallel_rank_zeroes_other_experts():
    glob = torch.arange(8)
    expert_map = torch.where(glob % 2 == 1, glob // 2, -1).to(torch.int32)  # rank 1 of 2
    run_case(21, "random", torch.float32, SMALL, expert_map=expert_map)


def test_fused_moe_fp8_weights():
    from tandem.layers.quantization import quantize_weight_fp8

    num_tokens, hidden, inter, num_experts, top_k = 6, 64, 32, 4, 2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13, w2 = make_moe(num_experts, hidden, inter, torch.float32)
    q13, s13 = quantize_weight_fp8(w13.reshape(-1, hidden))
    q2, s2 = quantize_weight_fp8(w2.reshape(-1, inter))
    q13, s13 = q13.view(w13.shape), s13.view(num_experts, 2 * inter)
    q2, s2 = q2.view(w2.shape), s2.view(num_experts, hidden)
    ids = routing(num_tokens, num_experts, top_k, "random")
    weights = torch.rand(num_tokens, top_k, generator=gen)
    expected = fused_moe_ref(x, q13, q2, weights, ids, None, s13, s2)
    dev = [t.to(DEVICE) for t in (x, q13, q2, weights, ids)]
    for pair_path in (False, True):
        got = fused_moe_triton(*dev, None, s13.to(DEVICE), s2.to(DEVICE), tile=None if pair_path else SMALL,
                               pair_path=pair_path)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_tile_choice_by_token_count():
    from tandem.kernels.triton_moe import use_pair_path

    assert use_pair_path(1, 8, 128) and use_pair_path(4, 8, 128) and not use_pair_path(5, 8, 128)
    assert use_pair_path(1, 2, 8) and not use_pair_path(2, 2, 8)  # Mixtral: batch 1 only
    assert moe_tile(1, 8, 128).block_m == 16 and moe_tile(64, 8, 128).block_m == 16
    assert moe_tile(4096, 8, 128).block_m == 64


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 257, 1024, 4096])
@pytest.mark.parametrize("mode", ["random", "all_one", "even_only"])
def test_fused_moe_bf16_on_gpu(num_tokens, mode):
    """Qwen3-30B-A3B-like expert shapes at bf16 tolerance, each path by its own token count."""
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    w13, w2 = make_moe(num_experts, hidden, inter, torch.bfloat16)
    ids = routing(num_tokens, num_experts, top_k, mode, seed=2)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    got = fused_moe_triton(*(t.cuda() for t in (x, w13, w2, weights, ids)))
    expected = fused_moe_ref(*(t.cuda().float() for t in (x, w13, w2)), weights.cuda(), ids.cuda())
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 512, 2048])  # 2048 x top 4: the device-op align
def test_fused_moe_captures_into_a_cuda_graph(num_tokens):
    """Routing, align and both GEMMs replay from a graph with new routings (no host sync inside)."""
    num_experts, top_k, hidden, inter = 64, 4, 512, 256
    w13, w2 = (w.cuda() for w in make_moe(num_experts, hidden, inter, torch.bfloat16))
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, device="cuda")
    from tandem.kernels.moe_align import route_topk

    def step():
        weights, ids = route_topk(logits, top_k, True)
        return fused_moe_triton(x, w13, w2, weights, ids)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        torch.manual_seed(seed)
        logits.copy_(torch.randn_like(logits) * 3)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)


@pytest.mark.skipif(CUDA, reason="compares the CPU PyTorch path with the interpreted Triton path")
def test_moe_model_forward_same_logits_with_forced_triton(monkeypatch):
    """A tiny Qwen3-MoE through the Triton routing, align and GEMMs (prefill: aligned path; decode with a padding
    row: per-pair path) against the PyTorch reference path."""
    from tandem.config import ModelConfig
    from tandem.models.moe import Qwen3MoeForCausalLM
    from tests.kernels.test_triton_fused import run_steps

    config = ModelConfig(architecture="qwen3_moe", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, intermediate_size=96, max_position_embeddings=64,
                         qk_norm=True, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
                         norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        param.data = base + 0.1 * torch.randn(param.shape, generator=gen)
    eager = run_steps(model, config)
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    monkeypatch.setenv("TANDEM_MOE_PAIR_MAX_PAIRS", "6")  # the decode step's 3 rows x top 2: per-pair path
    fused = run_steps(model, config)
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
