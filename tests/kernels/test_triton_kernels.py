"""Triton KV-write and paged-attention kernels against a dense float64 oracle (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tandem.kernels import ops
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.triton_attention import (
    MAX_SPLITS,
    _merge_tile,
    choose_num_splits,
    decode_block_n,
    decode_workspace_numel,
    paged_attention_triton,
    paged_decode_attention,
    paged_prefill_attention,
)
from tandem.kernels.triton_kv import write_kv_triton
from tests.sweeps import pairwise

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")

# The sweeps over these run every pair of values on the CPU (tests/sweeps.py), the cross product on a GPU.
BLOCK_SIZES = [16, 32]
HEAD_DIMS = [64, 128]
GROUPS = [1, 4, 8]  # query heads per kv head
DTYPES = [torch.float32, torch.float16]
NUM_KV_HEADS = 2
TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


@dataclass
class Case:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], a strided view like a fused qkv projection's output
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    query_lens: list[int]
    scale: float


def make_case(seq_lens, query_lens, *, group, head_dim, block_size, dtype, seed=0, num_kv_heads=NUM_KV_HEADS,
              device=DEVICE) -> Case:
    """Random cache and queries; each sequence owns shuffled, non-adjacent blocks, block 0 stays reserved."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq + [1]) + 2  # padded width, like the runner's static table
    num_blocks = 1 + 2 * sum(blocks_per_seq) + 1  # spare blocks so the owned ones are scattered
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table_buf = torch.zeros(num_seqs, max_blocks + 3, dtype=torch.int32)  # tables are a strided slice of it
    for i, n in enumerate(blocks_per_seq):
        table_buf[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_heads = num_kv_heads * group
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    kv, qkv = kv.to(device), qkv.to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table_buf.to(device)[:, :max_blocks],
        max_query_len=max(query_lens + [0]),
        max_seq_len=max(seq_lens + [0]),
    )
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    return Case(q, kv[0], kv[1], meta, list(query_lens), 1.0 / math.sqrt(head_dim))


def dense_reference(case: Case, dtype=torch.float64) -> torch.Tensor:
    """Per sequence: gather K/V through the block table, repeat for GQA, causal softmax by absolute position."""
    q, meta = case.q, case.meta
    block_size, num_kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    start = 0
    for i, query_len in enumerate(case.query_lens):
        seq_len = int(meta.seq_lens[i])
        if query_len == 0 or seq_len == 0:
            start += query_len
            continue
        pos = torch.arange(seq_len, device=q.device)
        blocks = meta.block_tables[i, pos // block_size].long()
        keys = case.k_cache[blocks, pos % block_size].to(dtype).repeat_interleave(group, dim=1)  # [ctx, H, D]
        values = case.v_cache[blocks, pos % block_size].to(dtype).repeat_interleave(group, dim=1)
        queries = q[start:start + query_len].to(dtype)
        scores = torch.einsum("thd,lhd->htl", queries, keys) * case.scale
        query_pos = seq_len - query_len + torch.arange(query_len, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[start:start + query_len] = torch.einsum("htl,lhd->thd", scores.softmax(-1), values)
        start += query_len
    return out


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "unwritten or NaN output elements"
    tol = TOL[dtype]
    torch.testing.assert_close(out.to(ref.dtype), ref, atol=tol, rtol=tol)


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


# ----------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("block_size,head_dim,dtype", pairwise(BLOCK_SIZES, HEAD_DIMS + [80], DTYPES), ids=str)
def test_write_kv_scatters_rows_and_skips_padding(block_size, head_dim, dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, num_blocks = 21, 3, 6
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    expected = kv.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7, 20]] = -1
    # k and v are strided slices of a fused projection output, as the attention layer produces them
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.cat([slots, torch.tensor([5, 6])]).to(DEVICE)  # entries past num_tokens are ignored

    write_kv_triton(k, v, kv[0], kv[1], slot_mapping)

    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = k[t]
            expected[1, slot // block_size, slot % block_size] = v[t]
    assert torch.equal(kv, expected)


def test_write_kv_rejects_mismatched_shapes():
    cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    k = torch.zeros(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError):
        write_kv_triton(k, k, cache, cache, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError):
        write_kv_triton(torch.zeros(3, 4, 64, device=DEVICE), torch.zeros(3, 4, 64, device=DEVICE), cache, cache,
                        torch.zeros(3, dtype=torch.int64, device=DEVICE))


# ----------------------------------------------------------------------------- decode

DECODE_SEQ_LENS = [1, 0, 37, 130, 64, 0]  # padding rows (0) between and after real ones


@pytest.mark.parametrize("block_size,head_dim,group,dtype", pairwise(BLOCK_SIZES, HEAD_DIMS, GROUPS, DTYPES), ids=str)
def test_decode_matches_reference(block_size, head_dim, group, dtype):
    case = make_case(DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), group=group, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, seed=block_size + head_dim + group)
    ref = dense_reference(case)
    m = case.meta
    for num_splits in (1, 3, None):  # direct write, split + reduce, heuristic (many splits, most empty)
        out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                     out=poisoned_like(case.q), num_splits=num_splits)
        assert_matches(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_program_order_changes_no_result(num_splits):
    """Programs started longest context first (the runner's order) or in any permutation of the rows write
    exactly the outputs of row order, each row its own sequence's attention."""

    def decode_order(seq_lens: torch.Tensor) -> torch.Tensor:
        return torch.argsort(seq_lens.cpu(), descending=True, stable=True).to(torch.int32).to(seq_lens.device)

    case = make_case([12, 0, 90, 33, 57, 1], [1] * 6, group=4, head_dim=64, block_size=16, dtype=torch.float32,
                     seed=21, num_kv_heads=3)
    m = case.meta
    assert decode_order(m.seq_lens).tolist() == [2, 4, 3, 0, 5, 1]
    plain = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                   num_splits=num_splits)
    assert_matches(plain, dense_reference(case), torch.float32)
    for order in (decode_order(m.seq_lens), torch.tensor([5, 3, 1, 0, 4, 2], dtype=torch.int32, device=DEVICE)):
        out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                     out=poisoned_like(case.q), num_splits=num_splits, order=order)
        assert torch.equal(out, plain)
    by_rows = paged_attention_triton(case.q, case.k_cache, case.v_cache, m, case.scale)
    m.decode_order = decode_order(m.seq_lens)  # the dispatch hands the step's order to the kernel
    assert torch.equal(paged_attention_triton(case.q, case.k_cache, case.v_cache, m, case.scale), by_rows)
    with pytest.raises(ValueError, match="order must be"):
        paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                               order=m.decode_order[:3])


def assert_same_codes(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3 tensors equal byte for byte in the interpreter; compiled, the two kernel variants compared (with and
    without the FP8 output) may round their fp32 math differently in the last bit, which can move a value to
    the neighbouring e4m3 code: allow that for at most 1% of the values."""
    got, want = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    if not CUDA:
        assert torch.equal(got, want)
        return
    differ = got != want
    assert differ.float().mean().item() <= 0.01 and ((got - want).abs()[differ] <= 1).all()


# num_splits 1: direct write; 3: the last split's merge.
@pytest.mark.parametrize("num_splits,group,dtype", pairwise([1, 3], [1, 4], DTYPES), ids=str)
def test_decode_fp8_out_is_its_output_quantized_in_kv_head_groups(num_splits, group, dtype):
    """With out_scale the decode kernel writes, bit for bit, its own output (in q's dtype) quantized in one
    group per (sequence, kv head): quantize_activation_groups_ref's e4m3 bytes and scales; padding rows get
    zeros and the smallest scale. The fused rotary variant too."""
    from tandem.kernels.fp8 import FP8_DTYPE
    from tandem.kernels.fp8 import quantize_activation_groups_ref as quantize_groups
    from tandem.kernels.triton_attention import NewTokens

    case = make_case(DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), group=group, head_dim=64, block_size=16,
                     dtype=dtype, seed=40 + group)
    m = case.meta
    rows, heads, dim = case.q.shape
    plain = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                   num_splits=num_splits)
    want_q, want_s = quantize_groups(plain.reshape(rows, heads * dim), group * dim)
    out = torch.full(case.q.shape, 1.0, device=DEVICE).to(FP8_DTYPE)
    scale = torch.full((rows, NUM_KV_HEADS), float("nan"), device=DEVICE)
    paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale, out=out,
                           num_splits=num_splits, out_scale=scale)
    assert_same_codes(out.view(rows, -1), want_q)
    torch.testing.assert_close(scale, want_s, rtol=1e-6, atol=0)
    assert (out[1].float() == 0).all() and scale[1].tolist() == want_s[1].tolist()  # a padding row

    # The fused rotary + cache write: the same kernel stores through the same helper.
    gen = torch.Generator().manual_seed(9)
    k_new = torch.randn(rows, NUM_KV_HEADS, dim, generator=gen).to(DEVICE, dtype)
    v_new = torch.randn(rows, NUM_KV_HEADS, dim, generator=gen).to(DEVICE, dtype)
    cos, sin = (torch.randn(rows, dim // 2, generator=gen).to(DEVICE, dtype) for _ in range(2))
    slots = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    new = NewTokens(k_new, v_new, cos, sin, slots)
    plain = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                   num_splits=num_splits, new_tokens=new)
    want_q, want_s = quantize_groups(plain.reshape(rows, heads * dim), group * dim)
    paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale, out=out,
                           num_splits=num_splits, new_tokens=new, out_scale=scale)
    assert_same_codes(out.view(rows, -1), want_q)
    torch.testing.assert_close(scale, want_s, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="FP8 output"):
        paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                               out=out, out_scale=scale[:, :1])


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_decode_tiles_smaller_and_larger_than_a_block(block_n):
    case = make_case([70, 3, 0, 33], [1] * 4, group=4, head_dim=64, block_size=32, dtype=torch.float32, seed=3)
    ref = dense_reference(case)
    m = case.meta
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                 num_splits=2, block_n=block_n)
    assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize("head_dim", [80, 96])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_non_power_of_two_head_dim(head_dim, group):
    case = make_case([45, 0, 17], [1] * 3, group=group, head_dim=head_dim, block_size=16, dtype=torch.float16)
    m = case.meta
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                 out=poisoned_like(case.q), num_splits=2)
    assert_matches(out, dense_reference(case), torch.float16)


@pytest.mark.parametrize("num_splits", [4, 16])
def test_decode_uses_a_preallocated_workspace_with_garbage(num_splits):
    # Empty splits write nothing: the reduce must read only the splits that held tiles.
    case = make_case([100, 0, 5], [1] * 3, group=4, head_dim=64, block_size=16, dtype=torch.float32)
    m = case.meta
    workspace = torch.full((decode_workspace_numel(3, case.q.shape[1], 64, num_splits) + 7,), float("nan"),
                           device=DEVICE)  # oversized and NaN-filled: every element read must be written first
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                 num_splits=num_splits, workspace=workspace)
    assert_matches(out, dense_reference(case), torch.float32)
    with pytest.raises(ValueError):
        paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                               num_splits=num_splits, workspace=workspace[:10])


def test_decode_tiles_double_once_the_programs_fill_the_sms():
    assert decode_block_n(128, torch.bfloat16) == 64  # 16 KiB of K per tile
    assert decode_block_n(128, torch.bfloat16, programs=8, num_sms=132) == 64  # batch 1: splits need tiles
    assert decode_block_n(128, torch.bfloat16, programs=256, num_sms=132) == 128  # batch 32 x 8 kv heads
    # Past a wave, the tile whose programs fill the last wave better: at 512 programs 128-position ones (3 an SM)
    # would leave a second wave a third full where 64-position ones (4 an SM) take one; at 576 and 768 the
    # larger tiles fill their waves better.
    assert [decode_block_n(128, torch.bfloat16, programs=p, num_sms=132) for p in (448, 512, 576, 768, 1216)] == \
        [64, 64, 128, 128, 128]
    assert decode_block_n(128, torch.float32, programs=256, num_sms=132) == 64
    assert decode_block_n(64, torch.bfloat16, programs=2048, num_sms=132) == 128  # capped


def test_num_splits_heuristic_bounds():
    # Small batches split long contexts to fill the GPU; big batches do not split; never beyond the bounds.
    assert choose_num_splits(1, 8, 8192, 64, 132) > 1
    assert choose_num_splits(256, 8, 8192, 64, 132) == 1
    assert choose_num_splits(17, 8, 8192, 64, 132) == 1  # 136 programs: a wave without splitting
    assert choose_num_splits(16, 8, 8192, 64, 132) > 1
    assert choose_num_splits(1, 8, 16, 64, 132) == 1
    for batch in (1, 3, 32, 256):
        for max_seq_len in (0, 1, 512, 131072):
            assert 1 <= choose_num_splits(batch, 8, max_seq_len, 64, 132) <= MAX_SPLITS


# ----------------------------------------------------------------------------- prefill

# (seq_lens, query_lens): full prompts, prefix-cache hits (query_len < seq_len), a decode row and a padding row
PREFILL_BATCH = ([40, 75, 9, 1, 0, 52], [40, 11, 9, 1, 0, 3])


@pytest.mark.parametrize("block_size,head_dim,group,dtype", pairwise(BLOCK_SIZES, HEAD_DIMS, GROUPS, DTYPES), ids=str)
def test_prefill_matches_reference(block_size, head_dim, group, dtype):
    seq_lens, query_lens = PREFILL_BATCH
    case = make_case(seq_lens, query_lens, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     seed=block_size * head_dim + group)
    m = case.meta
    out = paged_prefill_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                                  m.max_query_len, case.scale, out=poisoned_like(case.q))
    assert_matches(out, dense_reference(case), dtype)


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 64), (64, 32)])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_tile_shapes(block_size, block_m, block_n):
    # BLOCK_N below, equal to and above the cache block size; several query tiles per sequence
    seq_lens, query_lens = PREFILL_BATCH
    case = make_case(seq_lens, query_lens, group=4, head_dim=64, block_size=block_size, dtype=torch.float32, seed=5)
    m = case.meta
    out = paged_prefill_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                                  m.max_query_len, case.scale, out=poisoned_like(case.q), block_m=block_m,
                                  block_n=block_n)
    assert_matches(out, dense_reference(case), torch.float32)


@pytest.mark.parametrize("group", [1, 3])
def test_chunked_prefill_equals_one_shot_prefill(group):
    """A prompt computed in chunks (earlier chunks only in the cache) gives the rows of the one-shot prefill."""
    seq_len, chunks = 70, [(0, 25), (25, 64), (64, 70)]
    full = make_case([seq_len], [seq_len], group=group, head_dim=64, block_size=16, dtype=torch.float32, seed=9)
    fm = full.meta
    one_shot = paged_prefill_attention(full.q, full.k_cache, full.v_cache, fm.query_start_loc, fm.seq_lens,
                                       fm.block_tables, seq_len, full.scale, block_m=32, block_n=16)
    assert_matches(one_shot, dense_reference(full), torch.float32)
    for lo, hi in chunks:
        q = full.q[lo:hi]
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
        out = paged_prefill_attention(q, full.k_cache, full.v_cache, qsl, seq_lens, fm.block_tables, hi - lo,
                                      full.scale, out=poisoned_like(q), block_m=32, block_n=16)
        assert_matches(out, one_shot[lo:hi].double(), torch.float32)


def test_prefill_non_power_of_two_head_dim():
    case = make_case([30, 20], [30, 4], group=2, head_dim=96, block_size=16, dtype=torch.float16)
    m = case.meta
    out = paged_prefill_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                                  m.max_query_len, case.scale, out=poisoned_like(case.q))
    assert_matches(out, dense_reference(case), torch.float16)


# ----------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("decode", [True, False])
def test_paged_attention_triton_dispatch(decode):
    seq_lens, query_lens = ([12, 0, 50], [1, 1, 1]) if decode else PREFILL_BATCH
    case = make_case(seq_lens, query_lens, group=4, head_dim=64, block_size=16, dtype=torch.float32, seed=11)
    out = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_matches(out, dense_reference(case), torch.float32)


@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("num_decodes", [0, 2, 3])
def test_mixed_step_sends_leading_decodes_to_the_decode_kernel(num_decodes, with_out, monkeypatch):
    """A step with prefills behind num_decodes one-token sequences: those run the decode kernel (on their
    rows, into the same output), the rest the prefill kernel; the result is the reference's either way, and a
    given output buffer receives every row."""
    import tandem.kernels.triton_attention as attention

    seq_lens, query_lens = [30, 77, 5, 40, 19, 64], [1, 1, 1, 40, 6, 1]  # a one-token row after a prefill too
    case = make_case(seq_lens, query_lens, group=4, head_dim=64, block_size=16, dtype=torch.float32, seed=17)
    case.meta.num_decodes = num_decodes
    calls = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _real=real, _name=name, **kw: calls.append(
            (_name, a[0].shape[0], a[4].shape[0]))
            or _real(*a, **kw))
    out = poisoned_like(case.q) if with_out else None
    got = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale, out)
    assert_matches(got, dense_reference(case), torch.float32)
    if with_out:
        assert got is out
    if num_decodes:  # (kernel, q rows it gets, sequences it covers)
        assert calls == [("paged_decode_attention", num_decodes, num_decodes),
                         ("paged_prefill_attention", sum(query_lens), len(seq_lens) - num_decodes)]
    else:
        assert calls == [("paged_prefill_attention", sum(query_lens), len(seq_lens))]


def test_ops_dispatch_forced_to_triton_matches_reference_path(monkeypatch):
    """ops.* with TANDEM_FORCE_TRITON=1 runs the Triton kernels; the result equals the reference path."""
    seq_lens, query_lens = PREFILL_BATCH
    case = make_case(seq_lens, query_lens, group=4, head_dim=64, block_size=16, dtype=torch.float32, seed=13)
    num_tokens, num_kv_heads = case.q.shape[0], case.k_cache.shape[2]
    k_new = torch.randn(num_tokens, num_kv_heads, 64, device=DEVICE)
    v_new = torch.randn(num_tokens, num_kv_heads, 64, device=DEVICE)
    slots = torch.randperm(case.k_cache.shape[0] * 16)[:num_tokens].to(DEVICE)
    slots[0] = -1
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()

    monkeypatch.setenv("TANDEM_FORCE_TRITON", "0")
    ops.write_kv(k_new, v_new, ref_k, ref_v, slots)
    ref = ops.paged_attention(case.q, ref_k, ref_v, case.meta, case.scale)
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    ops.write_kv(k_new, v_new, case.k_cache, case.v_cache, slots)
    out = ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)

    assert torch.equal(case.k_cache, ref_k) and torch.equal(case.v_cache, ref_v)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- GPU: bf16, large shapes, graphs


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_decode_large(dtype, block_size, group):
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 4097, (24,), generator=gen).tolist() + [0, 8192, 1]
    case = make_case(seq_lens, [1] * len(seq_lens), group=group, head_dim=128, block_size=block_size, dtype=dtype,
                     num_kv_heads=8)
    m = case.meta
    ref = dense_reference(case, dtype=torch.float32)
    for num_splits in (1, None):
        out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                     out=poisoned_like(case.q), num_splits=num_splits)
        assert not torch.isnan(out).any()
        assert relative_error(out, ref) < 1e-2


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_prefill_large(dtype, head_dim):
    seq_lens, query_lens = LARGE_PREFILL
    case = make_case(seq_lens, query_lens, group=4, head_dim=head_dim, block_size=16, dtype=dtype, num_kv_heads=8)
    assert_prefill_close(case)


LARGE_PREFILL = ([2048, 1500, 1024 + 64, 333, 1, 0], [2048, 700, 64, 333, 1, 0])  # (seq_lens, query_lens)


def assert_prefill_close(case: Case) -> None:
    """The prefill kernel on a (large) case: no NaN, within relative L2 1e-2 of the float32 oracle."""
    m = case.meta
    out = paged_prefill_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                                  m.max_query_len, case.scale, out=poisoned_like(case.q))
    assert not torch.isnan(out).any()
    assert relative_error(out, dense_reference(case, dtype=torch.float32)) < 1e-2


@pytest.mark.gpu
@requires_cuda
def test_gpu_write_kv_bf16():
    num_tokens, num_kv_heads, head_dim, block_size = 300, 8, 128, 16
    kv = torch.zeros(2, 40, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(40 * block_size, device="cuda")[:num_tokens]
    slots[::7] = -1
    ref = kv.clone()
    ops.write_kv(k, v, kv[0], kv[1], slots)
    valid = slots >= 0
    ref[0].view(-1, num_kv_heads, head_dim)[slots[valid]] = k[valid]
    ref[1].view(-1, num_kv_heads, head_dim)[slots[valid]] = v[valid]
    assert torch.equal(kv, ref)


@pytest.mark.gpu
@requires_cuda
def test_gpu_decode_cuda_graph_replay_matches_eager():
    """Captured once with static buffers; new seq_lens / block tables copied in before each replay."""
    batch, max_seq_len = 8, 2048
    case = make_case([max_seq_len] * batch, [1] * batch, group=4, head_dim=128, block_size=16,
                     dtype=torch.bfloat16, num_kv_heads=8)
    m = case.meta
    static_q, static_bt, static_lens = case.q.clone(), m.block_tables.clone(), m.seq_lens.clone()
    static_out = torch.empty_like(static_q)
    num_splits = choose_num_splits(batch, 8, max_seq_len, 64, torch.cuda.get_device_properties(0).multi_processor_count)
    workspace = torch.empty(decode_workspace_numel(batch, static_q.shape[1], 128, num_splits), device="cuda")

    def run():
        paged_decode_attention(static_q, case.k_cache, case.v_cache, static_bt, static_lens, case.scale,
                               out=static_out, num_splits=num_splits, max_seq_len=max_seq_len, workspace=workspace)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        lens = torch.randint(0, max_seq_len + 1, (batch,), generator=gen, dtype=torch.int32)
        static_lens.copy_(lens)
        static_q.copy_(torch.randn(static_q.shape, generator=gen).to(static_q))
        static_bt.copy_(m.block_tables[torch.randperm(batch, generator=gen)])  # rows trade places
        graph.replay()
        eager = paged_decode_attention(static_q, case.k_cache, case.v_cache, static_bt, static_lens, case.scale,
                                       num_splits=num_splits)
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)


@pytest.mark.parametrize("one_tile_programs,group,num_splits", pairwise([1 << 20, 42, 0], [1, 4], [2, 5, 16, 64]))
def test_decode_many_splits_odd_lengths_and_padding_rows(num_splits, group, one_tile_programs):
    # More splits than tiles (most empty), odd context lengths, and seq_len 0 rows that must read exactly 0. Past
    # one_tile_programs (over 7 rows x 2 kv heads) a sequence takes two tiles a share or more, its trailing splits
    # empty: at 42 the sequences of over 3 tiles (63 and 129 tokens: 4 and 9 tiles of 16), at 0 every one.
    seq_lens = [0, 1, 17, 63, 0, 129, 3]
    case = make_case(seq_lens, [1] * len(seq_lens), group=group, head_dim=32, block_size=16, dtype=torch.float32,
                     seed=num_splits + group)
    m = case.meta
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                 out=poisoned_like(case.q), num_splits=num_splits, block_n=16,
                                 one_tile_programs=one_tile_programs)
    assert_matches(out, dense_reference(case), torch.float32)
    for i, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))


def test_decode_merge_in_several_rounds():
    # 8 heads of 128 dims merge 4 splits a round (_merge_tile): 9 used splits of 129 tokens take three rounds,
    # whose running max and sum carry over; 3 and 4 splits fit one round, exactly or not.
    assert _merge_tile(8, 128, 64) == (8, 4)
    seq_lens = [129, 0, 33, 64, 5]
    case = make_case(seq_lens, [1] * len(seq_lens), group=8, head_dim=128, block_size=16, dtype=torch.float32,
                     seed=11)
    m = case.meta
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                 out=poisoned_like(case.q), num_splits=64, block_n=16)
    assert_matches(out, dense_reference(case), torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_decode_merge_in_one_round_where_the_grid_fits_one_wave():
    # 4 heads of 128 dims: 32 splits merge in one round when the grid fits 3 programs an SM (batch 1 x 8 kv heads
    # x 32 splits = 256 on 132 SMs), in rounds of 8 otherwise; 19 used splits of 300 tokens fill part of the round.
    assert _merge_tile(4, 128, 32, 256, 132) == (4, 32)
    assert _merge_tile(4, 128, 32, 512, 132) == (4, 8)
    case = make_case([300, 17], [1, 1], group=4, head_dim=128, block_size=16, dtype=torch.float32, seed=5)
    m = case.meta
    assert choose_num_splits(2, NUM_KV_HEADS, 8192, 16, 132) == MAX_SPLITS == 32
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                 out=poisoned_like(case.q), num_splits=32, block_n=16)
    assert_matches(out, dense_reference(case), torch.float32)


def test_num_splits_fill_the_gpu_at_batch_one_short_context():
    # bs1 x 512 tokens x 8 kv heads, 64-token tiles: one tile per split, 8 x 8 = 64 programs (was 2 x 8).
    assert choose_num_splits(1, 8, 512, 64, 132) == 8
    # Enough programs already: no split.
    assert choose_num_splits(256, 8, 512, 64, 132) == 1
    assert choose_num_splits(1, 8, 512, 64, 132, min_tiles_per_split=4) == 2
    # Whole waves of 4 programs an SM: batch 8 x 8 kv heads takes 8 splits (512 programs), not 9 (576).
    assert choose_num_splits(8, 8, 8192, 64, 132) == 8
    assert choose_num_splits(4, 8, 8192, 64, 132) == 16
    assert choose_num_splits(1, 8, 8192, 64, 132) == MAX_SPLITS  # 66 would fit; the merge caps it


_COMPILE_PREFILL_SM90 = r"""
import json, re, sys
import torch, triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_attention import _prefill_config, _prefill_kernel as kernel

unit = ("stride_d", "stride_qd", "stride_od")
block_m, block_n, warps, stages = _prefill_config(128, torch.bfloat16)
got = {}
for kv in ("bf16", "fp8e4nv"):  # the KV cache's element type (an FP8 cache's tiles are widened in registers)
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*" + kv, "v_ptr": "*" + kv, "bt_ptr": "*i32", "qsl_ptr": "*i32",
            "seq_lens_ptr": "*i32", "out_ptr": "*bf16"}
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_M=block_m, BLOCK_N=block_n,
                  DOT_PRECISION="tf32", USE_PDL=2, KV_FP8=kv != "bf16", KV_DT=tl.float16, **{u: 1 for u in unit})
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "fp32" if a == "qk_scale" else "i32")
           for a in kernel.arg_names}
    div = [i for i, a in enumerate(kernel.arg_names) if a in ptrs or (a.startswith("stride") and a not in unit)]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in div})
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps, "num_stages": stages}).asm
    # The waits on the K/V copies inside the two tile loops: how many copy groups each leaves in flight.
    in_loop = [int(m) for m in re.findall(r"ttg.async_wait %tile\S*, %tile\S*, %pages\S* \{num = (\d+)",
                                          asm["ttgir"])]
    got[kv] = {"in_loop_waits": in_loop, "local": "ld.local" in asm["ptx"] or "st.local" in asm["ptx"]}
json.dump(got, sys.stdout)
"""


def test_prefill_kernel_double_buffers_its_kv_tiles_on_sm90():
    """The block-table load of a tile takes pipeline stages of its own: at the prefill's num_stages the loops'
    waits on the K/V copies must leave the next tile's copies in flight (num > 0), or each tile's loads wait
    for the tile before it to be done."""
    from tests.kernels.sm90 import compile_sm90

    for kv, got in compile_sm90(_COMPILE_PREFILL_SM90).items():  # bf16 and FP8 KV caches
        assert len(got["in_loop_waits"]) == 2 and all(n > 0 for n in got["in_loop_waits"]), (kv, got)
        assert not got["local"], kv
