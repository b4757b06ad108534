"""write_kv_ref / paged_attention_ref against a naive per-sequence dense causal attention."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.reference import paged_attention_ref, write_kv_ref

HEAD_DIM = 16
NUM_KV_HEADS = 2


def build_case(seq_lens, query_lens, *, group, block_size, seed, trailing_pad_tokens=0):
    """Random contexts written through write_kv_ref into scattered blocks; returns inputs and dense K/V."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + 2 * sum(blocks_needed) + 1
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_needed + [1]) + 2, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)  # junk everywhere
    v_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    dense_k, dense_v = [], []
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_needed)):
        tables[i, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
        k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        slots = torch.tensor([int(tables[i, t // block_size]) * block_size + t % block_size for t in range(n)])
        # Interleave skipped (-1) rows to check they are ignored.
        write_kv_ref(torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), k_cache, v_cache,
                     torch.cat([slots, torch.tensor([-1])]).long() if n else torch.tensor([-1]))
        dense_k.append(k)
        dense_v.append(v)
    num_tokens = sum(query_lens) + trailing_pad_tokens
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens) + 3,  # an upper bound, as under CUDA graphs
    )
    return q, k_cache, v_cache, meta, dense_k, dense_v


def naive_attention(q, meta, dense_k, dense_v, scale):
    out = torch.zeros_like(q)
    group = q.shape[1] // NUM_KV_HEADS
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        query_len = starts[i + 1] - starts[i]
        if seq_len == 0:
            continue
        for j in range(query_len):
            pos = seq_len - query_len + j
            for h in range(q.shape[1]):
                keys = dense_k[i][: pos + 1, h // group]  # [pos + 1, head_dim]
                values = dense_v[i][: pos + 1, h // group]
                weights = torch.softmax(keys @ q[starts[i] + j, h] * scale, dim=0)
                out[starts[i] + j, h] = weights @ values
    return out


CASES = {
    # (seq_lens, query_lens): fresh prefill, prefill after a cached prefix (chunked), decode, padding rows
    "mixed": ([7, 13, 9, 0, 5], [7, 4, 1, 1, 2]),
    "mixed_empty_row": ([6, 0, 17], [3, 0, 17]),
    "decode": ([5, 1, 0, 12, 33, 0], [1, 1, 1, 1, 1, 1]),
    "decode_with_empty_query": ([5, 8, 3], [1, 0, 1]),
}


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_matches_naive(case, block_size, group):
    seq_lens, query_lens = CASES[case]
    q, k_cache, v_cache, meta, dense_k, dense_v = build_case(
        seq_lens, query_lens, group=group, block_size=block_size, seed=block_size + group, trailing_pad_tokens=2
    )
    scale = 1 / math.sqrt(HEAD_DIM)
    out = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, naive_attention(q, meta, dense_k, dense_v, scale), atol=1e-5, rtol=1e-5)


def test_decode_fast_path_one_token_per_row():
    q, k_cache, v_cache, meta, dense_k, dense_v = build_case([4, 0, 9, 2], [1, 1, 1, 1], group=2, block_size=4, seed=3)
    out = paged_attention_ref(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out, naive_attention(q, meta, dense_k, dense_v, 0.3), atol=1e-5, rtol=1e-5)
    assert (out[1] == 0).all()  # the padding row


def test_write_kv_skips_negative_slots():
    k_cache = torch.zeros(3, 2, 1, 4)
    v_cache = torch.zeros(3, 2, 1, 4)
    k = torch.arange(12.0).view(3, 1, 4)
    write_kv_ref(k, -k, k_cache, v_cache, torch.tensor([5, -1, 2]))
    flat_k, flat_v = k_cache.view(6, 1, 4), v_cache.view(6, 1, 4)
    torch.testing.assert_close(flat_k[5], k[0])
    torch.testing.assert_close(flat_k[2], k[2])
    torch.testing.assert_close(flat_v[2], -k[2])
    assert flat_k[[0, 1, 3, 4]].abs().sum() == 0


def test_padding_rows_are_zero_even_with_nan_where_they_point():
    # Both real rows own 3 blocks, so only the padding row reads block 0.
    q, k_cache, v_cache, meta, dense_k, dense_v = build_case([12, 0, 9], [1, 1, 1], group=2, block_size=4, seed=5)
    meta.max_seq_len = 12
    # Junk in the slot a padding row reads (block 0, position 0) must not reach its output.
    k_cache[0, 0] = float("nan")
    v_cache[0, 0] = float("nan")
    out = paged_attention_ref(q, k_cache, v_cache, meta, 0.3)
    assert (out[1] == 0).all()
    torch.testing.assert_close(out, naive_attention(q, meta, dense_k, dense_v, 0.3), atol=1e-5, rtol=1e-5)
