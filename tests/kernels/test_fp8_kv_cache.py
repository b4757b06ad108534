"""An FP8 (e4m3, scale 1) KV cache through every kernel that writes or reads it: the writes round as
reference.to_cache_dtype does (saturating at +-448), the attention kernels widen the cached values exactly
and match the dense oracle on them, and the PyTorch reference path agrees (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.fp8 import FP8_DTYPE
from tandem.kernels.reference import paged_attention_ref, to_cache_dtype, write_kv_ref
from tandem.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
from tandem.kernels.triton_kv import write_kv_triton
from tandem.kernels.triton_rotary_kv import rotary_write_kv_triton
from tests.sweeps import pairwise

from .test_decode_rotary import make_step, run_both
from .test_triton_kernels import (
    DEVICE,
    LARGE_PREFILL,
    PREFILL_BATCH,
    TOL,
    assert_prefill_close,
    dense_reference,
    make_case,
    poisoned_like,
    relative_error,
    requires_cuda,
)

DTYPES = [torch.float32, torch.float16]


def fp8_case(case):
    """The case with its caches stored in FP8 (what the kernels read, and the oracle sees, is the e4m3 values)."""
    case.k_cache = to_cache_dtype(case.k_cache, FP8_DTYPE)
    case.v_cache = to_cache_dtype(case.v_cache, FP8_DTYPE)
    return case


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def test_to_cache_dtype_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([0.0, 1.0, -3.3, 447.0, 449.0, 1e4, -1e4, 0.0019])
    got = to_cache_dtype(x, FP8_DTYPE).float()
    assert got.tolist()[:3] == [0.0, 1.0, -3.25]
    assert got[3] == 448.0 and got[4] == 448.0 and got[5] == 448.0 and got[6] == -448.0  # never NaN
    assert torch.equal(got, x.clamp(-448, 448).to(FP8_DTYPE).float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_into_fp8_cache_rounds_like_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    num_tokens, kv_heads, head_dim, page, num_blocks = 13, 2, 64, 16, 4
    k = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen) * 200).to(dtype)  # past +-448 too
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slots[4] = -1
    caches = [torch.zeros(num_blocks, page, kv_heads, head_dim, dtype=FP8_DTYPE) for _ in range(4)]
    write_kv_ref(k, v, caches[0], caches[1], slots)
    kc, vc = caches[2].to(DEVICE), caches[3].to(DEVICE)
    write_kv_triton(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE))
    assert torch.equal(bits(kc.cpu()), bits(caches[0])) and torch.equal(bits(vc.cpu()), bits(caches[1]))
    assert caches[0].float().abs().max() == 448.0 and not caches[0].float().isnan().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk_norm+rope"])
def test_rotary_write_kv_into_fp8_cache(dtype, norm):
    st = make_step([5, 20, 1], group=2, head_dim=64, page=16, dtype=dtype)
    weights = (st["q_w"], st["k_w"]) if norm else (None, None)
    kv_model = st["kv"].clone()
    kv_fp8 = to_cache_dtype(st["kv"], FP8_DTYPE)
    outs = []
    for kv in (kv_model, kv_fp8):
        qkv = st["qkv"].clone()
        h, kvh, d = st["num_heads"], st["num_kv_heads"], st["head_dim"]
        q = qkv[:, : h * d].view(-1, h, d)
        k = qkv[:, h * d: (h + kvh) * d].view(-1, kvh, d)
        v = qkv[:, (h + kvh) * d:].view(-1, kvh, d)
        rotary_write_kv_triton(q, k, v, st["cos"], st["sin"], kv[0], kv[1], st["slots"], *weights, eps=1e-6)
        outs.append(qkv)
    assert torch.equal(outs[0], outs[1])  # q and k rotate the same whatever the cache holds
    assert torch.equal(bits(kv_fp8), bits(to_cache_dtype(kv_model, FP8_DTYPE)))  # written slots as they round


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_decode_reads_fp8_cache(dtype, group):
    seq_lens = [1, 0, 37, 130, 64]
    case = fp8_case(make_case(seq_lens, [1] * len(seq_lens), group=group, head_dim=64, block_size=16, dtype=dtype,
                              seed=group))
    ref = dense_reference(case)
    m = case.meta
    for num_splits in (1, 3, None):
        out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                     out=poisoned_like(case.q), num_splits=num_splits)
        assert out.dtype == dtype
        torch.testing.assert_close(out.to(ref.dtype), ref, atol=TOL[dtype], rtol=TOL[dtype])
    # The PyTorch reference path (CPU serving, and the oracle) reads the FP8 cache the same way.
    torch.testing.assert_close(paged_attention_ref(case.q, case.k_cache, case.v_cache, m, case.scale).to(ref.dtype),
                               ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_reads_fp8_cache(dtype, group):
    seq_lens, query_lens = PREFILL_BATCH
    case = fp8_case(make_case(seq_lens, query_lens, group=group, head_dim=64, block_size=16, dtype=dtype,
                              seed=10 + group))
    m = case.meta
    ref = dense_reference(case)
    out = paged_prefill_attention(case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                                  m.max_query_len, case.scale, out=poisoned_like(case.q))
    torch.testing.assert_close(out.to(ref.dtype), ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(paged_attention_ref(case.q, case.k_cache, case.v_cache, m, case.scale).to(ref.dtype),
                               ref, atol=TOL[dtype], rtol=TOL[dtype])


# Every pair of values on the CPU (tests/sweeps.py), the cross product on a GPU.
@pytest.mark.parametrize("group,num_splits,norm,dtype", pairwise([(1, 1), (4, 3), (4, 16)], [False, True], DTYPES),
                         ids=lambda v: ("qk_norm+rope" if v else "rope") if isinstance(v, bool) else str(v))
def test_fused_rotary_decode_on_fp8_cache(dtype, norm, group, num_splits):
    """The decode kernel's own rotary + cache write (the new token from registers) against the rotary kernel
    followed by the plain decode kernel, both on an FP8 cache."""
    st = make_step([17, 0, 1, 70, 33, 129], group=group, head_dim=64, page=16, dtype=dtype)
    st["kv"] = to_cache_dtype(st["kv"], FP8_DTYPE)
    out, kv, ref, kv_ref, qkv = run_both(st, norm=norm, num_splits=num_splits)
    assert not torch.isnan(out).any()
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}[dtype]
    torch.testing.assert_close(out, ref, **tol)
    if norm:  # the norm's sum of squares may add up in another order: a rare last-bit flip in e4m3
        assert (bits(kv) != bits(kv_ref)).float().mean() < 1e-3
    else:
        assert torch.equal(bits(kv), bits(kv_ref))
    assert torch.equal(qkv, st["qkv"])


# ----------------------------------------------------------------------------- GPU: bf16 queries, real sizes

@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("group", [1, 4])
def test_gpu_decode_and_prefill_read_fp8_cache_bf16(group):
    """Llama-3-8B-like heads (8 kv heads, head_dim 128) over contexts up to 8K: the kernels on the e4m3 cache
    match the float32 oracle on the same e4m3 values as closely as on a bf16 cache (bf16 q and dots)."""
    gen = torch.Generator().manual_seed(group)
    seq_lens = torch.randint(1, 4097, (24,), generator=gen).tolist() + [0, 8192, 1]
    case = fp8_case(make_case(seq_lens, [1] * len(seq_lens), group=group, head_dim=128, block_size=16,
                              dtype=torch.bfloat16, num_kv_heads=8))
    m = case.meta
    ref = dense_reference(case, dtype=torch.float32)
    for num_splits in (1, None):
        out = paged_decode_attention(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens, case.scale,
                                     out=poisoned_like(case.q), num_splits=num_splits)
        assert not torch.isnan(out).any() and relative_error(out, ref) < 1e-2
    seq_lens, query_lens = LARGE_PREFILL
    assert_prefill_close(fp8_case(make_case(seq_lens, query_lens, group=group, head_dim=128, block_size=16,
                                            dtype=torch.bfloat16, num_kv_heads=8)))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("group,num_kv_heads,batch", [(1, 32, 1), (4, 8, 32)])
def test_gpu_fused_rotary_decode_on_fp8_cache_bf16(group, num_kv_heads, batch):
    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, 2048, (batch,), generator=gen).tolist()
    st = make_step(seq_lens, group=group, head_dim=128, page=16, dtype=torch.bfloat16, num_kv_heads=num_kv_heads)
    st["kv"] = to_cache_dtype(st["kv"], FP8_DTYPE)
    out, kv, ref, kv_ref, qkv = run_both(st, norm=False, num_splits=None)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    # The two kernels' bf16 rotary products may round apart in the last bit (FMA contraction), which e4m3
    # rarely preserves.
    assert (bits(kv) != bits(kv_ref)).float().mean() < 1e-3
    assert torch.equal(qkv, st["qkv"])
